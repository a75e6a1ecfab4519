"""How close the estimate (sagenb/sizing/footprint.py) comes to what the engines hold and do.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/estimate_accuracy.py [--steps 3] [--skip-train]

For the GPT example cell in data, sharded, tensor and model (pipeline) parallel on 2 and 4
engines, trains a few steps for real and compares each rank's memory with the engines' exact
accounting (engine/memory.py: parameters, gradients and optimizer state held, the peak of
activations saved for backward): issue 16 asks for params/grads/optimizer within 2% and
activations within 20%. Also:

- FLOPs against the analytic count for a GPT, 6 N D for the weights' matmuls (Kaplan et al.
  2020, arXiv:2001.08361, section 2.1: forward 2N per token, backward twice that) plus
  12 L s d per token for attention's score and value matmuls (PaLM, arXiv:2204.02311,
  appendix B; Chinchilla, arXiv:2203.15556, appendix F counts the same terms). N counts the
  parameters that enter a matmul (the tied embedding does, as the output head; the learned
  positions do not). torch's FlopCounterMode counts causal attention as full, as does this.
- the time and peak RSS to estimate a ~1-billion-parameter GPT on 8 ranks, sharded, in a
  fresh process (issue 16: under 30 s, under 2 GiB): the model is never allocated.

Writes benchmarks/results/estimate_accuracy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from sagenb.config import EngineConfig
from sagenb.metrics import keys
from sagenb.notebook.examples import gpt_cell
from sagenb.sizing.footprint import footprint

LAYERS, WIDTH, HEADS, VOCAB, CONTEXT = 4, 128, 4, 512, 64
GPT = gpt_cell(layers=LAYERS, width=WIDTH, heads=HEADS, vocab=VOCAB, context=CONTEXT, samples=256)
BATCH = 32
CASES = [  # (label, options, engines)
    ("data", dict(strategy="data"), 2),
    ("data", dict(strategy="data"), 4),
    ("sharded", dict(strategy="sharded"), 2),
    ("sharded", dict(strategy="sharded"), 4),
    ("tensor", dict(strategy="tensor"), 2),
    ("tensor", dict(strategy="tensor"), 4),
    ("model", dict(strategy="model", partitions=2), 2),
    ("model", dict(strategy="model", partitions=4), 4),
    ("data + AC", dict(strategy="data", activation_checkpointing=True), 2),
    ("sharded + bf16", dict(strategy="sharded", precision="bf16"), 2),
]
KINDS = (keys.MEMORY_PARAMS, keys.MEMORY_GRADS, keys.MEMORY_OPTIMIZER, keys.MEMORY_ACTIVATIONS)
LIMITS = {keys.MEMORY_ACTIVATIONS: 0.20}  # the others: 0.02
BIG = dict(layers=18, width=2048, heads=16, vocab=50304, context=1024, samples=1024)

BIG_SCRIPT = """
import json, resource, sys, time
t0 = time.perf_counter()
from sagenb.config import EngineConfig
from sagenb.sizing.footprint import footprint
from sagenb.notebook.examples import gpt_cell
imported = time.perf_counter()
f = footprint(gpt_cell(**json.loads(sys.argv[1])), EngineConfig(strategy="sharded",
              batch_size=64, precision="bf16"), 8)
