"""Helpers shared by several test modules (no test module imports another): cells that fail on
purpose, the interrupt button, a command run to completion, waiting for processes to go, and
the one check that a trained model equals another (tests/reference.py's, a checkpoint's)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import psutil
import torch

from .conftest import REGRESSION_CELL
from .reference import train_reference

#: the estimate's limits against the engines' measured memory, per kind (issue 16)
LIMITS = {"params": 0.02, "grads": 0.02, "optimizer": 0.02, "activations": 0.20}

# How far a trained model may be from one process's. CPU arithmetic is deterministic for a given
# thread count, so load does not move it; the order of sums does. Measured (ResNet with
# BatchNorm, 8 steps, data and sharded, engines and reference at 1 or 2 threads): 6e-7 to 1.0e-6
# on this project's machines, 2.4e-7 on one whose threaded convolution backward had read 5.2e-5
# against a reference at another thread count. 1e-5 is 10x the largest matched spread seen.
TOL = 1e-5

# -- failures on purpose -------------------------------------------------------------------------

LONG = dict(batch_size=2, epochs=200, dashboard=False)  # ~19,000 tiny steps: time to interrupt


#: the test pool's engines (2, one thread each on this machine's cores) reduce data parallel's
#: gradients through shared memory, not gloo (sagenb/engine/wire/shared_memory.py)
SHARED_MEMORY = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def fault_cell(action: str, *, at_call: int = 4, rank: int = 1, others: str = "pass") -> str:
    """The regression cell whose loss_fn does `action` on `rank` at its at_call-th call (and
    `others` on the other ranks at that call)."""
    return (
        REGRESSION_CELL
        + f"""
import os, signal, time
import torch.distributed as dist
calls = [0]
def loss_fn(output, target):
    calls[0] += 1
    if calls[0] == {at_call}:
        if dist.get_rank() == {rank}:
            {action}
        {others}
    return torch.nn.functional.mse_loss(output, target)
"""
    )


def interrupt_after(seconds: float) -> threading.Timer:
    """SIGINT to this process, as the notebook's interrupt button sends to the kernel."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


# -- processes -----------------------------------------------------------------------------------

TORCHRUN = Path(sys.executable).parent / "torchrun"
RUN_TIMEOUT_S = 300  # a cold torchrun on the 2-core CI machine, shared with other tests


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`command` run to its end in `cwd`; its output shown if it fails."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done


def leftovers(pids: list[int], ports: list[int]) -> tuple[list[int], list[int]]:
    """The processes of `pids` still alive (zombies count as gone) and `ports` still listened on."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    listening = {
        c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
    }
    return alive, sorted(set(ports) & listening)


def wait_clean(pids: list[int], ports: list[int], timeout: float = 10.0) -> None:
    """Wait up to `timeout` s for `pids` to exit and `ports` to close; fail naming what is left."""
    deadline = time.monotonic() + timeout
    while (found := leftovers(pids, ports)) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert found == ([], []), f"left after {timeout} s: pids {found[0]}, ports {found[1]}"


# -- trained versus one process ------------------------------------------------------------------


def largest_difference(state: Mapping[str, torch.Tensor], reference: Mapping) -> tuple[str, float]:
    """The entry of `state` (parameters and buffers) farthest from `reference`'s, and by how
    much (the largest absolute elementwise difference, in float64)."""
    diffs = {k: (state[k].double() - v.double()).abs().max().item() for k, v in reference.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return worst, diffs[worst]


def assert_params_equal(
    state: Mapping[str, torch.Tensor],
    reference: Mapping | torch.nn.Module,
    *,
    tol: float = TOL,
    context: str = "",
) -> None:
    """`state` has `reference`'s entries (a state_dict, or a module's), in its order, each within
    `tol` (0: bit for bit); the failure names the entry that differs most and by how much."""
    ref = reference.state_dict() if isinstance(reference, torch.nn.Module) else reference
    where = f" ({context})" if context else ""
    missing, extra = sorted(set(ref) - set(state)), sorted(set(state) - set(ref))
    assert not missing and not extra, f"entries missing: {missing}, unexpected: {extra}{where}"
    assert list(state) == list(ref), f"entries in another order than the reference's{where}"
    name, diff = largest_difference(state, ref)
    assert diff <= tol, f"{name} differs by {diff:.3g} from the reference (tol {tol:g}){where}"


def check_equal(result, cell: str, *, tol: float = TOL, **options) -> tuple[torch.nn.Module, dict]:
    """`result` trained as one process (tests/reference.py) trains `cell` with `options`: the
    same losses and the same parameters and buffers, up to `tol`. Returns the reference model
    and the cell's namespace. The reference computes with the engines' torch threads."""
    options.setdefault("threads", result.config.threads_per_engine(result.engines))
    model, losses, ns = train_reference(cell, **options)
    torch.testing.assert_close(result.losses, losses, rtol=0, atol=tol)
    assert_params_equal(result.state_dict(), model, tol=tol)
    return model, ns


#: what the multi-host tests train on each launcher's pool (tests/test_multi_host.py, test_slurm.py)
THREE_STRATEGIES = (
    dict(strategy="data"),
    dict(strategy="sharded"),
    dict(strategy="model", partitions=2),
)


def check_strategies(cell: str, strategies, *, batch_size: int, steps: int):
    """Train `cell` on the current pool with each of `strategies` (train options) and check
    each against the one-process reference; returns the reference model."""
    import sagenb

    model, _, _ = train_reference(cell, batch_size=batch_size, steps=steps)
    for options in strategies:
        result = sagenb.train(cell, batch_size=batch_size, steps=steps, dashboard=False, **options)
        assert_params_equal(result.state_dict(), model, context=str(options))
    return model
