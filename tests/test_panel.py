"""The control panel produces the same config as the magic line it shows; bad combinations show
their message in place; `%%smp_train --config panel` trains through the magic's code path."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import sagenb
from sagenb.metrics.result import TrainResult
from sagenb.notebook.magics import parse_train_line

from .conftest import REGRESSION_CELL


def set_options(panel, **values):
    for name, value in values.items():
        panel.controls[name].value = value


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"batch_size": 64, "epochs": 3, "lr": 0.01, "instance": "ml.g5.12xlarge"},
        {"strategy": "model", "partitions": 2, "microbatches": 4, "schedule": "gpipe"},
        {
            "strategy": "hybrid",
            "engines": 4,
            "partitions": 2,
            "microbatches": 2,
            "steps": 10,
            "partition_by": "parameters",
        },
        {"strategy": "tensor", "tensor_parallel": 2, "precision": "bf16"},
        {"strategy": "sharded", "activation_checkpointing": True, "precision": "fp16"},
    ],
)
def test_panel_round_trips_to_the_magic_line(values):
    panel = sagenb.ControlPanel()
    set_options(panel, **values)
    assert panel.config is not None, panel.error
    shown = panel.line.value.removeprefix("<code>").removesuffix("</code>")
    assert parse_train_line(shown.removeprefix("%%smp_train ")) == panel.config


@pytest.mark.parametrize(
    "values, message",
    [
        ({"strategy": "model"}, "--partitions 1: --strategy model needs at least 2"),
        ({"strategy": "model", "partitions": 4, "microbatches": 2}, "--microbatches 2: 1f1b needs"),
        ({"batch_size": 33}, "--batch-size 33: must be divisible by engines x grad-accum"),
        ({"lr": -1.0}, "--lr -1.0: must be a finite number"),
        (
            {"strategy": "hybrid", "partitions": 2, "engines": 3},
            "--engines 3: must be a multiple of --partitions",
        ),
    ],
)
def test_invalid_combinations_show_why(values, message):
    panel = sagenb.ControlPanel()
    set_options(panel, **values)
    assert panel.config is None and message in panel.message.value.replace("&gt;", ">")
    assert panel.line.value == ""
    assert message in panel.plan_text()


def test_magic_trains_with_the_panel(pool):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    panel = sagenb.ControlPanel(dashboard=False, out="from_panel")
    set_options(panel, batch_size=32, steps=3)
    shell.run_cell_magic("smp_train", "--config panel", REGRESSION_CELL)
    result = shell.user_ns["from_panel"]
    assert isinstance(result, TrainResult) and len(result.history) == 3
    assert result.config == panel.config
    panel._show_pool()
    assert panel.pool_status.value.startswith("2 engines: rank 0 (engine ")
    assert "rank 1 (engine " in panel.pool_status.value
    with pytest.raises(UsageError, match="takes no other flags"):
        shell.run_cell_magic("smp_train", "--config panel --steps 2", REGRESSION_CELL)
    set_options(panel, batch_size=33)
    with pytest.raises(UsageError, match="the panel's options are invalid: --batch-size 33"):
        shell.run_cell_magic("smp_train", "--config panel", REGRESSION_CELL)


def test_plan_button_reports_bubble_and_cost():
    panel = sagenb.ControlPanel()
    set_options(panel, strategy="model", partitions=2, microbatches=4, instance="ml.p4d.24xlarge")
    text = panel.plan_text()
    assert "pipeline bubble (p-1)/(v m+p-1): 20.0%" in text
    assert "1 x ml.p4d.24xlarge at $37.688/h" in text
