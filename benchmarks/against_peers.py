"""sagenb against its peers on one job, in one run, alternating: a hand-written DDP script under
torchrun, Hugging Face Accelerate's notebook_launcher (when installed: `pip install accelerate`),
sagenb with and without its live dashboard, and sagenb on 1 engine against 2.

    .venv/bin/python benchmarks/against_peers.py [--rounds 5] [--out benchmarks/results]

Throughput is samples/s between the end of step 5 and the end of the last step, read from each
side's own per-step wall-clock stamps (same model, data, sample order, batch 256, 200 steps,
1 torch thread per process). Time to first step runs from the call (or the process launch) to
the end of the first step. This machine is noisy: the table quotes medians over the rounds, and
each ratio is computed round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "peers"))

from torchrun import free_port, torchrun  # noqa: E402
from workload import BATCH, CELL, STEPS, rate  # noqa: E402

import sagenb  # noqa: E402


def _cpu_s() -> float:
    """CPU seconds this process (the notebook's side: session, dashboard) has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_sagenb(*, engines: int = 2, live_dashboard: bool = False) -> dict:
    called, cpu = time.time(), _cpu_s()
    result = sagenb.train(
        CELL,
        batch_size=BATCH,
        steps=STEPS,
        engines=engines,
        dashboard=live_dashboard,
        live=live_dashboard,  # the live FigureWidget, as in a notebook
    )
    cpu, wall = _cpu_s() - cpu, time.time() - called
    stamps = [r.values["time(unix s)"] for r in result.metrics if r.rank == 0]
    return {
        "throughput": rate(stamps),
        "first_step_s": stamps[0] - called,
        # the notebook's CPU over the run, as a share of the machine's cores: what the notebook
        # takes from the engines (which do the same work with or without a dashboard)
        "notebook_cpu_share": cpu / wall / (os.cpu_count() or 1),
    }


def run_torchrun() -> dict:
    launched = time.time()
    stamps = torchrun(HERE / "peers" / "ddp_script.py", "--threads", "1")["stamps"]
    return {"throughput": rate(stamps), "first_step_s": stamps[0] - launched}


def run_accelerate() -> dict | None:
    try:
        from accelerate import notebook_launcher
    except ImportError:
        return None
    from accelerate_job import job

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stamps.json")
        called = time.time()
        notebook_launcher(job, args=(path,), num_processes=2, use_port=str(free_port()))
        stamps = json.loads(Path(path).read_text())["stamps"]
    return {"throughput": rate(stamps), "first_step_s": stamps[0] - called}


def rounds(n: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {
        k: [] for k in ("sagenb", "torchrun", "sagenb+dashboard", "sagenb 1 engine", "accelerate")
    }
    for _ in range(n):  # A B A B ...: drift on a shared machine hits every side alike
        runs["sagenb"].append(run_sagenb())
        runs["torchrun"].append(run_torchrun())
        runs["sagenb+dashboard"].append(run_sagenb(live_dashboard=True))
        runs["sagenb 1 engine"].append(run_sagenb(engines=1))
        acc = run_accelerate()
        if acc is not None:
            runs["accelerate"].append(acc)
    return runs


def summarise(runs: dict[str, list[dict]], cold_s: float) -> dict:
    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name]]
        return statistics.median(values) if values else None

    def ratio(a: str, b: str) -> float | None:
        pairs = [x["throughput"] / y["throughput"] for x, y in zip(runs[a], runs[b])]
        return statistics.median(pairs) if pairs else None

    acc = runs["accelerate"]
    return {
        "throughput(samples/s)": {k: med(k, "throughput") for k in runs if runs[k]},
        "first_step_s": {k: med(k, "first_step_s") for k in runs if runs[k]},
        "sagenb_first_run_first_step_s": cold_s,
        "accelerate_first_run_first_step_s": acc[0]["first_step_s"] if acc else None,
        "ratio sagenb/torchrun": ratio("sagenb", "torchrun"),
        "ratio sagenb+dashboard/sagenb": ratio("sagenb+dashboard", "sagenb"),
        "dashboard notebook CPU share of the machine": med("sagenb+dashboard", "notebook_cpu_share")
        - med("sagenb", "notebook_cpu_share"),
        "ratio sagenb 2 engines/1 engine": ratio("sagenb", "sagenb 1 engine"),
        "ratio sagenb/accelerate": ratio("sagenb", "accelerate") if acc else None,
        "rounds": len(runs["sagenb"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    sagenb.stop_pool()
    first = run_sagenb()  # a cold start: this call starts the pool of 2 engines
    try:
        runs = rounds(args.rounds)
    finally:
        sagenb.stop_pool()
    summary = summarise(runs, first["first_step_s"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "against_peers.json").write_text(
        json.dumps({"summary": summary, "runs": runs}, indent=1)
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
