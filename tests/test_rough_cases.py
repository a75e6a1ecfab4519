"""The rough cases of issue 32: each says what happened and what to do, or leaves nothing."""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
from torch import nn

import sagenb
from sagenb.config.job import JobError
from sagenb.engine.objective import Objective, piece_loss
from sagenb.pool import cluster
from sagenb.run.failures import EngineDiedError

from .conftest import REGRESSION_CELL
from .helpers import SHARED_MEMORY, fault_cell, wait_clean

RANK0_ONLY = REGRESSION_CELL.replace(
    "model = nn", "import torch.distributed as dist\nif dist.get_rank() == 0:\n    model = nn"
)


def test_a_model_defined_on_rank_0_only_names_the_other_rank(pool):
    with pytest.raises(JobError, match=r"the job defines no model on rank 1 of 2 .*get_rank"):
        sagenb.train(RANK0_ONLY, batch_size=16, steps=2, dashboard=False)


UNUSED_CELL = (
    REGRESSION_CELL
    + """
class WithSpare(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.spare = inner, nn.Linear(8, 2)
    def forward(self, x):
        return self.inner(x)
model = WithSpare(model)
"""
)


def test_a_parameter_the_forward_never_uses_is_named_under_data(pool):
    """Before: DDP's "Expected to have finished reduction in the prior iteration", with
    parameter indices and find_unused_parameters, which sagenb gives no way to set."""
    with pytest.raises(JobError) as caught:
        sagenb.train(UNUSED_CELL, batch_size=16, steps=3, dashboard=False)
    assert str(caught.value).startswith(
        "the model's forward used none of 2 of its trainable parameters (spare.weight, "
        "spare.bias) for the loss"
    )


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


def test_a_cells_processes_in_its_projection_end_with_it(pool, tmp_path):
    """The run's projection on --instance runs the cell again, in a child process of the
    kernel's, outside the pool: what the cell started there, in a session of its own or not,
    was left with ppid 1 once the projection and the pool had stopped. Every process that ran
    the cell (two engines, the projection) notes its two children; none is left after."""
    cell = REGRESSION_CELL + (
        "import os, subprocess\n"
        "own = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "plain = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(tmp_path)!r} + f'/{{os.getpid()}}', 'w').write(f'{{own.pid}} {{plain.pid}}')\n"
    )
    result = sagenb.train(cell, batch_size=16, steps=1, instance="ml.g5.xlarge", dashboard=False)
    assert result.projection is not None and result.projection.wait(120)
    assert result.projection.step_time_s is not None, result.projection.why
    cluster.stop_pool()
    ran_it = list(tmp_path.iterdir())
    assert len(ran_it) == 3, f"the cell ran in {len(ran_it)} processes, not 2 engines and 1 child"
    children = [int(pid) for path in ran_it for pid in path.read_text().split()]
    wait_clean(children, [], timeout=10)


class _ReturnsFloat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x):
        return float(self.linear(x).sum())


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
@pytest.mark.parametrize(
    "loss_fn",
    [lambda out, y: out, lambda out, y: torch.tensor(out, requires_grad=True)],
    ids=["float", "detached"],
)
def test_a_loss_cut_from_the_model_says_nothing_would_train(loss_fn):
    """Before: torch's "element 0 of tensors does not require grad" from backward (float), or
    a run "done" that trained nothing (a new leaf tensor)."""
    model = _ReturnsFloat()
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    objective = Objective.build(model, loss_fn, (batch[0][0], batch[1][0]))
    with pytest.raises(JobError, match=r"nothing would train \(the model returned float\)"):
        piece_loss(objective, model, batch, 1.0)


def test_a_loss_per_sample_is_refused_naming_the_mean():
    """Before: autograd's "grad can be implicitly created only for scalar outputs"."""
    model = nn.Linear(8, 1)
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    per_sample = lambda out, y: nn.functional.mse_loss(out, y, reduction="none")  # noqa: E731
    objective = Objective.build(model, per_sample, (batch[0][0], batch[1][0]))
    with pytest.raises(JobError) as caught:
        piece_loss(objective, model, batch, 1.0)
    assert str(caught.value).startswith(
        "loss_fn returned a tensor of shape (4, 1), not one number: return the mean"
    )


