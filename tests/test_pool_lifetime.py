"""Nothing outlives its kernel: a pool whose starting process dies by SIGTERM or SIGKILL (no
atexit runs) is ended by the watcher (sagenb/pool/reaper.py) within seconds: no controller, engine
or nanny process, and no port they listened on, left. Real processes, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from .helpers import leftovers, wait_clean

#: a plain Python process that starts a pool, says what it started, then trains for minutes
SCRIPT = """
import json, sys
import psutil
import sagenb
from sagenb.pool import cluster

pool = cluster.start_pool(2)
procs = [psutil.Process(p.pid) for p in cluster._pool_processes()]
ports = sorted({c.laddr.port for p in procs for c in p.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN})
print(json.dumps({"pids": [p.pid for p in procs], "ports": ports}), flush=True)
cell = '''
import time, torch
from pathlib import Path
Path(%r).touch()
model = torch.nn.Linear(4, 1)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
def loss_fn(out, y):
    time.sleep(0.05)
    return torch.nn.functional.mse_loss(out, y)
'''
sagenb.train(cell % sys.argv[1], batch_size=8, epochs=1000, dashboard=False)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_process_leaves_no_pool_behind(tmp_path, sig):
    marker = tmp_path / "training"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # our signal is for it alone
    )
    try:
        started = json.loads(proc.stdout.readline())
        assert len(started["pids"]) >= 3 and started["ports"]  # controller and engines
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the run never started on the engines"
        time.sleep(1.0)  # mid-run
        os.kill(proc.pid, sig)
        proc.wait(timeout=10)
        wait_clean(started["pids"], started["ports"])
    finally:
        if proc.poll() is None:
            proc.kill()


#: a kernel-like process: starts a pool, says what it started and which watcher guards it, then
#: uses the pool (as a run does) each time it reads a line, saying which watcher guards it now
USER = """
import json, sys, warnings
import psutil
from sagenb.pool import cluster, reaper

warnings.simplefilter("always")
cluster.start_pool(1)
procs = cluster._pool_processes()
ports = sorted({c.laddr.port for p in procs for c in p.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN})
print(json.dumps({"pids": [p.pid for p in procs], "ports": ports,
                  "watcher": reaper.watcher_pid()}), flush=True)
for _ in sys.stdin:
    cluster.ensure_pool(1)
    print(json.dumps({"watcher": reaper.watcher_pid()}), flush=True)
"""


