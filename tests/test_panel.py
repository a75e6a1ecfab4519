"""The control panel is built from the config's field spec: a widget per field, in its section's
tab, unless the field says `panel=False`; an option only some strategies use is greyed out under
the others. It produces the same config as the magic line it shows; bad combinations show their
message in place; `%%smp_train --config panel` trains through the magic's code path."""

from __future__ import annotations

import dataclasses
import json
import shutil
from importlib import resources

import ipywidgets as widgets
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import sagenb
from sagenb.config.options import (
    SECTIONS,
    TrainConfig,
    _opt,
    _strategy_keywords,
    every_option,
    option_owners,
    strategy_names,
)
from sagenb.metrics.result import TrainResult
from sagenb.notebook import panel as panel_module
from sagenb.notebook.magics import parse_train_line

from .conftest import REGRESSION_CELL


def set_options(panel, **values):
    """As a user sets them: a text box takes text ("" leaves an optional option unset)."""
    for name, value in values.items():
        panel.controls[name].value = value


def shown_line(panel) -> str:
    return panel.line.value.removeprefix("<code>").removesuffix("</code>")


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"batch_size": 64, "epochs": 3, "lr": 0.01, "instance": "ml.g5.12xlarge"},
        {"strategy": "model", "partitions": 2, "microbatches": 4, "schedule": "gpipe"},
        {
            "strategy": "hybrid",
            "engines": "4",
            "partitions": 2,
            "microbatches": 2,
            "steps": "10",
            "partition_by": "parameters",
        },
        {"strategy": "tensor", "tensor_parallel": "2", "precision": "bf16"},
        {"strategy": "sharded", "activation_checkpointing": True, "precision": "fp16"},
        {"strategy": "sharded", "reshard_after_forward": False, "engines": ""},
        {
            "strategy": "model",
            "engines": "3",
            "partitions": 3,
            "partition_by": "manual",
            "cuts": "1, 2",
        },
        {"threads": "2", "clip_grad_norm": "0.5", "seed": 7, "stop_on_nonfinite": True},
        {"dashboard": False, "out": "mine", "spot_discount": 0.5, "price_per_hour": "2.5"},
    ],
)
def test_panel_round_trips_to_the_magic_line(values):
    panel = sagenb.ControlPanel()
    set_options(panel, **values)
    assert panel.config is not None, panel.error
    assert parse_train_line(shown_line(panel).removeprefix("%%smp_train ")) == panel.config


def test_every_option_the_panel_is_given_comes_back(tmp_path):
    """Every widget writes and reads its option: a config with each field changed, given to
    the panel, is the panel's config and its line's, and each widget reads its own value."""
    prices = tmp_path / "prices.json"
    shutil.copy(str(resources.files("sagenb.sizing") / "tables" / "prices.json"), prices)
    common = dict(threads=1,
                  batch_size=16, epochs=2, steps=5, lr=0.01, seed=3, grad_accum=2,
                  clip_grad_norm=1.0, eval_every=2, data_workers=1, timeout=60.0,
                  stop_on_nonfinite=True, precision="bf16", activation_checkpointing=True,
                  offload_activations=True, delay_init=True,
                  checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
                  resume=True, dashboard=False, instance="ml.g5.12xlarge", price_per_hour=3.5,
                  price_table=str(prices), hardware_table=str(tmp_path / "hw.json"),
                  spot_discount=0.5, out="mine", log_dir=str(tmp_path / "logs"),
                  if_busy="fail")  # fmt: skip
    own = [
        dict(
            strategy="hybrid",
            engines=4,
            partitions=2,
            partition_by="manual",
            cuts=(1,),
            microbatches=2,
            schedule="gpipe",
            virtual_stages=3,
        ),
        dict(strategy="model", partitions=2, memory_budget=2.5),
        dict(strategy="tensor", engines=4, tensor_parallel=2),
        dict(strategy="sharded", engines=4, reshard_after_forward=False, replicas=2),
        dict(engines=4, expert_parallel=2),
    ]
    changed = set()
    for options in own:
        config = TrainConfig(**{**common, **options})
        panel = sagenb.ControlPanel(**dataclasses.asdict(config))
        assert panel.config == config, panel.error
        assert parse_train_line(shown_line(panel).removeprefix("%%smp_train ")) == config
        for name, control in panel.options.items():
            assert control.read() == config.option(name), name
        changed |= {o.name for o in every_option() if config.option(o.name) != o.default}
    assert changed == set(panel.controls), "an option this test leaves at its default"


