"""Pipeline benchmarks: measured bubble against the formula, GPipe against 1F1B activation
memory, partition balance of auto, parameters and uniform, and sagenb's pipeline against the
same job written with torch.distributed.pipelining under torchrun, all in one run.

    .venv/bin/python benchmarks/pipeline.py [--steps 20] [--rounds 3] [--out benchmarks/results]

Writes pipeline.md (a Markdown table) and pipeline.json. The bubble, memory and balance figures
come from the engines' own per-step telemetry (busy forward/backward time per microbatch, idle
time, exact activation bytes) on a real 2-engine pool; the first two steps of each run are left
out (warm-up). The formula (p-1)/(m+p-1) assumes stages of equal speed; the "ideal" column is
the bubble a GPipe step with no transfer or bookkeeping time would have with the stage times
measured in the same run, so measured/ideal is what the runtime adds, and ideal/formula what
the stages' imbalance adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "peers"))

from torchrun import torchrun  # noqa: E402
from workload import PIPELINE_CELL as EVEN  # noqa: E402
from workload import rate  # noqa: E402

import sagenb  # noqa: E402
from sagenb.engine.strategies.pipeline import bubble_fraction  # noqa: E402

# Heterogeneous: two heavy blocks (4 units of work each) then eight light ones (1 unit each):
# a perfect split exists (the heavy pair | the light eight), equal block counts miss it.
UNEVEN = """
import torch
from torch import nn
def heavy():
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh())
def light():
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh())
model = nn.Sequential(heavy(), heavy(), *[light() for _ in range(8)], nn.Linear(512, 1))
X = torch.randn(4096, 512)
dataset = torch.utils.data.TensorDataset(X, X[:, :1])
loss_fn = nn.functional.mse_loss
"""


def _steps(result, skip: int = 2) -> dict[int, list[dict]]:
    per_rank: dict[int, list[dict]] = {}
    for rec in result.metrics:
        if rec.step > skip:
            per_rank.setdefault(rec.rank, []).append(rec.values)
    return per_rank


def measured_bubble(result) -> float:
    """Idle share of each engine's step span, averaged over engines and steps."""
    shares = []
    for steps in _steps(result).values():
        for v in steps:
            busy = v["busy/forward(s)"] + v["busy/backward(s)"]
            shares.append(v["idle(s)"] / (busy + v["idle(s)"]))
    return statistics.mean(shares)


def stage_times(result) -> tuple[list[float], list[float]]:
    """Median seconds of one microbatch's forward and backward, per stage (engine)."""
    forward, backward = [], []
    for _, steps in sorted(_steps(result).items()):
        events = [e for v in steps for e in v["timeline"]]
        forward.append(statistics.median(e[4] - e[3] for e in events if e[0] == "F"))
        backward.append(statistics.median(e[4] - e[3] for e in events if e[0] == "B"))
    return forward, backward


def ideal_bubble(forward: list[float], backward: list[float], m: int) -> float:
    """Idle share of a GPipe step with these per-microbatch stage times and nothing else
    (every microbatch of a stage taking the stage's median time)."""
    return replayed_bubble([[f] * m for f in forward], [[b] * m for b in backward])


def replayed_bubble(forward: list[list[float]], backward: list[list[float]]) -> float:
    """Idle share of a GPipe step whose microbatch i takes forward[s][i] and backward[s][i] on
    stage s, with no transfer or bookkeeping time: each forward starts when its input and its
    stage are ready, each backward when its gradient and its stage are (after the stage's last
    forward); averaged over stages."""
    p, m = len(forward), len(forward[0])
    end_f = [[0.0] * m for _ in range(p)]
    end_b = [[0.0] * m for _ in range(p)]
    for s in range(p):
        for i in range(m):
            ready = max(end_f[s - 1][i] if s else 0.0, end_f[s][i - 1] if i else 0.0)
            end_f[s][i] = ready + forward[s][i]
    for s in reversed(range(p)):
        for i in range(m):
            ready = max(end_b[s + 1][i] if s < p - 1 else 0.0, end_b[s][i - 1] if i else 0.0)
            end_b[s][i] = max(ready, end_f[s][m - 1]) + backward[s][i]
    span = max(end_b[s][m - 1] for s in range(p))
    return statistics.mean((span - sum(forward[s]) - sum(backward[s])) / span for s in range(p))


