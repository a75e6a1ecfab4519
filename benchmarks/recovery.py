"""Recovery from injected faults: time to detect, time until the pool trains again, steps lost.

    .venv/bin/python benchmarks/recovery.py [--out benchmarks/results]

Each fault strikes rank 1 of a 2-engine data-parallel run at step 30, with a checkpoint every 25
steps. "detect" runs from the fault (the cell writes the wall-clock time just before it) to the
moment the notebook noticed it; "contain" from then to the error in the cell (every rank
stopped); then the next run's wait for its first step, from the call (the engines a failure
killed are replaced then, not before the error); "lost"
counts the steps finished since the last checkpoint (29 - 25: what --resume must redo). A
kernel interrupt instead stops every rank after the same step and writes a checkpoint there, so
it loses nothing; its "contain" is the time from the interrupt to the cell's return. Detection
is measured at the notebook's polling granularity (50 ms). The cases where the pool itself is
lost (the process that started it killed, its controller killed) are in benchmarks/pool_loss.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import sagenb
from sagenb.engine.checkpoint.distributed import latest
from sagenb.run import failures

sys.path.insert(0, str(Path(__file__).parent))
import pool_loss  # noqa: E402 - a sibling file of this script

BASE = """
import os, signal, time
import torch
from torch import nn
import torch.distributed as dist
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
X = torch.randn(8192, 32)
dataset = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
calls = [0]
def loss_fn(output, target):
    calls[0] += 1
    if dist.get_rank() == 1 and calls[0] == FAULT_STEP:
        open(FAULT_AT, "w").write(repr(time.time()))
        FAULT
    return nn.functional.mse_loss(output, target)
"""
FAULT_STEP = 30
FAULTS = {
    "exception in the cell": "raise ValueError('injected')",
    "engine killed (SIGKILL)": "os.kill(os.getpid(), signal.SIGKILL)",
    "rank stuck in a loop (--timeout 5)": "while True: pass",
    "out of memory": "torch.empty(2**42, dtype=torch.uint8)",
    "kernel interrupt": "time.sleep(0.5)",  # the interrupt arrives while this rank sleeps
}


class LastArrival:
    """A metric sink that remembers when the last step's metrics arrived; with `then`, calls
    it once when step FAULT_STEP's arrive."""

    def __init__(self, then=None) -> None:
        self.at = time.perf_counter()
        self.step = 0
        self.then = then

    def log(self, metrics, step, rank) -> None:
        self.at, self.step = time.perf_counter(), step
        if self.then is not None and step >= FAULT_STEP:
            then, self.then = self.then, None
            then()

    def close(self) -> None:
        pass


def one(name: str, action: str, directory: str) -> dict:
    noticed: list[float] = []

    def notice(kind: str) -> None:  # when the notebook noticed, before containing
        if not noticed:
            noticed.append(time.time())

    fault_at = Path(directory) / "fault_at"
    cell = _cell(action, fault_at)
    arrival = LastArrival()
    if name == "kernel interrupt":
        cell = _cell("pass", fault_at).replace(f"calls[0] == {FAULT_STEP}", "False")

        def interrupt() -> None:
            noticed.append(time.time())  # the interrupt itself is the notice
            os.kill(os.getpid(), signal.SIGINT)

        # once step 30 has arrived: a timer, started before the call, could strike before the
        # run began (the call first settles the pool) or after it had ended
        arrival = LastArrival(then=interrupt)
    try:
        sagenb.train(
            cell,
            batch_size=16,
            # 1,024 steps of this cell take about a second here: the interrupt's run is made
            # long enough that it still trains when step 30's metrics arrive
            epochs=40 if name == "kernel interrupt" else 2,
            checkpoint_dir=directory,
            checkpoint_every=25,
            timeout=5 if "stuck" in name else 300,
            sinks=[arrival],
            dashboard=False,
            on_failure=notice,
        )
        raise AssertionError(f"{name}: the run did not fail")
    except (failures.TrainingError, KeyboardInterrupt) as exc:
        raised, kind = time.time(), type(exc).__name__
    path = latest(directory)
    saved = int(path.name.split("-")[1]) if path else 0
    asked = time.perf_counter()  # the next run first replaces the engines this one lost
    after = sagenb.train(_cell("pass", fault_at), batch_size=16, steps=2, dashboard=False)
    next_wait = time.perf_counter() - asked - after.wall_time_s + after.time_to_first_step_s
    first_noticed = noticed[0] if noticed else raised
    faulted = fault_at.exists()
    finished = FAULT_STEP - 1 if faulted else arrival.step  # the fault strikes inside a step
    return {
        "fault": name,
        "raised": kind,
        "detect_s": first_noticed - float(fault_at.read_text()) if faulted else None,
        "contain_s": raised - first_noticed,
        "next_first_step_s": next_wait,
        "steps_lost": max(0, finished - saved),
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cell(action: str, fault_at: Path) -> str:
    return (
        BASE.replace("FAULT_AT", repr(str(fault_at)))
        .replace("FAULT_STEP", str(FAULT_STEP))
        .replace("FAULT", action)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    # a script started in the background by a non-interactive shell (`cmd &`, nohup) inherits
    # SIGINT ignored (POSIX), so the interrupt case would interrupt nothing; a kernel has
    # Python's own handler, as here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sagenb.start_pool(2)
    rows = []
    try:
        for name, action in FAULTS.items():
            with tempfile.TemporaryDirectory() as directory:
                row = one(name, action, directory)
                rows.append(row)
                print(row, flush=True)
        with tempfile.TemporaryDirectory() as directory:
            lost = pool_loss.rows(directory)
            print(lost, flush=True)
    finally:
        sagenb.stop_pool()
    lines = [
        "# Recovery from injected faults",
        "",
        "2 engines, data parallel, fault on rank 1 at step 30, checkpoint every 25 steps.",
        "",
        "| fault | raised | detect s | contain s | next run's first step s | steps lost |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['fault']} | {r['raised']} | {_seconds(r['detect_s'])} | "
        f"{r['contain_s']:.2f} "
        f"| {r['next_first_step_s']:.2f} | {r['steps_lost']} |"
        for r in rows
    ]
    lines += [
        "",
        "When the pool itself is lost (seconds from the signal or the kill):",
        "",
        "| case | error in the cell s | no process or port left s | next run's first step s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {_seconds(r.get('raised_s'))} | {r['gone_s']:.2f} | "
        f"{_seconds(r.get('next_first_step_s'))} |"
        for r in lost
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps({"faults": rows, "pool_lost": lost}, indent=1))
    (out / "recovery.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
