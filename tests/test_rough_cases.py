"""The rough cases of issue 32: each says what happened and what to do, or leaves nothing."""

from __future__ import annotations

import pytest

import sagenb
from sagenb.config.job import JobError
from sagenb.pool import cluster

from .conftest import REGRESSION_CELL
from .helpers import wait_clean

RANK0_ONLY = REGRESSION_CELL.replace(
    "model = nn", "import torch.distributed as dist\nif dist.get_rank() == 0:\n    model = nn"
)


def test_a_model_defined_on_rank_0_only_names_the_other_rank(pool):
    with pytest.raises(JobError, match=r"the job defines no model on rank 1 of 2 .*get_rank"):
        sagenb.train(RANK0_ONLY, batch_size=16, steps=2, dashboard=False)


def test_a_cells_child_in_a_session_of_its_own_ends_with_the_pool(pool, tmp_path):
    """`start_new_session=True` takes the child out of its engine's process group, and the
    engine's stop re-parents it to init: the pool notes its engines' descendants first."""
    cell = REGRESSION_CELL + (
        "import subprocess, torch.distributed as dist\n"
        "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        f"open({str(tmp_path)!r} + f'/{{dist.get_rank()}}', 'w').write(str(child.pid))\n"
    )
    sagenb.train(cell, batch_size=16, steps=2, dashboard=False)
    children = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    cluster.stop_pool()
    wait_clean(children, [], timeout=10)
