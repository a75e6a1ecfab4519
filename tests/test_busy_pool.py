"""One run per pool at a time (issue 32, item 3): a second run, from another kernel attached
to the same ipcluster pool or from another thread of the same kernel, waits for the first (or,
with --if-busy fail, says whose run holds the pool) before it touches an engine; the first
trains on as one process. A holder killed by SIGKILL leaves the pool free."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import ipyparallel as ipp
import pytest
import torch

import sagenb
from sagenb.pool import cluster
from sagenb.pool.run_lock import PoolBusyError, holder_of

from .conftest import REGRESSION_CELL
from .helpers import TOL, assert_params_equal, check_equal
from .reference import train_reference

SLOW_STEPS = 20
# 0.15 s a step on the engines only (the one-process reference need not wait): about 3 s of
# training during which a second run asks for the pool
SLOW_CELL = (
    REGRESSION_CELL
    + """
import time
import torch.distributed as dist
def loss_fn(output, target):
    if dist.is_initialized():
        time.sleep(0.15)
    return torch.nn.functional.mse_loss(output, target)
"""
)
SLOW_FIRST_LINE = "import torch"  # what the waiting run is told of the holder's cell

# another kernel: attaches to the pool, trains a cell, saves its parameters, prints its losses
KERNEL = """
import json, sys, torch, sagenb
from sagenb.pool import cluster
profile, cluster_id, cell, steps, out = sys.argv[1:]
cluster.attach_pool(profile=profile, cluster_id=cluster_id)
result = sagenb.train(cell, batch_size=16, steps=int(steps), dashboard=False)
torch.save(result.state_dict(), out)
print(json.dumps({"status": result.status, "losses": result.losses}), flush=True)
"""


def wait_for_holder(path: str, pid: int, timeout: float = 120.0) -> None:
    """Until process `pid` holds the pool's lock (its run has started)."""
    deadline = time.monotonic() + timeout
    while (held := holder_of(path)) is None or held.pid != pid:
        assert time.monotonic() < deadline, f"pid {pid} never held {path}"
        time.sleep(0.05)


def check_slow_run(losses: list[float], state: dict) -> None:
    """The first run trained as one process, though another run asked for its pool."""
    model, reference, _ = train_reference(SLOW_CELL, batch_size=16, steps=SLOW_STEPS)
    torch.testing.assert_close(losses, reference, rtol=0, atol=TOL)
    assert_params_equal(state, model)


@pytest.mark.parametrize("if_busy", ["wait", "fail"])
def test_a_second_thread_waits_for_the_first_run_or_says_whose_it_is(pool, if_busy, capsys):
    first: dict = {}

    def train_first() -> None:
        try:
            first["result"] = sagenb.train(
                SLOW_CELL, batch_size=16, steps=SLOW_STEPS, dashboard=False
            )
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            first["error"] = err

    thread = threading.Thread(target=train_first, name="first-run")
    thread.start()
    try:
        wait_for_holder(pool.run_lock_path, os.getpid())
        asked = time.perf_counter()
        if if_busy == "fail":
            with pytest.raises(
                PoolBusyError, match=rf"(?s)`{SLOW_FIRST_LINE}`.*thread 'first-run'"
            ):
                sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, if_busy="fail")
            assert time.perf_counter() - asked < 1  # at once, no engine asked anything
        else:
            second = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
            check_equal(second, REGRESSION_CELL, batch_size=16, steps=3)
            err = capsys.readouterr().err
            assert "the engine pool is busy with run" in err and "thread 'first-run'" in err
    finally:
        thread.join()
    assert "error" not in first, first.get("error")
    check_slow_run(first["result"].losses, first["result"].state_dict())


@pytest.fixture(scope="module")
def ipcluster(tmp_path_factory):
    """A pool started outside sagenb, as `ipcluster start -n 2` would: (profile, cluster id)."""
    cluster.stop_pool()  # the shared pool's engines would take the cores these need
    profile = tmp_path_factory.mktemp("profile")
    pool = ipp.Cluster(n=2, profile_dir=str(profile), cluster_id="shared", log_level=logging.ERROR)
    pool.start_cluster_sync()
    try:
        yield str(profile), "shared"
    finally:
        cluster.stop_pool()  # lets go of the attached pool
        pool.stop_cluster_sync()


def start_kernel(ipcluster, cell: str, steps: int, out) -> subprocess.Popen:
    command = [sys.executable, "-c", KERNEL, *ipcluster, cell, str(steps), str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_kernels_on_one_ipcluster_pool_take_turns(ipcluster, tmp_path, capsys):
    """Kernel A trains; this kernel, attached to the same pool, is refused with --if-busy fail
    (naming A's pid and cell), then waits by default and trains; both as one process."""
    pool = cluster.attach_pool(profile=ipcluster[0], cluster_id=ipcluster[1])
    kernel = start_kernel(ipcluster, SLOW_CELL, SLOW_STEPS, tmp_path / "a.pt")
    try:
        wait_for_holder(pool.run_lock_path, kernel.pid)
        with pytest.raises(PoolBusyError, match=rf"`{SLOW_FIRST_LINE}`.* pid {kernel.pid} on "):
            sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, if_busy="fail")
        second = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
        out, err = kernel.communicate(timeout=120)
    finally:
        kernel.kill()
    assert kernel.returncode == 0, err
    assert "the engine pool is busy with run" in capsys.readouterr().err
    check_equal(second, REGRESSION_CELL, batch_size=16, steps=3)
    done = json.loads(out.strip().splitlines()[-1])
    assert done["status"] == "done"
    check_slow_run(done["losses"], torch.load(tmp_path / "a.pt"))


# a kernel that holds the pool's lock as a run does, until it is killed
HOLDER = """
import sys, time
from sagenb.pool import run_lock
with run_lock.hold(sys.argv[1], run_lock.Holder.here("model = ...")):
    time.sleep(600)
"""


def test_a_kernel_killed_while_it_holds_the_pool_leaves_it_free(ipcluster):
    """The OS drops a SIGKILLed holder's lock (its descriptors close): the next run starts at
    once, even with --if-busy fail, and trains as one process."""
    pool = cluster.attach_pool(profile=ipcluster[0], cluster_id=ipcluster[1])
    kernel = subprocess.Popen([sys.executable, "-c", HOLDER, pool.run_lock_path])
    try:
        wait_for_holder(pool.run_lock_path, kernel.pid)
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(timeout=30)
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False, if_busy="fail")
    check_equal(result, REGRESSION_CELL, batch_size=16, steps=3)