def test_every_field_has_a_widget_in_its_sections_tab():
    """The widgets are the options (the fields, and where `strategy_options` stands those the
    strategies declare), less those declared `panel=False`, each in the tab of its section
    (SECTIONS order), with the flag and its help as the tooltip."""
    panel = sagenb.ControlPanel()
    shown = [o for o in every_option() if o.panel]
    assert list(panel.controls) == [o.name for o in shown]
    assert "replicas" in panel.controls  # declared by sharded (engine/strategies/sharded.py)
    in_use = {o.section for o in shown}
    titles = [section.title for name, section in SECTIONS.items() if name in in_use]
    assert list(panel.sections.titles) == titles
    by_title = dict(zip(panel.sections.titles, panel.sections.children, strict=True))
    for name, section in SECTIONS.items():
        if section.title not in by_title:
            continue
        about, grid = by_title[section.title].children
        assert section.about in about.value
        names = [o.name for o in shown if o.section == name]
        assert list(grid.children) == [panel.controls[n] for n in names]
    for o in shown:
        tooltip = panel.controls[o.name].tooltip
        assert tooltip.startswith(f"--{o.name.replace('_', '-')}"), tooltip
        assert o.help.replace("%%", "%") in tooltip


def test_widgets_follow_each_fields_type_and_metadata():
    panel = sagenb.ControlPanel()
    kinds = {
        "strategy": widgets.Dropdown,  # choices: a function (the strategy registry)
        "schedule": widgets.Dropdown,  # choices: a tuple
        "engines": widgets.Text,  # may be unset: "" is None
        "cuts": widgets.Text,  # its flag's own parse
        "partitions": widgets.IntText,
        "lr": widgets.FloatText,
        "resume": widgets.Checkbox,
        "instance": widgets.Combobox,  # suggested, not enforced (a price table of your own)
        "out": widgets.Text,
    }
    for name, kind in kinds.items():
        assert type(panel.controls[name]) is kind, name
    assert panel.controls["strategy"].options == strategy_names()
    assert "ml.g5.12xlarge" in panel.controls["instance"].options
    assert panel.controls["engines"].value == "2"  # the panel starts a pool of the default size
    assert sagenb.ControlPanel(engines=None).controls["engines"].value == ""


def test_the_instances_offered_are_those_of_the_price_table_the_options_name(tmp_path):
    """--instance offers the instance types of the price table (its own, once --price-table
    names one), without enforcing them: check_price says what is allowed."""
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"instances": {"my.box": {"usd_per_hour": 1, "accelerators": 0}}}))
    panel = sagenb.ControlPanel()
    set_options(panel, price_table=str(table))
    assert panel.controls["instance"].options == ("my.box",)
    assert "--instance 'ml.p4d.24xlarge': must be one of my.box" in panel.error
    set_options(panel, instance="my.box")
    assert panel.config is not None and panel.config.instance == "my.box"
    set_options(panel, price_table=str(tmp_path / "missing.json"))
    assert panel.controls["instance"].options == ("my.box",)  # kept while none can be read
    assert "--price-table" in panel.error and "cannot be read" in panel.error