@pytest.mark.parametrize(
    "loss_fn, said",
    [
        (nn.MSELoss(reduction="sum"), True),
        (functools.partial(nn.functional.mse_loss, reduction="sum"), True),
        (lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"), True),
        (nn.MSELoss(), False),
        (nn.functional.mse_loss, False),
        (lambda out, y: (out - y).pow(2).mean(), False),
    ],
    ids=["module", "partial", "lambda", "module-mean", "function", "lambda-mean"],
)
def test_a_summed_loss_is_told_from_a_mean_one(loss_fn, said):
    """Before: SGD parameters 0.0099 off one process on 2 engines, with no word. Read from
    the loss_fn, never by calling it: a cell's loss_fn may count its calls."""
    from sagenb.engine.objective import summed_note

    note = summed_note(loss_fn)
    assert (note is not None) == said
    if said:
        assert note.startswith("loss_fn sums over the batch (reduction='sum'): sagenb weights")


def test_a_summed_loss_is_said_under_the_cell(pool):
    cell = (
        REGRESSION_CELL + "loss_fn = lambda o, y: nn.functional.mse_loss(o, y, reduction='sum')\n"
    )
    result = sagenb.train(cell, batch_size=16, steps=2, dashboard=False)
    assert [w for w in result.warnings if w.startswith("loss_fn sums over the batch")]


def test_samples_of_three_are_refused_naming_the_pairs_sagenb_reads():
    """Before: "too many values to unpack (expected 2)" at the first step, on every rank."""
    with pytest.raises(JobError) as caught:
        Objective.build(nn.Linear(8, 1), None, (torch.zeros(8), torch.ones(8), torch.zeros(1)))
    assert str(caught.value).startswith(
        "its samples are tuples of 3, and sagenb reads a tuple as (input, target)"
    )


def test_ragged_samples_without_a_collate_fn_name_the_collate_fn():
    """Before: torch.stack's "stack expects each tensor to be equal size", with no hint."""
    from sagenb.engine.data.order import collated

    samples = [{"input_ids": torch.arange(n)} for n in (3, 5)]
    with pytest.raises(JobError, match=r"differ in shape .*Define collate_fn\(samples\)"):
        collated(samples)


@pytest.mark.parametrize(
    ("action", "said"),
    [
        ("import ctypes; ctypes.string_at(0)", r"SIGSEGV \(Segmentation fault\), in"),
        pytest.param(
            "dist.all_reduce(torch.ones(3))",
            r"SIGABRT \(Aborted\) in a collective: gloo aborts when the ranks' collectives",
            # with the gradients reduced through shared memory no gloo all-reduce meets it:
            # a stall (tests/test_stalls.py)
            marks=pytest.mark.skipif(SHARED_MEMORY, reason="gradients reduced in shared memory"),
        ),
        ("import os; os._exit(0)", r"not killed: its process called os._exit\(0\), which ends"),
    ],
    ids=["segfault", "extra_all_reduce", "os_exit"],
)
def test_a_crashed_engine_names_the_signal_and_where(pool, action, said):
    """Before: "its engine process died (killed or crashed)", no signal, no line."""
    with pytest.raises(EngineDiedError, match=said) as info:
        sagenb.train(fault_cell(action), batch_size=16, steps=6, dashboard=False)
    assert 'File "<smp_train cell>", line 17 in loss_fn' in str(info.value)


def test_a_pipeline_stage_that_crashes_mid_step_is_named_at_once(pool):
    """The last stage dies in its loss; the first stage, waiting in gloo for that microbatch's
    gradient, does not wait out the collective timeout (300 s)."""
    started = time.monotonic()
    with pytest.raises(EngineDiedError, match=r"SIGSEGV \(Segmentation fault\), in"):
        sagenb.train(
            fault_cell("import ctypes; ctypes.string_at(0)"),
            strategy="model",
            partitions=2,
            batch_size=16,
            steps=6,
            dashboard=False,
        )
    assert time.monotonic() - started < 60


def test_files_of_pools_whose_controller_is_gone_are_removed(tmp_path):
    """What a killed pool leaves in the profile; a running cluster's files stay."""
    import json
    import subprocess
    import sys

    from sagenb.pool.startup import remove_stale

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    pids = {"dead-1": int(gone.stdout), "live-1": os.getpid()}
    for folder in ("security", "log"):
        (tmp_path / folder).mkdir()
    for cid, pid in pids.items():
        record = {"controller": {"state": {"pid": pid}}}
        (tmp_path / "security" / f"cluster-{cid}.json").write_text(json.dumps(record))
        (tmp_path / "security" / f"ipcontroller-{cid}-client.json").write_text("{}")
        (tmp_path / "log" / f"ipengine-{cid}-1-0.log").write_text("")
    assert remove_stale(str(tmp_path)) == ["dead-1"]
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert left == [
        "cluster-live-1.json",
        "ipcontroller-live-1-client.json",
        "ipengine-live-1-1-0.log",
    ]
