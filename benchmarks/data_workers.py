"""--data-workers: throughput with batches loaded by DataLoader worker processes against
batches loaded in the training thread, for a dataset whose __getitem__ does real work.

    .venv/bin/python benchmarks/data_workers.py [--steps 10] [--rounds 3]

Each sample is a synthetic image "decode and augment", deterministic per index and free of
sleeps: a 3x72x72 image drawn from a generator seeded with the index, blurred by eight 5x5
convolution passes, cropped to 64x64 at an offset given by the index, flipped every other index
and normalised per channel: a few ms of one core's work per sample. The model is a small
convnet (three strided convolutions, a linear head), batch 32.

This machine has few cores, and workers compete with the engines for them: 1 engine with 0, 1
and 2 workers, then 2 engines with 0 and 1 worker each, every engine with one torch thread
(--threads 1), as every worker has (torch sets it): with two, a lone engine's tiny per-sample
convolutions slowed down tenfold on this shared, loaded machine (OpenMP threads waiting on each
other for cores that other processes hold), which flattered the workers.
Throughput is the median over steps after two warm-up steps (a step's time includes its wait
for its batches), and the ratio to the --data-workers 0 run of the same engines is taken per
round, rounds alternating the configurations, and its median reported (the machine is noisy).
Writes data_workers.md and data_workers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import sagenb
from sagenb.pool import cluster

CELL = """
import torch
from torch import nn
import torch.nn.functional as F

class Photos(torch.utils.data.Dataset):
    \"\"\"Synthetic images with a decode and augment of a few ms each, per index.\"\"\"
    blur = torch.ones(3, 1, 5, 5) / 25
    def __len__(self):
        return 1024
    def __getitem__(self, i):
        x = torch.rand(3, 72, 72, generator=torch.Generator().manual_seed(i))  # "decode"
        for _ in range(8):
            x = F.conv2d(x.unsqueeze(0), self.blur, padding=2, groups=3)[0]
        top, left = i % 8, (i // 8) % 8
        x = x[:, top:top + 64, left:left + 64]
        if i % 2:
            x = x.flip(-1)
        x = (x - x.mean((1, 2), keepdim=True)) / (x.std((1, 2), keepdim=True) + 1e-5)
        return x, torch.tensor(i % 10)

model = nn.Sequential(
    nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
    nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
    nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
)
dataset = Photos()
loss_fn = F.cross_entropy
"""

#: (engines, data workers per engine), by pool size
CONFIGS = {1: (0, 1, 2), 2: (0, 1)}


def measure(workers: int, steps: int) -> dict:
    started = time.perf_counter()
    result = sagenb.train(
        CELL, batch_size=32, steps=steps, data_workers=workers, threads=1, dashboard=False
    )
    wall = time.perf_counter() - started
    rows = result.history[2:]
    waits = [r.values["data_wait(s)"] for r in result.metrics if r.values["step"] > 2]
    return {
        "throughput": statistics.median(r["throughput(samples/s)"] for r in rows),
        "data_wait_s": statistics.median(waits),
        "wall_s": wall,
    }


def run(steps: int, rounds: int) -> dict:
    rows = []
    for engines, worker_counts in CONFIGS.items():
        cluster.start_pool(engines)
        try:
            runs: dict[int, list[dict]] = {w: [] for w in worker_counts}
            for _ in range(rounds):  # alternate: each round runs every worker count once
                for workers in worker_counts:
                    runs[workers].append(measure(workers, steps))
        finally:
            cluster.stop_pool()
        for workers, measured in runs.items():
            ratios = [m["throughput"] / b["throughput"] for m, b in zip(measured, runs[0])]
            rows.append(
                {
                    "engines": engines,
                    "data_workers": workers,
                    "throughput(samples/s)": statistics.median(m["throughput"] for m in measured),
                    "throughput/no workers": statistics.median(ratios),
                    "per-round ratios": ratios,
                    "data_wait(s)": statistics.median(m["data_wait_s"] for m in measured),
                    "wall(s)": statistics.median(m["wall_s"] for m in measured),
                }
            )
    return {"steps": steps, "rounds": rounds, "cores": os.cpu_count(), "rows": rows}


def markdown(results: dict) -> str:
    out = [
        f"# --data-workers: throughput with DataLoader workers ({results['cores']} cores, "
        "synthetic image decode + augment, small convnet, batch 32, 1 torch thread per engine)",
        "",
        "| engines | data workers per engine | throughput (samples/s) | / no workers (median of "
        "rounds) | per-step wait for data (s) |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {r['engines']} | {r['data_workers']} | {r['throughput(samples/s)']:.0f} | "
        f"{r['throughput/no workers']:.2f} | {r['data_wait(s)']:.3f} |"
        for r in results["rows"]
    ]
    out += [
        "",
        f"Medians over {results['rounds']} alternating rounds of {results['steps']} steps. Workers "
        "are processes of their own: where other work shares the cores, they also win a larger "
        "share of them, which counts in these ratios.",
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    cluster.stop_pool()
    results = run(args.steps, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_workers.json").write_text(json.dumps(results, indent=1))
    (args.out / "data_workers.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
