"""Time from `%%smp_train` to the first training step, on a cold start and on a warm pool.

    .venv/bin/python benchmarks/first_step.py [--repeats 5]

Cold: no pool runs, so the magic starts one (controller, engines, torch import, warm-up).
Warm: the pool is reused. Each figure is the median of --repeats runs, measured in one process
through a real IPython shell; the run's own first-step time comes from the metrics stream.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell

from sagenb import cluster

CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
X = torch.randn(2048, 32)
dataset = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
loss_fn = nn.functional.mse_loss
"""
LINE = "--engines 2 --batch-size 64 --steps 5 --no-dashboard --out r"


def first_step(shell: InteractiveShell) -> float:
    """Seconds from calling the magic to the first step's metrics reaching the notebook."""
    started = time.perf_counter()
    shell.run_cell_magic("smp_train", LINE, CELL)
    result = shell.user_ns["r"]
    # the run's clock starts at submission; add what the magic spent before it
    return result.time_to_first_step_s + (time.perf_counter() - started - result.wall_time_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    cold, warm = [], []
    try:
        for _ in range(args.repeats):
            cluster.stop_pool()
            cold.append(first_step(shell))
            warm.append(first_step(shell))
    finally:
        cluster.stop_pool()
    results = {
        "cold_start_first_step_s": {"median": statistics.median(cold), "all": cold},
        "warm_pool_first_step_s": {"median": statistics.median(warm), "all": warm},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "first_step.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
