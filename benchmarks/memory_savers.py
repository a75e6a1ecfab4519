"""Memory savers side by side: per-engine peak memory and throughput of data, sharded and
tensor parallel, with and without activation checkpointing, on the same GPT, in one run.

    .venv/bin/python benchmarks/memory_savers.py [--steps 10] [--rounds 2]

Writes memory_savers.md and memory_savers.json. Memory is the engines' exact accounting
(parameters, gradients and optimizer state held by the engine, and the peak of activations saved
for backward), the largest over engines and steps; throughput is the median over steps after two
warm-up steps, and over rounds run alternately (this machine is noisy), as a ratio to data
parallel measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import sagenb
from sagenb.notebook.examples import gpt_cell
from sagenb.pool import cluster

# GPT-shaped, with attention that tensor parallel can split by heads; SGD with momentum
GPT = gpt_cell(vocab=512, context=64, width=256, heads=8, layers=4, samples=1024, lr=0.01)

CONFIGS: dict[str, dict[str, object]] = {
    "data": dict(strategy="data"),
    "data + AC": dict(strategy="data", activation_checkpointing=True),
    "sharded": dict(strategy="sharded"),
    "sharded, no reshard": dict(strategy="sharded", reshard_after_forward=False),
    "sharded + AC": dict(strategy="sharded", activation_checkpointing=True),
    "tensor": dict(strategy="tensor"),
    "tensor + AC": dict(strategy="tensor", activation_checkpointing=True),
}
KINDS = ("params", "grads", "optimizer", "activations")


def measure(options: dict, steps: int) -> dict:
    result = sagenb.train(GPT, batch_size=32, steps=steps, dashboard=False, **options)
    peak = {
        kind: max(rec.values[f"memory/{kind}(MiB)"] for rec in result.metrics) for kind in KINDS
    }
    rates = [row["throughput(samples/s)"] for row in result.history[2:]]
    return {"peak_MiB": peak, "throughput": statistics.median(rates)}


def run(steps: int, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(rounds):  # alternate: each round runs every configuration once
        for name, options in CONFIGS.items():
            runs[name].append(measure(options, steps))
    rows = []
    base = statistics.median(r["throughput"] for r in runs["data"])
    for name, measured in runs.items():
        peak = measured[0]["peak_MiB"]  # exact byte counts: the same in every round
        throughput = statistics.median(r["throughput"] for r in measured)
        rows.append(
            {
                "config": name,
                **{f"{kind}_MiB": peak[kind] for kind in KINDS},
                "total_MiB": sum(peak.values()),
                "throughput(samples/s)": throughput,
                "throughput/data": throughput / base,
            }
        )
    return {"steps": steps, "rounds": rounds, "rows": rows}


def markdown(results: dict) -> str:
    data = next(r for r in results["rows"] if r["config"] == "data")
    out = [
        "# Memory savers: per-engine peak memory and throughput (2 engines, GPT 4x256, batch 32)",
        "",
        "| config | params MiB | grads MiB | optimizer MiB | activations MiB | total MiB | "
        "total / data | throughput / data |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['config']} | {r['params_MiB']:.2f} | {r['grads_MiB']:.2f} | "
        f"{r['optimizer_MiB']:.2f} | {r['activations_MiB']:.2f} | {r['total_MiB']:.2f} | "
        f"{r['total_MiB'] / data['total_MiB']:.2f} | {r['throughput/data']:.2f} |"
        for r in results["rows"]
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    cluster.start_pool(2)
    try:
        results = run(args.steps, args.rounds)
    finally:
        cluster.stop_pool()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_savers.json").write_text(json.dumps(results, indent=1))
    (args.out / "memory_savers.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
