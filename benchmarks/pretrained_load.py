"""Pretrained weights read shard by shard: each engine's peak RSS while it loads a checkpoint
of more than 1 GB, with --delay-init (each engine reads only what it keeps) and without (each
engine builds the whole model and reads the whole file).

    .venv/bin/python benchmarks/pretrained_load.py [--blocks 16] [--width 2048] [--table]

The model is a stack of residual MLP blocks (two nn.Linear each, width W and 2W) and a head:
16 blocks of width 2048 are 1.07 GB in fp32. Its values are drawn once and saved with
safetensors' save_file to a temporary folder, which is deleted at the end. Every run trains 1
step of the head alone (the blocks frozen), so gradients and optimizer state add nothing to the
peak: what is measured is building and loading the model. 2 engines, `sharded` (FSDP2) and
`model` (a 2-stage pipeline), each with and without --delay-init, on a fresh pool each, whose
engines' peak RSS (VmHWM) the cell resets as it starts (/proc/self/clear_refs, Linux) and
reads in its make_optimizer, which sagenb calls once the strategy has built and loaded the
model, before the first step (the engines' order in the table is their pids'). The RSS of an
engine before the run (torch and sagenb imported) is given beside it, and the peak of the whole
run, read after it: the run's end gathers the trained state to send it to the kernel (rank 0
of `sharded` holds it all), which is the same with and without --delay-init. Writes
pretrained_load.md and pretrained_load.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import sagenb
from sagenb.pool import cluster

HERE = Path(__file__).parent
MIB = 2**20

CELL = """
import torch
from torch import nn
open("/proc/self/clear_refs", "w").write("5")  # this engine's peak RSS counts from here

WIDTH, BLOCKS = {width}, {blocks}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

model = Net()
for p in model.blocks.parameters():
    p.requires_grad_(False)  # the head alone trains: the peak is the model's loading
X = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(0))
dataset = torch.utils.data.TensorDataset(X, X[:, :1])
loss_fn = nn.functional.mse_loss
pretrained = {file!r}

def make_optimizer(params):
    # called once the strategy has built and loaded the model, before the first step: the
    # peak so far is the loading's (the run's end gathers the trained state, more than that)
    import os
    status = open("/proc/self/status").read()
    peak = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")][0]
    open(os.path.join({peaks!r}, str(os.getpid())), "w").write(peak)
    return torch.optim.SGD(params, lr=0.01)
"""


def save_checkpoint(folder: Path, *, width: int, blocks: int) -> tuple[str, int]:
    """The model's tensors, drawn one at a time, in one model.safetensors; its path and size."""
    g = torch.Generator().manual_seed(1)
    state = {}
    for i in range(blocks):
        for name, shape in (("up", (2 * width, width)), ("down", (width, 2 * width))):
            state[f"blocks.{i}.{name}.weight"] = torch.randn(shape, generator=g) * 0.01
            state[f"blocks.{i}.{name}.bias"] = torch.zeros(shape[0])
    state["head.weight"], state["head.bias"] = torch.randn(1, width, generator=g), torch.zeros(1)
    file = folder / "model.safetensors"
    save_file(state, str(file))
    return str(file), file.stat().st_size


