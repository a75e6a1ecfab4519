"""Recovery when the pool itself is lost (the cases benchmarks/recovery.py adds to its table).

The process that started the pool killed mid-run (SIGTERM, SIGKILL; the watcher,
sagenb/pool/reaper.py, ends the pool): seconds from the signal until no process of the pool runs and
none of its ports listens. The pool's controller killed mid-run: seconds from the kill to
`PoolDiedError` in the cell, to the last of the old pool's processes gone, and the next run's
wait for its first step (a new pool started on the way).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

import sagenb
from sagenb.pool import cluster

#: trains a step every 50 ms or so; %r is a file it touches once it runs on the engines
CELL = (
    "import time, torch\n"
    "from pathlib import Path\n"
    "Path(%r).touch()\n"
    "model = torch.nn.Linear(4, 1)\n"
    "dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
    "def loss_fn(out, y):\n"
    "    time.sleep(0.05)\n"
    "    return torch.nn.functional.mse_loss(out, y)\n"
)

#: a process that starts its own pool, says what it started, then trains until killed
KERNEL = (
    "import json, sys, psutil, sagenb\n"
    "from sagenb.pool import cluster\n"
    "cluster.start_pool(2)\n"
    "procs = cluster._pool_processes()\n"
    "ports = sorted({c.laddr.port for p in procs for c in p.net_connections('tcp')\n"
    "                if c.status == psutil.CONN_LISTEN})\n"
    "print(json.dumps({'pids': [p.pid for p in procs], 'ports': ports}), flush=True)\n"
    "sagenb.train(sys.argv[1] % sys.argv[2], batch_size=8, epochs=1000, dashboard=False)\n"
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left(pids: list[int], ports: list[int]) -> bool:
    listening = {
        c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
    }
    return any(_alive(p) for p in pids) or bool(set(ports) & listening)


def _gone_after(pids: list[int], ports: list[int], since: float, limit: float = 60) -> float:
    while _left(pids, ports) and time.perf_counter() - since < limit:
        time.sleep(0.05)
    return time.perf_counter() - since


def _wait_for(marker: Path, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the run never started on the engines")
        time.sleep(0.05)


def kernel_killed(sig: signal.Signals, directory: str) -> dict:
    marker = Path(directory) / f"training-{sig.name}"
    proc = subprocess.Popen(
        [sys.executable, "-c", KERNEL, CELL, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal is for it alone
    )
    try:
        assert proc.stdout is not None  # stdout=PIPE
        started = json.loads(proc.stdout.readline())
        _wait_for(marker)
        time.sleep(1.0)  # mid-run
        killed = time.perf_counter()
        os.kill(proc.pid, sig)
        gone = _gone_after(started["pids"], started["ports"], killed)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"case": f"process that started the pool killed ({sig.name})", "gone_s": gone}


def controller_killed(directory: str) -> dict:
    marker = Path(directory) / "training-controller"
    pool = sagenb.start_pool(2)
    pids = [p.pid for p in cluster._pool_processes()]
    controller = pool.cluster.controller.process
    killed: list[float] = []

    def kill() -> None:
        _wait_for(marker)
        time.sleep(1.0)
        killed.append(time.perf_counter())
        controller.kill()

    threading.Thread(target=kill, daemon=True).start()
    try:
        sagenb.train(CELL % str(marker), batch_size=8, epochs=1000, timeout=60, dashboard=False)
        raise AssertionError("the run did not fail")
    except sagenb.PoolDiedError:
        raised = time.perf_counter()
    gone = _gone_after(pids, [], killed[0])
    asked = time.perf_counter()
    after = sagenb.train(CELL % str(marker), batch_size=8, steps=2, dashboard=False)
    return {
        "case": "pool's controller killed",
        "raised_s": raised - killed[0],
        "gone_s": gone,
        # from the cell's start: the new pool's start, then the run's own wait
        "next_first_step_s": time.perf_counter()
        - asked
        - after.wall_time_s
        + after.time_to_first_step_s,
    }


def rows(directory: str) -> list[dict]:
    """Every case; stops the current pool first (the controller case starts its own)."""
    sagenb.stop_pool()
    found = [kernel_killed(sig, directory) for sig in (signal.SIGTERM, signal.SIGKILL)]
    found.append(controller_killed(directory))
    return found