def test_a_dead_watcher_is_replaced_and_guards_the_same_pool():
    """The watcher SIGKILLed (as an OOM kill would): a new one runs, the death is reported
    naming the old pid, and the new one ends the whole pool when its process is SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", USER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        started = json.loads(proc.stdout.readline())
        old = started["watcher"]
        os.kill(old, signal.SIGKILL)
        time.sleep(0.5)
        proc.stdin.write("use the pool\n")
        proc.stdin.flush()
        new = json.loads(proc.stdout.readline())["watcher"]
        assert new not in (None, old) and psutil.pid_exists(new)
        assert leftovers(started["pids"], [])[0] == started["pids"]  # the pool still runs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert f"watcher process {old}" in proc.stderr.read()
        wait_clean(started["pids"], started["ports"])
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_kernel_killed_by_sigkill_leaves_no_pool_behind():
    """What Jupyter does to a busy kernel that will not shut down."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        code = (
            "%load_ext sagenb\n%smp_cluster start -n 2\n"
            "import json, psutil\nfrom sagenb.pool import cluster\n"
            "procs = cluster._pool_processes()\n"
            "ports = sorted({c.laddr.port for p in procs for c in p.net_connections('tcp')"
            " if c.status == psutil.CONN_LISTEN})\n"
            "print('POOL', json.dumps({'pids': [p.pid for p in procs], 'ports': ports}))\n"
        )
        lines: list[str] = []
        reply = kc.execute_interactive(
            code,
            timeout=180,
            output_hook=lambda msg: lines.append(msg["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok"
        text = "".join(lines)
        started = json.loads(text.split("POOL ", 1)[1].splitlines()[0])
        kernel_pid = km.provisioner.pid if km.provisioner else km.kernel.pid
        os.kill(kernel_pid, signal.SIGKILL)
        wait_clean(started["pids"], started["ports"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_dead_controller_ends_the_run_with_a_clear_error(pool, tmp_path):
    """No rank can report once the controller is gone: the run says so within seconds (not
    after --timeout, and never hangs in a signal sent through the dead controller), nothing
    of the old pool is left, and the next run starts on a new pool."""
    import threading

    import sagenb
    from sagenb.pool import cluster

    from .conftest import REGRESSION_CELL

    marker = tmp_path / "training"
    cell = (
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\nimport time\n"
        + REGRESSION_CELL
        + "\n_mse = loss_fn\ndef loss_fn(out, y):\n    time.sleep(0.05)\n    return _mse(out, y)\n"
    )
    procs = cluster._pool_processes()
    pids = [p.pid for p in procs]
    controller = pool.cluster.controller.process

    def kill_controller():
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        controller.kill()

    threading.Thread(target=kill_controller, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(sagenb.PoolDiedError, match="controller .* has died"):
        sagenb.train(cell, batch_size=8, epochs=100, timeout=60, dashboard=False)
    assert time.monotonic() - started < 30  # the run started, then ended within seconds
    assert cluster.current_pool() is None
    wait_clean(pids, [])
    result = sagenb.train(REGRESSION_CELL, batch_size=32, steps=2, dashboard=False)
    assert len(result.history) == 2


def test_a_controller_dead_since_the_last_run_ends_the_next_run_at_once(pool):
    """The controller died between two runs: the next run used to wait on unanswered
    queries and its engines' restore before it noticed (10.7 s here; past a minute when the
    restore's replacements were waited for). It raises PoolDiedError before touching an
    engine, nothing of the old pool is left, and the run after it trains on a new pool."""
    import sagenb
    from sagenb.pool import cluster

    from .conftest import REGRESSION_CELL

    pids = [p.pid for p in cluster._pool_processes()]
    pool.cluster.controller.process.kill()
    pool.cluster.controller.process.wait(10)
    started = time.monotonic()
    with pytest.raises(sagenb.PoolDiedError, match="controller .* has died"):
        sagenb.train(REGRESSION_CELL, batch_size=32, steps=2, timeout=10, dashboard=False)
    assert time.monotonic() - started < 5
    assert cluster.current_pool() is None
    wait_clean(pids, [])
    result = sagenb.train(REGRESSION_CELL, batch_size=32, steps=2, dashboard=False)
    assert len(result.history) == 2


def test_a_controller_dying_while_a_run_restores_its_engines_ends_the_wait(pool):
    """The controller dies while the run waits for its engines' restore (pool/clean_slate.py),
    one engine busy with someone's task: PoolDiedError within a second, not the restore's
    30 s and a replacement of every engine."""
    from sagenb.pool import clean_slate, waits

    busy = pool.client[pool.engine_ids[1]].apply_async(time.sleep, 60)
    controller = pool.cluster.controller.process
    threading.Timer(1.0, controller.kill).start()
    started = time.monotonic()
    with pytest.raises(waits.PoolDiedError, match="controller .* has died"):
        clean_slate.start_clean(pool, 2)
    assert 1.0 <= time.monotonic() - started < 3.0
    assert not busy.ready()  # it was the controller, not the task, that ended the wait


def test_a_pool_restarted_under_a_run_ends_it_with_a_clear_error(pool, tmp_path):
    """`%smp_cluster restart` (or stop) from another thread while a run trains: the run said
    nothing for --timeout plus about 60 s, then blamed the ranks with a StalledError (the old
    pool looked alive once ipyparallel had dropped its controller). It ends within seconds,
    saying the pool was stopped, and leaves the new pool to the next run."""
    import threading

    import sagenb
    from sagenb.pool import cluster

    from .conftest import REGRESSION_CELL

    marker = tmp_path / "training"
    cell = (
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\nimport time\n"
        + REGRESSION_CELL
        + "\n_mse = loss_fn\ndef loss_fn(out, y):\n    time.sleep(0.1)\n    return _mse(out, y)\n"
    )
    asked: list[float] = []

    def restart():
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2)
        asked.append(time.monotonic())
        cluster.restart_pool()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    try:
        with pytest.raises(sagenb.PoolDiedError, match="was stopped or restarted"):
            sagenb.train(cell, batch_size=8, epochs=100, timeout=20, dashboard=False)
        ended = time.monotonic()
    finally:
        thread.join(120)  # the new pool, started by the restart
    assert asked and ended - asked[0] < 5, ended - asked[0]
    assert cluster.current_pool() is not pool and cluster.current_pool().size == 2
    result = sagenb.train(REGRESSION_CELL, batch_size=32, steps=2, dashboard=False)
    assert len(result.history) == 2


#: makes one shared-memory segment as an engine's rank 0 does (shared_memory._create), says
#: its path, and exits without unlinking it when its stdin closes: an engine that died between
#: creating its segment and unlinking it
SEGMENT_MAKER = (
    "import sys; from sagenb.engine.wire import shared_memory; "
    "print(shared_memory._create(1 << 24), flush=True); sys.stdin.read()"
)


def _segment_of_a_process() -> tuple[subprocess.Popen[str], str]:
    maker = subprocess.Popen(
        [sys.executable, "-c", SEGMENT_MAKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert maker.stdout is not None
    return maker, maker.stdout.readline().strip()


def test_a_dead_engines_shared_memory_is_removed_at_the_next_run_and_at_stop(pool):
    """A segment whose creator died before unlinking it (16 MiB of /dev/shm for good) is
    removed when the next run starts, and when the pool stops; one whose creator runs is
    left, at both."""
    import sagenb
    from sagenb.engine.wire import shared_memory
    from sagenb.pool import cluster

    from .conftest import REGRESSION_CELL

    first, dead_at_run = _segment_of_a_process()
    second, dead_at_stop = _segment_of_a_process()
    mine = shared_memory._create(1 << 16)  # this process's: it runs throughout
    assert dead_at_run and dead_at_stop and mine, "/dev/shm takes a segment"
    try:
        first.communicate(timeout=30)  # its creator is gone, its segment left
        assert os.path.exists(dead_at_run)
        sagenb.train(REGRESSION_CELL, batch_size=32, steps=1, dashboard=False)
        assert not os.path.exists(dead_at_run), "the run left a dead engine's segment"
        assert os.path.exists(dead_at_stop) and os.path.exists(mine), "a live one's was removed"
        second.communicate(timeout=30)
        cluster.stop_pool()
        assert not os.path.exists(dead_at_stop), "stop_pool left a dead engine's segment"
        assert os.path.exists(mine), "stop_pool removed a live process's segment"
    finally:
        for maker in (first, second):
            maker.kill()
            maker.wait(10)
        for path in (dead_at_run, dead_at_stop, mine):
            if path and os.path.exists(path):
                os.unlink(path)


#: a kernel that starts a run's projection (sizing/projection.py) of the cell on its stdin,
#: then waits to be killed
PROJECTING_KERNEL = """
import sys, time
from sagenb.config.job import Job
from sagenb.config.options import TrainConfig
from sagenb.sizing.projection import Projection

config = TrainConfig(batch_size=16, steps=1, instance="ml.g5.xlarge").with_engines(2)
projection = Projection.start(Job.of(sys.stdin.read()), config)
print(projection._child.pid, flush=True)
time.sleep(600)
"""


def _cell_that_starts_processes(folder) -> str:
    """A cell that starts a child in a session of its own and a plain one, writes their pids
    to folder/pids, then runs on for a minute (the projection is mid-cell)."""
    from .conftest import REGRESSION_CELL

    return REGRESSION_CELL + (
        "import os, subprocess, time\n"
        "own = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "plain = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(folder)!r} + '/pids', 'w').write(f'{{own.pid}} {{plain.pid}}')\n"
        "time.sleep(60)\n"
    )


def _started_by_the_cell(folder, timeout: float = 120) -> list[int]:
    pids = folder / "pids"
    deadline = time.monotonic() + timeout
    while (not pids.exists() or not pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [int(pid) for pid in pids.read_text().split()]


def _kill_leftovers(pids: list[int]) -> None:
    """What a failure left: only the test's own, by command line."""
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.cmdline()[:1] == ["sleep"] or "sagenb.sizing.projection" in proc.cmdline():
                proc.kill()


def test_a_kernel_killed_mid_projection_leaves_nothing_the_cell_started(tmp_path):
    """The projection's child, SIGKILLed with its kernel, used to leave what the cell started
    there with ppid 1: its kernel's death now ends the child's descendants (its own session's
    child among them) and the child, within seconds."""
    cell = _cell_that_starts_processes(tmp_path)
    kernel = subprocess.Popen(
        [sys.executable, "-c", PROJECTING_KERNEL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # our signal is for it alone
    )
    children: list[int] = []
    try:
        kernel.stdin.write(cell)  # type: ignore[union-attr]
        kernel.stdin.close()  # type: ignore[union-attr]
        child = int(kernel.stdout.readline())  # type: ignore[union-attr]
        children = [child, *_started_by_the_cell(tmp_path)]
        kernel.kill()
        kernel.wait(10)
        wait_clean(children, [], timeout=10)
    finally:
        kernel.kill()
        _kill_leftovers(children)


def test_a_cancelled_projection_ends_what_the_cell_started(tmp_path):
    """A projection cancelled mid-cell (a later run started, or its run failed) was SIGKILLed,
    which left the cell's processes with ppid 1: they end with it, within seconds."""
    from sagenb.config.job import Job
    from sagenb.config.options import TrainConfig
    from sagenb.sizing.projection import Projection

    config = TrainConfig(batch_size=16, steps=1, instance="ml.g5.xlarge").with_engines(2)
    projection = Projection.start(Job.of(_cell_that_starts_processes(tmp_path)), config)
    assert projection._child is not None
    children = [projection._child.pid]
    try:
        children += _started_by_the_cell(tmp_path)
        projection.cancel("a later run started")
        wait_clean(children, [], timeout=10)
        assert projection.why == "a later run started"
    finally:
        _kill_leftovers(children)
