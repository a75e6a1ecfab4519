"""sagenb on one GPU against plain PyTorch on the same GPU: the GPU part of the benchmarks.

    python benchmarks/one_gpu.py [--rounds 3] [--out benchmarks/results]

On a machine with CUDA, sagenb trains a GPT on a pool of 1 engine (the engine gets the GPU:
nccl, world size 1) and a plain loop trains the same cell on the same GPU in this process,
alternating; both run the same sample order, batch and steps, in fp32 and in bf16 autocast.
Reported: the throughput ratio (tokens/s), the time to the first step, and the peak of
torch.cuda's allocator on each side; and sagenb's peak with --activation-checkpointing.
Without CUDA the same comparison runs on the CPU with a small GPT: a check that the script
works, whose figures are not a GPU's. Writes one_gpu.md and one_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import sagenb
from sagenb.notebook.examples import gpt_cell

CUDA = torch.cuda.is_available()
# ~40 M parameters, 256 tokens a sample on the GPU; a toy on the CPU
CONTEXT = 256 if CUDA else 32
CELL = (
    gpt_cell(layers=8, width=512, heads=8, vocab=8192, context=CONTEXT, samples=8192, lr=0.01)
    if CUDA
    else gpt_cell(layers=2, width=64, heads=4, vocab=256, context=CONTEXT, samples=2048, lr=0.01)
)
BATCH, STEPS, WARMUP = 32, 60, 10


def tokens_per_s(stamps: list[float]) -> float:
    """Tokens per second between the end of step WARMUP and the end of the last step."""
    return (len(stamps) - WARMUP) * BATCH * CONTEXT / (stamps[-1] - stamps[WARMUP - 1])


def plain(precision: str) -> dict:
    """The cell trained by hand on this process's device, in the contract's sample order."""
    device = torch.device("cuda" if CUDA else "cpu")
    called = time.time()
    torch.manual_seed(0)
    ns: dict = {}
    exec(CELL, ns)
    model = ns["model"].to(device)
    opt = ns["make_optimizer"](list(model.parameters()))
    data, loss_fn = ns["dataset"], ns["loss_fn"]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else None
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    stamps = []
    for step in range(STEPS):
        idx = order[step * BATCH : (step + 1) * BATCH]
        x, y = (t[idx].to(device, non_blocking=True) for t in data.tensors)
        with cast or nullcontext():
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # sagenb reads every step's loss too
        stamps.append(time.time())
    peak = torch.cuda.max_memory_allocated() / 2**20 if CUDA else None
    del model, opt
    if CUDA:
        torch.cuda.empty_cache()
    return {"tokens/s": tokens_per_s(stamps), "first_step_s": stamps[0] - called, "peak_MiB": peak}


def with_sagenb(precision: str, **options) -> dict:
    called = time.time()
    result = sagenb.train(
        CELL,
        engines=1,
        batch_size=BATCH,
        steps=STEPS,
        precision=precision,
        dashboard=False,
        **options,
    )
    rows = [r.values for r in result.metrics]
    peaks = [v.get("memory/device_peak(MiB)") for v in rows]
    return {
        "tokens/s": tokens_per_s([v["time(unix s)"] for v in rows]),
        "first_step_s": rows[0]["time(unix s)"] - called,
        "peak_MiB": max(peaks) if peaks[0] is not None else None,
        "device": result.device,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    sagenb.start_pool(1)
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(args.rounds):  # A B A B: drift hits both sides alike
            for precision in ("fp32", "bf16"):
                runs.setdefault(f"plain {precision}", []).append(plain(precision))
                runs.setdefault(f"sagenb {precision}", []).append(with_sagenb(precision))
        runs["sagenb bf16 + AC"] = [with_sagenb("bf16", activation_checkpointing=True)]
        if CUDA:  # activations in pinned host memory until backward: the device peak drops
            runs["sagenb bf16 + offload"] = [with_sagenb("bf16", offload_activations=True)]
            runs["sagenb bf16 + AC + offload"] = [
                with_sagenb("bf16", activation_checkpointing=True, offload_activations=True)
            ]
    finally:
        sagenb.stop_pool()
    summary = summarise(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "one_gpu.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    (out / "one_gpu.md").write_text(markdown(summary))
    print(markdown(summary))


def summarise(runs: dict[str, list[dict]]) -> dict:
    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return statistics.median(values) if values else None

    rows = {
        name: {k: med(name, k) for k in ("tokens/s", "first_step_s", "peak_MiB")} for name in runs
    }
    for precision in ("fp32", "bf16"):
        pairs = zip(runs[f"sagenb {precision}"], runs[f"plain {precision}"])
        rows[f"sagenb {precision}"]["ratio"] = statistics.median(
            a["tokens/s"] / b["tokens/s"] for a, b in pairs
        )
    device = torch.cuda.get_device_name(0) if CUDA else "CPU (no CUDA: a check, not a GPU figure)"
    return {"device": device, "engine_device": runs["sagenb fp32"][0]["device"], "rows": rows}


def markdown(summary: dict) -> str:
    lines = [
        f"## One GPU: sagenb (1 engine) against plain PyTorch, {summary['device']}",
        "",
        f"GPT, batch {BATCH}, {STEPS} steps (rate after step {WARMUP}); sagenb's engine ran on "
        f"{summary['engine_device']}.",
        "",
        "| run | tokens/s | sagenb / plain | first step s | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for name, row in summary["rows"].items():
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else ""
        peak = f"{row['peak_MiB']:.0f}" if row["peak_MiB"] is not None else "-"
        lines.append(
            f"| {name} | {row['tokens/s']:.0f} | {ratio} | {row['first_step_s']:.2f} | {peak} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