done = time.perf_counter()
print(json.dumps({"params": f.params, "import_s": imported - t0, "estimate_s": done - imported,
                  "total_s": done - t0, "rank0": f.ranks[0], "flops_per_step": f.flops_per_step,
                  "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measured_ranks(options: dict, engines: int, steps: int) -> list[dict[str, float]]:
    """Each rank's largest value of each kind over the steps, from the engines' metrics."""
    import sagenb
    from sagenb.pool import cluster

    pool = cluster.current_pool()
    if pool is None or pool.size != engines:
        cluster.stop_pool()
        cluster.start_pool(engines)
    result = sagenb.train(
        GPT, batch_size=BATCH, steps=steps, dashboard=False, engines=engines, **options
    )
    ranks: list[dict[str, float]] = [{k: 0.0 for k in KINDS} for _ in range(engines)]
    for rec in result.metrics:
        for k in KINDS:
            ranks[rec.rank][k] = max(ranks[rec.rank][k], rec.values[k])
    return ranks


def compare(label: str, options: dict, engines: int, steps: int, train: bool) -> dict:
    config = EngineConfig(batch_size=BATCH, **options)
    started = time.perf_counter()
    est = footprint(GPT, config, engines)
    row = {"case": label, "engines": engines, "estimate_s": time.perf_counter() - started}
    row["estimated"] = est.ranks
    if not train:
        return row
    real = measured_ranks(options, engines, steps)
    row["measured"] = real
    errors = {}
    for k in KINDS:
        errors[k] = max(
            abs(e[k] - m[k]) / m[k] if m[k] else abs(e[k]) for e, m in zip(est.ranks, real)
        )
    row["max_rel_error"] = errors
    row["within"] = all(errors[k] <= LIMITS.get(k, 0.02) for k in KINDS)
    return row


def flops_check() -> dict:
    """Counted FLOPs of one step against 6ND + 12 L s d per token."""
    est = footprint(GPT, EngineConfig(batch_size=BATCH), 2)
    matmul_params = est.params - CONTEXT * WIDTH  # the learned positions enter no matmul
    tokens = est.tokens_per_step
    assert tokens is not None
    analytic = 6 * matmul_params * tokens + 12 * LAYERS * CONTEXT * WIDTH * tokens
    return {
        "counted": est.flops_per_step,
        "analytic_6ND_plus_attention": analytic,
        "ratio": est.flops_per_step / analytic,
        "within_10pct": abs(est.flops_per_step / analytic - 1) <= 0.10,
    }


def big_check() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", BIG_SCRIPT, json.dumps(BIG)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    found["config"] = dict(BIG, strategy="sharded", engines=8, batch_size=64, precision="bf16")
    found["within"] = found["total_s"] < 30 and found["peak_rss_MiB"] < 2048
    return found


def table(results: dict) -> str:
    short = {k: k.split("/")[1].split("(")[0] for k in KINDS}
    lines = [
        "# Estimate accuracy (issue 16)",
        "",
        f"GPT cell: {LAYERS} layers, width {WIDTH}, vocab {VOCAB}, context {CONTEXT}, global "
        f"batch {BATCH}, SGD with momentum. Max relative error over ranks, estimate "
        "(`sagenb/sizing/footprint.py`, fake tensors) against the engines' exact accounting "
        "(`engine/memory.py`). Limits: params/grads/optimizer 2%, activations 20%.",
        "",
        "| case | engines | " + " | ".join(short.values()) + " | within | estimate s |",
        "|---|---|" + "---|" * len(KINDS) + "---|---|",
    ]
    for row in results["cases"]:
        errs = row.get("max_rel_error")
        cells = [f"{errs[k]:.1%}" if errs else "-" for k in KINDS]
        within = "yes" if row.get("within") else ("-" if errs is None else "NO")
        lines.append(
            f"| {row['case']} | {row['engines']} | "
            + " | ".join(cells)
            + f" | {within} | {row['estimate_s']:.1f} |"
        )
    fl, big = results["flops"], results["big"]
    lines += [
        "",
        f"FLOPs per step: counted {fl['counted']:.4g}, 6ND + 12Lsd per token "
        f"{fl['analytic_6ND_plus_attention']:.4g}, ratio {fl['ratio']:.3f} "
        f"({'within' if fl['within_10pct'] else 'OUTSIDE'} 10%).",
        "",
        f"1B GPT ({big['params'] / 1e9:.2f}B parameters: {big['config']}): estimate "
        f"{big['estimate_s']:.1f} s after {big['import_s']:.1f} s of imports "
        f"({big['total_s']:.1f} s in all), peak RSS {big['peak_rss_MiB']:.0f} MiB "
        f"({'within' if big['within'] else 'OUTSIDE'} 30 s / 2 GiB). Rank 0: "
        + ", ".join(f"{short[k]} {big['rank0'][k]:.0f} MiB" for k in KINDS)
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-train", action="store_true", help="estimates only")
    args = parser.parse_args()
    results = {
        "cases": [compare(*case, args.steps, not args.skip_train) for case in CASES],
        "flops": flops_check(),
        "big": big_check(),
    }
    if not args.skip_train:
        from sagenb.pool import cluster

        cluster.stop_pool()
    out = Path(__file__).parent / "results"
    (out / "estimate_accuracy.json").write_text(json.dumps(results, indent=1))
    (out / "estimate_accuracy.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
