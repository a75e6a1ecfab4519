"""What comparing a stream's first global batches across the ranks costs (engine/data/agreement.py).

    .venv/bin/python benchmarks/stream_agreement.py [--repeats 5]

Two figures. The fingerprint alone, in this process on one thread, for three kinds of global
batch: 16 small (x, y) pairs, 64 (3, 224, 224) images with their labels, and 32 records of 512
token ids. And a run's first two steps (the ones checked) on a warm 2-engine data-parallel
pool over a 70-item torch stream in batches of 16, with the check (CHECKED_STEPS = 2) and
without it (0, set by the cell on the engines), alternated --repeats times, and the check
itself on each rank (the cell times agreement._compare: fingerprint and all-gather). On a
shared 2-core machine the step times move with the load by more than the check costs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import sagenb
from sagenb.engine.data import agreement
from sagenb.metrics import keys
from sagenb.pool import cluster

CELL = """
import torch
from torch import nn
import os, time
import sagenb.engine.data.agreement as agreement
agreement.CHECKED_STEPS = {checked}
_compare = agreement.__dict__.setdefault("_untimed", agreement._compare)
def _timed(*args):  # the check itself on this rank: fingerprint and all-gather, in seconds
    began = time.perf_counter()
    try:
        return _compare(*args)
    finally:
        with open({out!r} + f"/{{os.getpid()}}", "a") as f:
            f.write(f"{{time.perf_counter() - began}} ")
agreement._compare = _timed

class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()
    def __iter__(self):
        yield from zip(self.x, self.y)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
dataset = Stream(70, 1)
loss_fn = nn.functional.cross_entropy
"""


def fingerprint_ms(items: list[Any], repeats: int = 30) -> float:
    agreement.fingerprint(items)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        agreement.fingerprint(items)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def first_steps_ms(checked: int, out: str) -> float:
    """The mean step time of a run's first two steps, in ms."""
    cell = CELL.format(checked=checked, out=out)
    result = sagenb.train(cell, strategy="data", batch_size=16, dashboard=False)
    return 1e3 * sum(row[keys.STEP_TIME] for row in result.history[:2]) / 2


def checks_ms(out: str) -> list[float]:
    """Each check's time on each rank, in ms, as the cell wrote them."""
    return [1e3 * float(t) for path in Path(out).iterdir() for t in path.read_text().split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches: dict[str, list[Any]] = {
        "16 x (8 floats, label)": [(torch.randn(8), torch.tensor(1)) for _ in range(16)],
        "64 x (3x224x224 image, label)": [
            (torch.randn(3, 224, 224), torch.tensor(1)) for _ in range(64)
        ],
        "32 x {input_ids: 512 ints}": [{"input_ids": list(range(512))} for _ in range(32)],
    }
    for name, items in batches.items():
        print(f"fingerprint of {name}: {fingerprint_ms(items):.2f} ms")
    cluster.start_pool(2)
    try:
        with_check, without = [], []
        with tempfile.TemporaryDirectory() as out:
            for _ in range(args.repeats):
                with_check.append(first_steps_ms(agreement.CHECKED_STEPS, out))
                without.append(first_steps_ms(0, out))
            checks = checks_ms(out)
        on, off = statistics.median(with_check), statistics.median(without)
        print(
            f"first two steps, median of {args.repeats}: {on:.2f} ms with the check, "
            f"{off:.2f} ms without ({on - off:+.2f} ms)"
        )
        print(
            f"the check on a rank (fingerprint and all-gather), median of {len(checks)}: "
            f"{statistics.median(checks):.2f} ms, at most {max(checks):.2f} ms"
        )
    finally:
        cluster.stop_pool()


if __name__ == "__main__":
    main()