def _memory() -> dict:
    """This engine's resident set now and its peak, in MiB (runs on the engines)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def on_engines(pool: cluster.EnginePool) -> list[dict]:
    return [r.get(timeout=60) for r in pool.submit(_memory, [()] * pool.size)]


def measure(cell: str, strategy: str, delay_init: bool, peaks: Path) -> dict:
    for old in peaks.iterdir():
        old.unlink()
    pool = cluster.start_pool(2)  # fresh engines: nothing of an earlier run stays in them
    try:
        before = on_engines(pool)
        split = {"partitions": 2, "microbatches": 2} if strategy == "model" else {}
        started = time.perf_counter()
        result = sagenb.train(
            cell,
            strategy=strategy,
            delay_init=delay_init,
            batch_size=8,
            steps=1,
            dashboard=False,
            **split,
        )
        wall = time.perf_counter() - started
        after = on_engines(pool)
    finally:
        cluster.stop_pool()
    read = [r.values["pretrained_read(MiB)"] for r in result.metrics if r.step == 1]
    return {
        "strategy": strategy,
        "delay_init": delay_init,
        "rss_before(MiB)": [m["VmRSS"] for m in before],
        "peak_rss(MiB)": [int(f.read_text()) / 1024 for f in sorted(peaks.iterdir())],
        "run_peak_rss(MiB)": [m["VmHWM"] for m in after],
        "read(MiB)": read,
        "wall(s)": wall,
    }


def run(width: int, blocks: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="sagenb-pretrained-"))
    try:
        file, size = save_checkpoint(folder, width=width, blocks=blocks)
        peaks = folder / "peaks"
        peaks.mkdir()
        cell = CELL.format(width=width, blocks=blocks, file=file, peaks=str(peaks))
        rows = [
            measure(cell, strategy, delay, peaks)
            for strategy in ("sharded", "model")
            for delay in (False, True)
        ]
    finally:
        shutil.rmtree(folder)  # the 1 GB file goes
    return {"width": width, "blocks": blocks, "file(MiB)": size / MIB, "rows": rows}


def markdown(res: dict) -> str:
    out = [
        f"# Pretrained weights read shard by shard: peak RSS per engine, 2 engines, a "
        f"{res['file(MiB)']:.0f} MiB model.safetensors ({res['blocks']} MLP blocks of width "
        f"{res['width']}, fp32)",
        "",
        "| strategy | --delay-init | checkpoint read per engine (MiB) | RSS before (MiB) | "
        "peak RSS loading (MiB) | loading's peak less the mean before (MiB) | "
        "peak RSS of the whole run (MiB) | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        before = sum(r["rss_before(MiB)"]) / len(r["rss_before(MiB)"])
        grown = [p - before for p in r["peak_rss(MiB)"]]
        out.append(
            f"| {r['strategy']} | {'yes' if r['delay_init'] else 'no'} | "
            f"{_list(r['read(MiB)'])} | {_list(r['rss_before(MiB)'])} | "
            f"{_list(r['peak_rss(MiB)'])} | {_list(grown)} | {_list(r['run_peak_rss(MiB)'])} | "
            f"{r['wall(s)']:.1f} |"
        )
    out += ["", "Ratio of the larger engine's peak while loading, --delay-init over without:", ""]
    for strategy in ("sharded", "model"):
        plain, delayed = (
            max(r["peak_rss(MiB)"])
            for r in sorted(res["rows"], key=lambda r: r["delay_init"])
            if r["strategy"] == strategy
        )
        out.append(f"- {strategy}: {delayed:.0f} / {plain:.0f} MiB = {delayed / plain:.2f}")
    out += [
        "",
        "Without --delay-init each engine builds the whole model and reads the whole file into "
        "it; with it, each reads its half (FSDP2's rows of every tensor, or its pipeline "
        "stage's tensors) into the half it keeps, so the model's part of the peak halves and "
        "the rest is the engine itself (torch imported, about 375 MiB). The whole run's peak "
        "is the same either way: at the end rank 0 of `sharded` gathers the full trained state "
        "(and each pipeline engine its stage's) to send to the kernel, which loading does not "
        "change.",
    ]
    return "\n".join(out) + "\n"


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--table", action="store_true", help="only rewrite the .md from the .json")
    args = parser.parse_args()
    out = HERE / "results"
    if args.table:
        (out / "pretrained_load.md").write_text(
            markdown(json.loads((out / "pretrained_load.json").read_text()))
        )
        return
    res = run(args.width, args.blocks)
    (out / "pretrained_load.json").write_text(json.dumps(res, indent=1))
    (out / "pretrained_load.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
