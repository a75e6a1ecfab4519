"""The planner shows the cut points training uses (sagenb issue 18, item 1): `sagenb.plan`'s
`cuts` equal the "cuts" a run reports at its first step, for every partition method, --cuts
given, --delay-init on and off, an fx-split model and a transformers one (torch.export split);
a --cuts or stage count the model cannot take is the same error from both."""

from __future__ import annotations

import re

import pytest

import sagenb
from sagenb.config.job import JobError

from .models import LM_CELLS as CELLS

# Block 1 is slow and light (one small Linear run 40 times), blocks 2-3 are heavy in
# parameters and quick: measured time cuts after block 1, parameter counts after block 2, so
# a planner that times what training only counts (--delay-init) shows cuts training won't use.
SKEWED_CELL = """
import torch
from torch import nn

class Repeat(nn.Module):
    def __init__(self, width, times):
        super().__init__()
        self.lin, self.times = nn.Linear(width, width), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.lin(x))
        return x

model = nn.Sequential(
    nn.Linear(8, 32), Repeat(32, 40), nn.Linear(32, 256), nn.Linear(256, 256),
    nn.Linear(256, 32), nn.Linear(32, 1),
)
X = torch.randn(64, 8)
dataset = torch.utils.data.TensorDataset(X, X @ torch.randn(8, 1))
loss_fn = nn.functional.mse_loss
"""
LLAMA_CELL = CELLS["llama"]
RUN = dict(strategy="model", partitions=2, batch_size=16, microbatches=2, steps=1)


def _trained_cuts(cell: str, **options) -> list[int]:
    result = sagenb.train(cell, dashboard=False, **{**RUN, **options})
    first = [m.values for m in result.metrics if m.step == min(x.step for x in result.metrics)]
    reported = {tuple(values["cuts"]) for values in first}
    assert len(reported) == 1, reported  # every rank cuts the same way
    return list(reported.pop())


def _planned(cell: str, pool, **options) -> sagenb.Plan:
    return sagenb.plan(cell, pool=pool, **{**RUN, **options})


@pytest.mark.parametrize("delay_init", [False, True])
@pytest.mark.parametrize(
    "method",
    [dict(partition_by=m) for m in ("auto", "parameters", "uniform")]
    + [dict(partition_by="manual", cuts="4")],
    ids=lambda m: m["partition_by"],
)
def test_sequential_plan_cuts_are_trainings(pool, method, delay_init):
    plan = _planned(SKEWED_CELL, pool, delay_init=delay_init, **method)
    assert list(plan.cuts) == _trained_cuts(SKEWED_CELL, delay_init=delay_init, **method)
    assert plan.measured is not delay_init
    if delay_init and method["partition_by"] == "auto":  # meta parameters: counted, not timed
        assert plan.method == "parameters" and list(plan.cuts) == [3]
    if not delay_init and method["partition_by"] == "auto":
        assert list(plan.cuts) == [2]  # the slow block alone with the first


def test_delay_init_plan_materialises_nothing(pool):
    plan = _planned(SKEWED_CELL, pool, delay_init=True)
    # parameter bytes of the cut (counted on meta parameters), no times (never run)
    assert plan.stages[0].params_mib > 0 and plan.estimated_step_s != plan.estimated_step_s
    assert "times not measured (--delay-init" in plan.table()


def test_transformers_plan_cuts_are_trainings(pool):
    """Split through torch.export, profiled on its stages in both. Only `parameters`: uniform
    and manual do not depend on the front end, and auto on equal decoder layers is a toss-up
    of timing noise, decided separately in the planner's run and in training's."""
    plan = _planned(LLAMA_CELL, pool, partition_by="parameters")
    assert list(plan.cuts) == _trained_cuts(LLAMA_CELL, partition_by="parameters") == [2]


def _same_error(cell: str, pool, match: str, **options) -> None:
    with pytest.raises(JobError, match=match) as planned:
        _planned(cell, pool, **options)
    with pytest.raises(JobError, match=match) as trained:
        _trained_cuts(cell, **options)
    assert str(planned.value) == str(trained.value)


@pytest.mark.parametrize("delay_init", [False, True])
def test_cuts_past_the_blocks_are_one_error(pool, delay_init):
    _same_error(
        SKEWED_CELL,
        pool,
        re.escape("--cuts 6: the model has only 6 blocks (0..5); give 1 increasing block"),
        partition_by="manual",
        cuts="6",
        delay_init=delay_init,
    )


def test_more_stages_than_blocks_is_one_error(pool):
    _same_error(
        SKEWED_CELL,
        pool,
        "has 6 blocks, fewer than the 8 pipeline stages asked for: lower --partitions or "
        "--virtual-stages",
        schedule="interleaved",
        virtual_stages=4,
        microbatches=4,
    )


def test_delay_init_on_a_model_only_export_splits_is_one_error(pool):
    _same_error(LLAMA_CELL, pool, "--delay-init: torch.fx cannot trace", delay_init=True)
