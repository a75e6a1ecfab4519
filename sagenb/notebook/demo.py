"""The quick start's main job: a real data-parallel training on a local pool of engines.

    python -m sagenb.notebook.demo [--engines 2] [--epochs 4] [--html artifacts/dashboard.html]

Starts a pool, trains a small classifier on a synthetic two-spirals data set with
DistributedDataParallel, prints its loss, time, cost and eval losses, writes the dashboard as
one HTML file, and stops the pool (tests/test_browser.py runs it and opens the dashboard).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sagenb.pool.cluster import start_pool, stop_pool
from sagenb.run.session import train

JOB = """
import math
import torch
from torch import nn

def spirals(n, noise=0.15):
    # two interleaved spirals: a small problem a linear model cannot solve
    t = torch.rand(n) * 3 * math.pi + 0.5
    label = torch.randint(0, 2, (n,))
    sign = 1 - 2 * label.float()
    x = torch.stack([t * torch.cos(t) * sign, t * torch.sin(t) * sign], 1) / 5
    return torch.utils.data.TensorDataset(x + noise * torch.randn(n, 2), label)

model = nn.Sequential(nn.Linear(2, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 2))
dataset = spirals(4096)
eval_dataset = spirals(1024)
loss_fn = nn.functional.cross_entropy
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sagenb.notebook.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--html", default="artifacts/dashboard.html")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    pool = start_pool(args.engines)
    print(f"pool of {pool.size} engines ready in {time.perf_counter() - started:.1f} s")
    try:
        result = train(
            JOB,
            strategy="data",
            batch_size=args.batch_size,
            epochs=args.epochs,
            lr=1e-2,
            eval_every=32,
        )
    finally:
        stop_pool()
    result.wait_for_projection()  # its own estimate, made while the engines trained
    print(result.summary())
    print(f"first step after {result.time_to_first_step_s:.2f} s on the warm pool")
    for step, loss in result.eval_losses:
        print(f"  eval loss at step {step:4d}: {loss:.4f}")
    path = result.dashboard.save_html(Path(args.html))
    print(f"dashboard: {path.resolve()}  (open it in a browser)")


if __name__ == "__main__":
    main()
