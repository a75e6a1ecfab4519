"""What a live redraw costs the notebook as a run grows: the kernel's side of the dashboard.

    .venv/bin/python benchmarks/dashboard_redraw.py [--lengths 1100,3000,10000,30000]
        [--out benchmarks/results]

A live dashboard (a data-parallel run on 2 engines) is fed each step's metrics from both
ranks, as the session feeds it, with no pool and no browser: what is measured is the notebook's
CPU (thread time) of a redraw of the loss panel (sent every second) and of all panels (every
few seconds) over the last 300 steps of runs of several lengths, as medians. The peer is the
same dashboard at the shortest length, in the same run: a redraw should cost the same at any
step (issue 17: it grew with the run, 4 ms at 1,100 steps and 84 ms at 30,000 for the loss).

Writes dashboard_redraw.md and dashboard_redraw.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

from sagenb.config import TrainConfig  # noqa: E402
from sagenb.display.dashboard import Dashboard  # noqa: E402
from sagenb.metrics import keys  # noqa: E402
from sagenb.sizing.cost import CostMeter, instance_price  # noqa: E402

STEPS_PER_REDRAW = 30  # ~one second of the peers' workload on this machine
MEASURED = 300  # the last steps of each run, redrawn every STEPS_PER_REDRAW


def metrics(step: int, rank: int, total: int) -> dict:
    """What a data-parallel rank publishes after a step (engine/loop.py), with an eval loss
    every 50 steps."""
    values = {
        keys.STEP: step,
        keys.TOTAL_STEPS: total,
        keys.EPOCH: step // 100,
        keys.LR: 0.1,
        keys.STEP_TIME: 0.03 + 0.001 * (step % 7),
        keys.LOSS: 1.0 / (1 + step) + 0.01 * ((step * 7919 + rank) % 13),
        **{keys.memory(kind): 10.0 + rank for kind in keys.MEMORY_KINDS},
    }
    if step % 50 == 0 and rank == 0:
        values[keys.EVAL_LOSS] = 1.0 / (1 + step)
    return values


def measure(steps: int) -> dict:
    config = TrainConfig(engines=2, batch_size=256)
    board = Dashboard(config, CostMeter(instance_price(config.instance), 2), live=True)
    costs: dict[str, list[float]] = {"loss": [], "all": []}
    for step in range(1, steps + 1):
        for rank in range(2):
            board.log(metrics(step, rank, steps), step, rank)
        board.cost_points.append((step * 0.03, board.cost.cost(step * 0.03)))
        if step % STEPS_PER_REDRAW:
            continue
        every_second = (step // STEPS_PER_REDRAW) % 5 != 0  # all panels every 5th redraw
        started = time.thread_time()
        board._redraw(every_second=every_second)
        if step > steps - MEASURED:
            costs["loss" if every_second else "all"].append(time.thread_time() - started)
    board.finish(steps * 0.03, status="done")
    return {"steps": steps, **{k: statistics.median(v) * 1e3 for k, v in costs.items()}}


def markdown(rows: list[dict]) -> str:
    first = rows[0]
    out = [
        "# A live redraw's cost to the notebook as the run grows",
        "",
        "Notebook CPU (thread time, median over the last 300 steps) of a redraw of the loss "
        "panel (every second) and of all panels; the ratio is against the shortest run, "
        "measured in the same run of this script",
        "",
        "| steps | loss panel, ms | all panels, ms | loss / shortest | all / shortest |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['steps']} | {r['loss']:.1f} | {r['all']:.1f} | "
            f"{r['loss'] / first['loss']:.2f} | {r['all'] / first['all']:.2f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1100,3000,10000,30000")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    measure(600)  # warm-up: imports and first-use costs
    rows = [measure(int(n)) for n in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dashboard_redraw.json").write_text(json.dumps(rows, indent=1))
    (out / "dashboard_redraw.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
