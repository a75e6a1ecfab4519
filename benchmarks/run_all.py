"""Every benchmark in one command, on this machine; writes results/summary.md and summary.json.

    .venv/bin/python benchmarks/run_all.py [--quick]

Runs, one after another (each alone on the machine): time to first step (cold and warm pool),
sagenb against a torchrun DDP script, Accelerate's notebook_launcher, its own live dashboard and
1 engine, the pipeline benchmarks, the memory savers (data, sharded and tensor parallel, with and
without activation checkpointing), the estimate's memory against the engines' over a spread of
cells, recovery from injected faults, batches loaded by DataLoader
workers (--data-workers) against the training thread, a live redraw's cost as a run grows,
and, where Debian's chromium is, the live dashboard's cost in a real JupyterLab and browser
(during training, and by kind of update without it). On a machine with CUDA it also runs
one_gpu.py (sagenb on the GPU against plain PyTorch on it, with torch.cuda memory); engines use
nccl and CUDA memory wherever each has its own GPU.
`bash benchmarks/gpu.sh` is the one command for a one-GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "results"


def run(script: str, *args: str) -> None:
    started = time.perf_counter()
    subprocess.run([sys.executable, str(HERE / script), *args], check=True)
    print(f"{script}: {time.perf_counter() - started:.0f} s", flush=True)


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def browser() -> bool:
    """Debian's chromium, for the dashboard in a real JupyterLab (scripts/test.sh installs it)."""
    return os.access("/usr/bin/chromium", os.X_OK)


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def estimate_row(acc: dict) -> str:
    """The estimate's worst error per memory kind over its spread of cells, pipelines cut
    alike on both sides (estimate_accuracy.md says which cut otherwise, and why)."""
    worst, apart = acc["worst_same_cuts"], len(acc["cuts_differ"])
    compared = sum("max_rel_error" in r for r in acc["cases"]) - apart
    return (
        f"| estimate against the engines' memory, worst of {compared} cases over 8 cells "
        f"(params, grads, optimizer, activations; {apart} pipelines that --partition-by auto "
        "cut elsewhere left out) | "
        + ", ".join(f"{w['error']:.1%}" for w in worst.values())
        + " | <= 2%, 2%, 2%, 20% |"
    )