def replayed_ideal(result, m: int) -> float:
    """The ideal of each measured step replayed with its own microbatches' times (a slow
    microbatch, the machine's doing, is then compute and not the runtime's), averaged over the
    steps both engines recorded."""
    by_step: dict[int, dict[int, dict]] = {}
    for rank, steps in _steps(result).items():
        for v in steps:
            by_step.setdefault(v["step"], {})[rank] = v
    shares = []
    for ranks in by_step.values():
        if len(ranks) < 2:
            continue
        forward = [[0.0] * m for _ in ranks]
        backward = [[0.0] * m for _ in ranks]
        for rank, v in ranks.items():
            for kind, _, chunk, start, end in v["timeline"]:
                (forward if kind == "F" else backward)[rank][chunk] = end - start
        shares.append(replayed_bubble(forward, backward))
    return statistics.mean(shares)


def stage_busy(result) -> list[float]:
    """Median busy seconds per step of each engine (its stage)."""
    return [
        statistics.median(v["busy/forward(s)"] + v["busy/backward(s)"] for v in steps)
        for _, steps in sorted(_steps(result).items())
    ]


def train_even(schedule: str, m: int, steps: int):
    """EVEN on 2 stages cut by block count, microbatches of 128 samples, `steps` steps."""
    return sagenb.train(
        EVEN,
        strategy="model",
        partitions=2,
        microbatches=m,
        schedule=schedule,
        partition_by="uniform",
        batch_size=128 * m,
        steps=steps,
        epochs=steps,  # a run of `steps` steps whatever the batch
        dashboard=False,
    )


