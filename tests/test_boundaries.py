"""The engine side stays free of notebook libraries; a failing rank does not hang the others."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import sagenb
from sagenb.session import TrainingError

from .conftest import REGRESSION_CELL


def test_engine_side_imports_no_notebook_libraries():
    code = (
        "import sys, sagenb.engine.entry, sagenb.engine.loop, sagenb.engine.strategies; "
        "print(sorted(m for m in ('IPython', 'ipywidgets', 'plotly') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


FAILING_CELL = (
    REGRESSION_CELL
    + """
import torch.distributed as dist
calls = [0]
def loss_fn(output, target):
    calls[0] += 1
    if dist.get_rank() == 1 and calls[0] == 4:
        raise ValueError("bad batch on purpose")
    return torch.nn.functional.mse_loss(output, target)
"""
)


def test_a_failing_rank_is_reported_and_the_pool_stays_usable(pool):
    started = time.perf_counter()
    with pytest.raises(
        TrainingError, match=r"(?s)rank 1 \(engine \d+\) failed.*bad batch on purpose"
    ):
        sagenb.train(FAILING_CELL, batch_size=16, steps=20, dashboard=False)
    assert time.perf_counter() - started < 5  # the peer was released, not timed out
    assert pool.size == 2
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3


STUCK_CELL = (
    REGRESSION_CELL
    + """
import time
import torch.distributed as dist
calls = [0]
def loss_fn(output, target):
    calls[0] += 1
    if calls[0] == 4:
        if dist.get_rank() == 1:
            raise ValueError("bad batch on purpose")
        time.sleep(600)  # rank 0 is busy in user code: nothing but its engine's death stops it
    return torch.nn.functional.mse_loss(output, target)
"""
)


def test_ranks_that_do_not_stop_are_killed_and_replaced(pool):
    pids = [row.pid for row in pool.status()]
    started = time.perf_counter()
    with pytest.raises(TrainingError, match=r"(?s)rank 1 \(engine \d+\) failed.*bad batch"):
        sagenb.train(STUCK_CELL, batch_size=16, steps=20, dashboard=False)
    assert time.perf_counter() - started < 30
    new_pids = [row.pid for row in pool.status()]
    assert pool.size == 2 and not set(pids) & set(new_pids)
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3