def summary_md(res: dict) -> str:
    fs, peers = res["first_step"], res["against_peers"]["summary"]
    tp, first = peers["throughput(samples/s)"], peers["first_step_s"]
    by_loss = ", ".join(
        f"{name} {row['ratio sagenb/torchrun']:.3f}" for name, row in peers["workloads"].items()
    )
    lines = [
        "# sagenb benchmarks",
        "",
        f"Machine: {res['machine']}",
        "",
        *(
            [
                "Assembled by `run_all.py --summary-only` from each benchmark's latest results "
                "file (each written by its own run of that benchmark, not one run of all).",
                "",
            ]
            if res.get("assembled")
            else []
        ),
        "| what | figure | target |",
        "|---|---|---|",
        f"| sagenb / torchrun DDP throughput (median of per-round ratios), by loss | "
        f"{by_loss} | >= 1.00 |",
        f"| live dashboard, no browser attached: throughput with / without | "
        f"{peers['ratio sagenb+dashboard/sagenb']:.3f} | >= 0.98 (under 2% overhead) |",
        f"| time to first step, warm pool (s) | {fs['warm_pool_first_step_s']['median']:.3f} | |",
        f"| time to first step, cold start with pool start (s) | "
        f"{fs['cold_start_first_step_s']['median']:.2f} | |",
        f"| 2 engines / 1 engine throughput, same global batch | "
        f"{peers['ratio sagenb 2 engines/1 engine']:.2f} | (2 shared cores) |",
    ]
    if peers.get("ratio sagenb/accelerate") is not None:
        lines += [
            f"| sagenb / Accelerate notebook_launcher throughput | "
            f"{peers['ratio sagenb/accelerate']:.3f} | |",
            f"| first step, first run: sagenb (starts its pool) / Accelerate (s) | "
            f"{peers['sagenb_first_run_first_step_s']:.2f} / "
            f"{peers['accelerate_first_run_first_step_s']:.2f} | |",
            f"| first step, repeated run: sagenb / Accelerate (s) | "
            f"{first['sagenb regress']:.2f} / {first['accelerate']:.2f} | sagenb ahead |",
        ]
    share = peers.get("dashboard notebook CPU share of the machine")
    if share is not None:
        lines.insert(
            lines.index("|---|---|---|") + 3,
            f"| live dashboard, no browser attached: the notebook's added CPU, share of the "
            f"machine | {share:.1%} | |",
        )
    if res.get("dashboard_browser"):
        runs = res["dashboard_browser"]["summary"]["runs"]
        lines.insert(
            lines.index("|---|---|---|") + 3,
            "| live dashboard in JupyterLab + Chromium on this machine: throughput with / "
            "without, runs of "
            + ", ".join(f"{r['steps']}" for r in runs)
            + " steps | "
            + ", ".join(f"{r['throughput live/none']:.3f}" for r in runs)
            + " | >= 0.98 (under 2% overhead) |",
        )
    if res.get("estimate_accuracy"):
        lines.insert(lines.index("|---|---|---|") + 3, estimate_row(res["estimate_accuracy"]))
    pipe = {r["schedule"]: r["sagenb/torchrun"] for r in res["pipeline"].get("peers", [])}
    if pipe:
        lines.insert(
            lines.index("|---|---|---|") + 2,
            "| sagenb / torchrun torch.distributed.pipelining throughput, 2 stages ("
            + ", ".join(pipe)
            + ") | "
            + ", ".join(f"{v:.3f}" for v in pipe.values())
            + " | |",
        )
    lines += [
        "",
        "Throughput (samples/s, medians): " + ", ".join(f"{k} {v:.0f}" for k, v in tp.items()),
    ]
    lines += ["", (HERE / "results" / "pipeline.md").read_text().split("\n", 2)[2]]
    lines += ["#" + (HERE / "results" / "memory_savers.md").read_text()]
    lines += [(HERE / "results" / "recovery.md").read_text().split("\n", 1)[1]]
    if res.get("data_workers"):
        lines += ["#" + (HERE / "results" / "data_workers.md").read_text()]
    if res.get("dashboard_redraw"):
        lines += ["#" + (HERE / "results" / "dashboard_redraw.md").read_text()]
    if res.get("dashboard_browser"):
        lines += ["#" + (HERE / "results" / "dashboard_browser.md").read_text()]
    if res.get("dashboard_page"):
        lines += ["#" + (HERE / "results" / "dashboard_page.md").read_text()]
    if res.get("one_gpu"):
        lines += ["#" + (HERE / "results" / "one_gpu.md").read_text()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--summary-only", action="store_true", help="assemble the last results")
    args = parser.parse_args()
    repeats = "1" if args.quick else "3"
    if not args.summary_only:
        run("first_step.py", "--repeats", repeats)
        run("against_peers.py", "--rounds", "1" if args.quick else "5")  # the noisiest figures
        run("pipeline.py", "--rounds", "1" if args.quick else "3")
        run("memory_savers.py", "--rounds", "1" if args.quick else "2")
        run("estimate_accuracy.py")
        run("recovery.py")
        run("data_workers.py", "--rounds", "1" if args.quick else "3")
        run("dashboard_redraw.py")
        if browser():
            run("dashboard_browser.py", "--rounds", "1" if args.quick else "3")
            run("dashboard_page.py", "--rounds", "1" if args.quick else "2")
        if cuda():
            run("one_gpu.py", "--rounds", "1" if args.quick else "3")
    res = {"machine": machine(), "assembled": args.summary_only}
    for name in ("first_step", "against_peers", "pipeline", "memory_savers", "recovery"):
        res[name] = json.loads((OUT / f"{name}.json").read_text())
    if (OUT / "estimate_accuracy.json").exists():
        res["estimate_accuracy"] = json.loads((OUT / "estimate_accuracy.json").read_text())
    if (OUT / "data_workers.json").exists():
        res["data_workers"] = json.loads((OUT / "data_workers.json").read_text())
    if (OUT / "dashboard_redraw.json").exists():
        res["dashboard_redraw"] = json.loads((OUT / "dashboard_redraw.json").read_text())
    if (OUT / "dashboard_browser.json").exists():
        res["dashboard_browser"] = json.loads((OUT / "dashboard_browser.json").read_text())
    if (OUT / "dashboard_page.json").exists():
        res["dashboard_page"] = json.loads((OUT / "dashboard_page.json").read_text())
    if cuda():
        res["one_gpu"] = json.loads((OUT / "one_gpu.json").read_text())
    (OUT / "summary.json").write_text(json.dumps(res, indent=1))
    (OUT / "summary.md").write_text(summary_md(res))
    print(summary_md(res))


if __name__ == "__main__":
    main()
