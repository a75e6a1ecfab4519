"""Time from `%%smp_train` to the first training step: cold, after `%load_ext` and 10 s of
writing, on a warm pool, and a peer's.

    .venv/bin/python benchmarks/first_step.py [--repeats 3] [--write-s 10]

Cold: no pool runs and none was started in the background, so the magic starts one
(controller, engines, torch import, warm-up). Prewarmed: `%load_ext sagenb` started the pool in
the background, the user writes the first cell for --write-s seconds (a sleep), then runs it:
the figure is the wait from running the cell to its first step, what is left of the start
plus the run's own first step (target: at most 3 s after 10 s of writing). Warm: the pool is
reused. Peer: the same cell as a DDP script under torchrun (`!torchrun ...` from a notebook),
from the launch to the end of its first step: fresh processes, each importing torch.
Accelerate's notebook_launcher forks the notebook's process (torch already imported), so its
first step comes in ~0.35 s; its figure is quoted from against_peers.json when there.

Each figure is the median of --repeats runs, measured in one process through a real IPython
shell; the run's own first-step time comes from the metrics stream. The machine's 1-minute
load average is recorded with each run: on a shared 2-core machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell

from sagenb.pool import cluster
from sagenb.pool.prewarm import PREWARM_ENV

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "peers"))

from torchrun import torchrun  # noqa: E402

CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
X = torch.randn(2048, 32)
dataset = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
loss_fn = nn.functional.mse_loss
"""
LINE = "--engines 2 --batch-size 64 --steps 5 --no-dashboard --out r"

#: the peer: CELL trained with DDP under torchrun; rank 0 prints when its first step ended
PEER = """
import json, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
ns = {}
exec(CELL_SOURCE, ns)
model = DistributedDataParallel(ns["model"])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = (t[:32] for t in ns["dataset"].tensors)
ns["loss_fn"](model(x), y).backward()
opt.step()
if dist.get_rank() == 0:
    print(json.dumps({"first_step_end": time.time()}), flush=True)
dist.destroy_process_group()
""".replace("CELL_SOURCE", repr(CELL))


def first_step(shell: InteractiveShell) -> float:
    """Seconds from calling the magic to the first step's metrics reaching the notebook."""
    started = time.perf_counter()
    shell.run_cell_magic("smp_train", LINE, CELL)
    result = shell.user_ns["r"]
    # the run's clock starts at submission; add what the magic spent before it
    return result.time_to_first_step_s + (time.perf_counter() - started - result.wall_time_s)


def load_ext(shell: InteractiveShell) -> float:
    """`%load_ext sagenb` afresh (it starts the pool in the background); its own seconds."""
    os.environ[PREWARM_ENV] = "1"
    manager = shell.extension_manager
    assert manager is not None  # InteractiveShell.instance() has one
    manager.loaded.discard("sagenb")
    started = time.perf_counter()
    shell.run_line_magic("load_ext", "sagenb")
    return time.perf_counter() - started


def peer_first_step() -> float:
    """torchrun, 2 processes: seconds from the launch to the end of rank 0's first step."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "peer.py"
        script.write_text(PEER)
        launched = time.time()
        row = torchrun(script)
    return row["first_step_end"] - launched


def rounds(shell: InteractiveShell, repeats: int, write_s: float) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {k: [] for k in ("cold", "prewarmed", "warm", "torchrun")}
    runs["load_avg"], runs["load_ext_s"] = [], []
    for _ in range(repeats):
        runs["load_avg"].append(os.getloadavg()[0])
        cluster.stop_pool()  # and no start in the background either
        runs["cold"].append(first_step(shell))
        runs["warm"].append(first_step(shell))
        cluster.stop_pool()
        runs["load_ext_s"].append(load_ext(shell))
        time.sleep(write_s)  # the user writes the first cell
        runs["prewarmed"].append(first_step(shell))
        cluster.stop_pool()
        runs["torchrun"].append(peer_first_step())
    return runs


def accelerate_first_step(out: Path) -> float | None:
    """Accelerate's first-run first step, as against_peers.py last measured it."""
    try:
        summary = json.loads((out / "against_peers.json").read_text())["summary"]
    except (OSError, KeyError, ValueError):
        return None
    return summary.get("accelerate_first_run_first_step_s")


def markdown(results: dict, write_s: float) -> str:
    med = {k: v["median"] for k, v in results.items() if isinstance(v, dict) and "median" in v}
    acc = results.get("accelerate_first_step_s")
    rows = [
        ("cold: the run starts the pool", med["cold_start_first_step_s"]),
        (f"%load_ext, {write_s:.0f} s of writing, then the run", med["prewarmed_first_step_s"]),
        ("warm pool (a later run)", med["warm_pool_first_step_s"]),
        ("torchrun, 2 fresh processes (launch to first step)", med["torchrun_first_step_s"]),
    ]
    if acc is not None:
        rows.append(("Accelerate notebook_launcher, first run (against_peers.json)", acc))
    torchrun = med["torchrun_first_step_s"]
    lines = [
        "# Time to first step",
        "",
        f"{results['machine']}; median of {results['repeats']} rounds; 1-minute load average "
        f"during the rounds: {', '.join(f'{x:.1f}' for x in results['load_avg'])}",
        "",
        "| case | first step (s) | / torchrun |",
        "|---|---|---|",
        *(f"| {name} | {s:.2f} | {s / torchrun:.2f} |" for name, s in rows),
        "",
        f"Prewarmed: the wait from running the cell, {write_s:.0f} s after `%load_ext sagenb` "
        f"(target: at most 3 s). `%load_ext` itself returned in "
        f"{med['load_ext_s']:.2f} s (the magics already imported in this process).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-s", type=float, default=10.0, help="seconds of writing")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    os.environ[PREWARM_ENV] = "0"  # the cold case starts its own pool
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    try:
        runs = rounds(shell, args.repeats, args.write_s)
    finally:
        cluster.stop_pool()
    names = {
        "cold": "cold_start_first_step_s",
        "warm": "warm_pool_first_step_s",
        "prewarmed": "prewarmed_first_step_s",
        "torchrun": "torchrun_first_step_s",
        "load_ext_s": "load_ext_s",
    }
    results: dict = {
        k: {"median": statistics.median(runs[r]), "all": runs[r]} for r, k in names.items()
    }
    out = Path(args.out)
    torchrun = results["torchrun_first_step_s"]["median"]
    results.update(
        write_s=args.write_s,
        repeats=args.repeats,
        load_avg=runs["load_avg"],
        machine=f"{os.cpu_count()} cores, Python {sys.version.split()[0]}",
        accelerate_first_step_s=accelerate_first_step(out),
        ratios={
            "cold/torchrun": results["cold_start_first_step_s"]["median"] / torchrun,
            "prewarmed/torchrun": results["prewarmed_first_step_s"]["median"] / torchrun,
            "prewarmed/cold": results["prewarmed_first_step_s"]["median"]
            / results["cold_start_first_step_s"]["median"],
        },
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_step.json").write_text(json.dumps(results, indent=1))
    (out / "first_step.md").write_text(markdown(results, args.write_s))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