def bubble_rows(steps: int, runs_at_8: int = 3) -> list[dict]:
    """One run per microbatch count, and `runs_at_8` at 8 (the issue's target), whose median
    run by measured/ideal is reported with the range: the same code moved 1.09-1.21 from run
    to run on this machine (docs/performance.md)."""
    rows = []
    for m in (1, 2, 4, 8):
        # a short run first: the run's own projection on --instance is made (in a child
        # process, sizing/projection.py, once the run ends where its engines fill the cores)
        # and kept, so the measured run, the same cell and options, starts none; its seconds
        # of CPU would fall in the bubble being measured
        train_even("gpipe", m, 3).wait_for_projection(120)
        runs: list[dict[str, Any]] = []
        for _ in range(runs_at_8 if m == 8 else 1):
            result = train_even("gpipe", m, steps)
            formula = bubble_fraction(2, m)
            measured = measured_bubble(result)
            ideal = ideal_bubble(*stage_times(result), m)
            replayed = replayed_ideal(result, m)
            runs.append(
                {
                    "microbatches": m,
                    "formula": formula,
                    "ideal": ideal,
                    "measured": measured,
                    "measured/formula": measured / formula,
                    "measured/ideal": measured / ideal,
                    "replayed ideal": replayed,
                    "measured/replayed": measured / replayed,
                }
            )
        runs.sort(key=lambda r: r["measured/ideal"])
        row = runs[len(runs) // 2]
        row["runs"] = len(runs)
        for key in ("measured/ideal", "measured/replayed"):
            row[f"{key} range"] = [min(r[key] for r in runs), max(r[key] for r in runs)]
        rows.append(row)
    return rows


def memory_rows(steps: int) -> list[dict]:
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        result = sagenb.train(
            EVEN,
            strategy="model",
            partitions=2,
            microbatches=8,
            schedule=schedule,
            partition_by="uniform",
            batch_size=256,
            steps=steps,
            epochs=steps,  # a run of `steps` steps whatever the batch
            dashboard=False,
        )
        peaks[schedule] = {
            rank: max(v["memory/activations(MiB)"] for v in vs)
            for rank, vs in _steps(result).items()
        }
    return [
        {
            "stage": rank,
            "gpipe_MiB": peaks["gpipe"][rank],
            "1f1b_MiB": peaks["1f1b"][rank],
            "gpipe/1f1b": peaks["gpipe"][rank] / peaks["1f1b"][rank],
        }
        for rank in sorted(peaks["gpipe"])
    ]


def balance_rows(steps: int) -> list[dict]:
    rows = []
    for method in ("auto", "parameters", "uniform"):
        result = sagenb.train(
            UNEVEN,
            strategy="model",
            partitions=2,
            microbatches=4,
            schedule="1f1b",
            partition_by=method,
            batch_size=256,
            steps=steps,
            epochs=steps,  # a run of `steps` steps whatever the batch
            dashboard=False,
        )
        busy = stage_busy(result)
        rows.append(
            {
                "method": method,
                "stage_busy_s": busy,
                "slowest/mean": max(busy) / statistics.mean(busy),
                "step_s": statistics.median(r["step_time(s)"] for r in result.history[2:]),
            }
        )
    return rows


PEER_MICROBATCHES = 4


def run_sagenb_pipeline(schedule: str, steps: int) -> float:
    m = PEER_MICROBATCHES
    result = train_even(schedule, m, steps)
    result.wait_for_projection(120)  # made after the run here: not in the peer's run
    stamps = [r.values["time(unix s)"] for r in result.metrics if r.rank == 0]
    return rate(stamps, batch=128 * m)


def run_torchrun_pipeline(schedule: str, steps: int) -> float:
    m = str(PEER_MICROBATCHES)
    script = HERE / "peers" / "pipeline_script.py"
    args = ("--schedule", schedule, "--microbatches", m, "--steps", str(steps), "--threads", "1")
    return rate(torchrun(script, *args)["stamps"], batch=128 * PEER_MICROBATCHES)


def peer_rows(rounds: int, steps: int) -> list[dict]:
    """sagenb against torch.distributed.pipelining under torchrun, alternating, per schedule."""
    rows = []
    for schedule in ("gpipe", "1f1b"):
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(run_sagenb_pipeline(schedule, steps))
            theirs.append(run_torchrun_pipeline(schedule, steps))
        rows.append(
            {
                "schedule": schedule,
                "microbatches": PEER_MICROBATCHES,
                "sagenb_samples_s": statistics.median(ours),
                "torchrun_samples_s": statistics.median(theirs),
                "sagenb/torchrun": statistics.median(a / b for a, b in zip(ours, theirs)),
                "rounds": rounds,
            }
        )
    return rows


def _runs(row: dict) -> str:
    return f" ({row['runs']} runs)" if row.get("runs", 1) > 1 else ""


def _range(row: dict, key: str) -> str:
    if row.get("runs", 1) < 2:
        return ""
    low, high = row[f"{key} range"]
    return f" [{low:.2f}-{high:.2f}]"


def markdown(results: dict) -> str:
    out = [
        "# Pipeline benchmarks",
        "",
        results["machine"],
        "",
        "## Bubble: measured idle share against (p-1)/(m+p-1), p = 2, GPipe",
        "",
        "ideal: the bubble of these stages' median microbatch times with no transfer or "
        "bookkeeping time (the formula assumes equal stages). replayed: the same, each "
        "measured step replayed with its own microbatches' times, so that a microbatch the "
        "machine slowed counts as compute; measured/replayed is what the runtime adds "
        "(transfers, bookkeeping, the loss). Where a row is the median of several runs (by "
        "measured/ideal), the ratios' ranges over them follow in brackets.",
        "",
        "| microbatches | formula | ideal | replayed | measured | measured/formula "
        "| measured/ideal | measured/replayed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['microbatches']}{_runs(r)} | {r['formula']:.3f} | {r['ideal']:.3f} "
        f"| {r['replayed ideal']:.3f} | {r['measured']:.3f} | {r['measured/formula']:.2f} "
        f"| {r['measured/ideal']:.2f}{_range(r, 'measured/ideal')} "
        f"| {r['measured/replayed']:.2f}{_range(r, 'measured/replayed')} |"
        for r in results["bubble"]
    ]
    out += [
        "",
        "## Peak saved activations per stage, 8 microbatches",
        "",
        "| stage | GPipe MiB | 1F1B MiB | GPipe/1F1B |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {r['stage']} | {r['gpipe_MiB']:.2f} | {r['1f1b_MiB']:.2f} | {r['gpipe/1f1b']:.2f} |"
        for r in results["memory"]
    ]
    out += [
        "",
        "## Partition balance on heterogeneous layers (slowest stage / mean stage)",
        "",
        "| method | busy s per step (stage 0, 1) | slowest/mean | step s |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {r['method']} | {r['stage_busy_s'][0]:.4f}, {r['stage_busy_s'][1]:.4f} | "
        f"{r['slowest/mean']:.2f} | {r['step_s']:.4f} |"
        for r in results["balance"]
    ]
    out += [
        "",
        "## Against torch.distributed.pipelining under torchrun (same job, throughput)",
        "",
        "| schedule | microbatches | sagenb samples/s | torchrun samples/s | sagenb/torchrun |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {r['schedule']} | {r['microbatches']} | {r['sagenb_samples_s']:.0f} | "
        f"{r['torchrun_samples_s']:.0f} | {r['sagenb/torchrun']:.3f} |"
        for r in results["peers"]
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="alternations against torchrun")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    import os
    import platform

    import torch

    sagenb.start_pool(2)
    try:
        results = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            "2 engines x 1 thread, gloo",
            "bubble": bubble_rows(args.steps),
            "memory": memory_rows(args.steps),
            "balance": balance_rows(args.steps),
            "peers": peer_rows(args.rounds, 3 * args.steps),
        }
    finally:
        sagenb.stop_pool()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(results, indent=1))
    (out / "pipeline.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
