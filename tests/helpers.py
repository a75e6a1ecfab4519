"""Helpers shared by several test modules (no test module imports another): cells that fail on
purpose, the interrupt button, a command run to completion, waiting for processes to go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from .conftest import REGRESSION_CELL, max_param_diff
from .reference import train_reference

TOL = 1e-5

# -- failures on purpose -------------------------------------------------------------------------

LONG = dict(batch_size=2, epochs=200, dashboard=False)  # ~19,000 tiny steps: time to interrupt


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


def same(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def check_equal(result, cell, **options):
    model, losses, ns = train_reference(cell, **options)
    torch.testing.assert_close(result.losses, losses, rtol=0, atol=TOL)
    assert max_param_diff(result.state_dict(), model) <= TOL
    assert list(result.state_dict()) == list(model.state_dict())  # same keys, same order
    return model, ns


def check_one_process(result, cell, *, steps: int, batch_size: int):
    """Equal to one process over each whole global batch (grad_accum 1 in the reference)."""
    model, losses, _ = train_reference(cell, batch_size=batch_size, steps=steps)
    torch.testing.assert_close(result.losses, losses, rtol=0, atol=TOL)
    assert max_param_diff(result.state_dict(), model) <= TOL
    assert list(result.state_dict()) == list(model.state_dict())
    return model
