"""Cold start: `%load_ext sagenb` starts the default pool in the background; the first
`%%smp_train` uses that pool (no second one), another `%smp_cluster start -n K` cancels it,
SAGENB_PREWARM=0 turns it off, a failed start surfaces at the first run, and nothing of it
outlives the pool or the process that started it. Real shell, real pools, real signals.

The suite runs with SAGENB_PREWARM=0 (conftest.py); each test here turns it on itself. The last
test leaves its pool of 2 engines running, which the shared `pool` fixture then reuses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell

import sagenb.notebook.magics  # noqa: F401 - imported here, so %load_ext's time is the start's alone
from sagenb.pool import cluster

from .conftest import REGRESSION_CELL
from .helpers import wait_clean

TRAIN = "--batch-size 32 --steps 2 --no-dashboard --out prewarmed"


@pytest.fixture
def load_ext(monkeypatch, _stop_pool_at_end):
    """`%load_ext sagenb` afresh on the shared IPython shell (another module loaded it
    already), with SAGENB_PREWARM as the test sets it, and no pool running before."""
    cluster.stop_pool()
    shell = InteractiveShell.instance()

    def load(prewarm: str) -> InteractiveShell:
        monkeypatch.setenv("SAGENB_PREWARM", prewarm)
        shell.extension_manager.loaded.discard("sagenb")
        started = time.perf_counter()
        shell.run_line_magic("load_ext", "sagenb")
        assert time.perf_counter() - started < 2.0  # the start runs in the background
        return shell

    yield load
    monkeypatch.setenv("SAGENB_PREWARM", "0")


def controllers() -> list[int]:
    """Pids of the ipyparallel controllers this process started (its schedulers, children of
    the controller, are not counted)."""
    found = []
    for proc in psutil.Process().children():
        try:
            if "ipyparallel.controller" in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def wait_for_processes(timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not controllers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert controllers(), f"no pool process within {timeout} s of %load_ext"
    return [p.pid for p in cluster._pool_processes()]


def test_prewarm_off_starts_nothing(load_ext):
    load_ext("0")
    time.sleep(0.5)
    assert cluster._background is None and cluster._pool_processes() == []


def test_another_start_cancels_the_background_one(load_ext, capsys):
    """`%smp_cluster start -n 1` while the 2-engine start runs: that start is cancelled and
    all it started is ended; one pool of 1 engine, then nothing once it stops."""
    load_ext("1")
    started = wait_for_processes()
    load_ext("1")  # loading again while it starts starts nothing more
    assert len(controllers()) == 1
    assert cluster.current_pool() is None  # still starting
    with capsys.disabled():
        InteractiveShell.instance().run_line_magic("smp_cluster", "start -n 1")
    assert cluster._background is None and cluster.current_pool().size == 1
    assert not any(psutil.pid_exists(p) for p in started)
    assert len(controllers()) == 1
    cluster.stop_pool()
    assert cluster._pool_processes() == []


def test_a_failed_background_start_surfaces_at_the_first_run(load_ext, monkeypatch):
    """%load_ext works; the first run raises the start's own error, saying what to do."""

    class NoCluster:  # ipyparallel failing to start a controller, as a busy host may
        def __init__(self, **_):
            raise OSError("no free port for the controller")

    monkeypatch.setattr(cluster.ipp, "Cluster", NoCluster)
    shell = load_ext("1")
    with pytest.raises(RuntimeError, match="background failed: OSError: no free port") as info:
        shell.run_cell_magic("smp_train", TRAIN, REGRESSION_CELL)
    assert "SAGENB_PREWARM=0" in str(info.value)
    assert cluster._background is None and cluster.current_pool() is None


#: a process that loads the extension and is killed while its pool is still warming up
KILLED = """
import json, time
from IPython.core.interactiveshell import InteractiveShell
from sagenb.pool import cluster

InteractiveShell.instance().run_line_magic("load_ext", "sagenb")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # until the engines registered: their nannies run
    procs = cluster._pool_processes()
    if sum("nanny" in " ".join(p.cmdline()) for p in procs) == 2:
        break
    time.sleep(0.05)
print(json.dumps([p.pid for p in cluster._pool_processes()]), flush=True)
time.sleep(300)
"""


@pytest.mark.pool  # starts a pool itself, with no fixture to show it
def test_a_process_killed_during_the_background_start_leaves_nothing(monkeypatch):
    monkeypatch.setenv("SAGENB_PREWARM", "1")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) >= 5  # controller, 2 engines, 2 nannies
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_clean(pids, [], timeout=15)
    finally:
        proc.kill()
        proc.wait()


def test_the_first_run_uses_the_background_pool(load_ext, capsys):
    """Within seconds of %load_ext the pool's processes run; the first %%smp_train waits for
    that pool and runs on its engines, with no second controller. The pool stays for the
    tests after this one (the shared 2-engine pool)."""
    shell = load_ext("1")
    wait_for_processes()
    controller = controllers()
    start = cluster._background
    shell.run_line_magic("smp_cluster", "status")  # waits for the pool, says so
    out = capsys.readouterr().out
    assert "still starting" in out and "2 engines" in out
    shell.run_cell_magic("smp_train", TRAIN, REGRESSION_CELL)
    pool = cluster.current_pool()
    assert pool is start.pool and pool.size == 2 and cluster._background is None
    assert len(shell.user_ns["prewarmed"].history) == 2
    assert controllers() == controller
    engine_pids = sorted(row.pid for row in pool.status())
    assert engine_pids == sorted(pool.pids.values())
    assert set(engine_pids) <= {p.pid for p in cluster._pool_processes()}
