"""Pipeline benchmarks: measured bubble against the formula, GPipe against 1F1B activation
memory, and partition balance of auto, parameters and uniform, all in one run.

    .venv/bin/python benchmarks/pipeline.py [--steps 12] [--out benchmarks/results]

Writes pipeline.md (a Markdown table) and pipeline.json. Every figure comes from the engines'
own per-step telemetry (busy forward/backward time, idle time, exact activation bytes) on a real
2-engine pool; the first two steps of each run are left out (warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import sagenb
from sagenb.planner import bubble_fraction

# Compute-heavy blocks so that a microbatch's work (~10 ms a stage) dwarfs the sends.
EVEN = """
import torch
from torch import nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(8)],
                      nn.Linear(1024, 1))
X = torch.randn(4096, 1024)
dataset = torch.utils.data.TensorDataset(X, X[:, :1])
loss_fn = nn.functional.mse_loss
"""

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


def stage_busy(result) -> list[float]:
    """Median busy seconds per step of each engine (its stage)."""
    return [
        statistics.median(v["busy/forward(s)"] + v["busy/backward(s)"] for v in steps)
        for _, steps in sorted(_steps(result).items())
    ]


def bubble_rows(steps: int) -> list[dict]:
    rows = []
    for m in (1, 2, 4, 8):
        result = sagenb.train(
            EVEN,
            strategy="model",
            partitions=2,
            microbatches=m,
            schedule="gpipe",
            partition_by="uniform",
            batch_size=128 * m,
            steps=steps,
            dashboard=False,
        )
        formula = bubble_fraction(2, m)
        measured = measured_bubble(result)
        rows.append(
            {
                "microbatches": m,
                "formula": formula,
                "measured": measured,
                "measured/formula": measured / formula,
            }
        )
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


def markdown(results: dict) -> str:
    out = [
        "# Pipeline benchmarks",
        "",
        results["machine"],
        "",
        "## Bubble: measured idle share against (p-1)/(m+p-1), p = 2, GPipe",
        "",
        "| microbatches | formula | measured | measured/formula |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {r['microbatches']} | {r['formula']:.3f} | {r['measured']:.3f} | "
        f"{r['measured/formula']:.2f} |"
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
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
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