def test_a_field_added_to_the_spec_gets_a_widget(monkeypatch):
    """A new option needs no edit of the panel: declared as the config's fields are, it gets a
    widget in its section's tab and reaches the config; one declared panel=False keeps the
    value the panel was given."""
    # as TrainConfig is made: its __init__ takes the options strategies declare as keywords
    extended = _strategy_keywords(
        dataclasses.make_dataclass(
            "ExtendedConfig",
            [
                ("warmup_steps", int, _opt("training", 0, "steps of linear learning-rate warm-up")),
                ("smoothing", float | None, _opt("training", None, "label smoothing", shown="off")),
                ("note", str, _opt("output", "", "a note kept with the result", panel=False)),
            ],
            bases=(TrainConfig,),
            frozen=True,
            kw_only=True,
        )
    )
    monkeypatch.setattr(panel_module, "TrainConfig", extended)
    panel = sagenb.ControlPanel(note="kept")
    assert type(panel.controls["warmup_steps"]) is widgets.IntText
    assert panel.controls["smoothing"].placeholder == "off"
    assert "note" not in panel.controls
    training = dict(zip(panel.sections.titles, panel.sections.children, strict=True))["Training"]
    assert panel.controls["warmup_steps"] in training.children[1].children
    set_options(panel, warmup_steps=100, smoothing="0.1")
    assert panel.config == extended(engines=2, warmup_steps=100, smoothing=0.1, note="kept")
    assert (
        shown_line(panel)
        == "%%smp_train --engines 2 --warmup-steps 100 --smoothing 0.1 --note kept"
    )


def test_options_of_other_strategies_are_greyed_out_and_left_at_their_default():
    """An option only some strategies use (the options they declare) can be set only under them;
    under another it keeps what was typed, greyed out, and the config has its default."""
    panel = sagenb.ControlPanel()
    for strategy in strategy_names():
        panel.controls["strategy"].value = strategy
        for name, widget in panel.controls.items():
            owners = option_owners(name)  # the strategies that declare it
            assert widget.disabled == bool(owners and strategy not in owners), (strategy, name)
    assert "--strategy model or hybrid" in panel.controls["partitions"].tooltip
    set_options(panel, engines="", strategy="model", partitions=3)
    assert shown_line(panel) == "%%smp_train --strategy model --partitions 3"
    set_options(panel, strategy="data")
    assert panel.controls["partitions"].disabled and panel.controls["partitions"].value == 3
    assert panel.config is not None and panel.config.partitions == 1
    assert shown_line(panel) == "%%smp_train"
    set_options(panel, strategy="hybrid", engines="6")
    assert panel.config is not None and panel.config.partitions == 3


@pytest.mark.parametrize(
    "values, message",
    [
        ({"strategy": "model"}, "--partitions 1: --strategy model needs at least 2"),
        ({"strategy": "model", "partitions": 4, "microbatches": 2}, "--microbatches 2: 1f1b needs"),
        ({"batch_size": 33}, "--batch-size 33: must be divisible by engines x grad-accum"),
        ({"lr": -1.0}, "--lr -1.0: must be a finite number"),
        (
            {"strategy": "hybrid", "partitions": 2, "engines": "3"},
            "--engines 3: must be a multiple of --partitions",
        ),
        ({"steps": "ten"}, "--steps 'ten': must be an integer"),
        (
            {"strategy": "model", "memory_budget": "1 GiB"},
            "--memory-budget '1 GiB': must be a number",
        ),
        ({"strategy": "model", "cuts": "2,x"}, "--cuts '2,x': must be block indices"),
        ({"instance": "my.box"}, "--instance 'my.box': must be one of"),
    ],
)
def test_invalid_combinations_show_why(values, message):
    panel = sagenb.ControlPanel()
    set_options(panel, **values)
    assert panel.config is None and message in panel.message.value.replace("&gt;", ">").replace(
        "&#x27;", "'"
    )
    assert panel.line.value == ""
    assert message in panel.plan_text()


def test_the_pool_buttons_start_the_engines_the_options_need():
    """Start and Restart ask for --engines, else what the strategy needs, else (options that
    are invalid) the engines typed, else the default pool's size."""
    panel = sagenb.ControlPanel()
    assert panel._pool_size() == 2
    set_options(panel, strategy="model", partitions=4, engines="")
    assert panel.config is not None and panel._pool_size() == 4
    set_options(panel, strategy="data", engines="3")  # 32 samples do not split over 3
    assert panel.config is None and panel._pool_size() == 3
    set_options(panel, engines="three")
    assert panel._pool_size() == 2


def test_magic_trains_with_the_panel(pool):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    panel = sagenb.ControlPanel(dashboard=False, out="from_panel")
    set_options(panel, batch_size=32, steps="3")
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
