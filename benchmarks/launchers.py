"""What engines on other hosts cost: pool start time per launcher, and data-parallel throughput
on 2 hosts x 2 engines against 1 host x 4 engines over the same bridge (issue 33 item 4).

    .venv/bin/python benchmarks/launchers.py [--repeats 3] [--steps 40]

Needs root, `ip netns`, and Debian's openssh-server, slurmctld/slurmd/munge, openmpi-bin (what
scripts/test.sh installs); a launcher whose parts are missing is left out and says why.

The hosts are network namespaces on a bridge, made as the tests make them (tests/hosts.py):
two sshd hosts, and a two-node Slurm cluster. Start time: `start_pool(4, launcher=...)` from
the call to a warm pool (engines registered, torch imported, located), median of --repeats,
and its ratio to the local launcher's in the same run. Throughput: the classifier of
benchmarks/peers/workload.py (integer targets, CrossEntropyLoss), batch 128, median
steady-state step time (the first 5 steps left out), on engines started through ssh either
all four on host A or two on each host, so both go through the same ssh launcher and bridge
and differ only in whether the gradient all-reduce crosses between hosts. All of it shares
this machine's cores: four engines on 2 cores are oversubscribed, and what this measures is the
launchers' overhead and the bridge's, not a network between machines.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "peers"))

from workload import CLASSIFY_CELL  # noqa: E402

import sagenb  # noqa: E402
from sagenb.pool import cluster  # noqa: E402
from tests.hosts import SlurmNodes, SshHosts, slurm_missing, ssh_missing  # noqa: E402

OUT = HERE / "results"
WARMUP = 5


def ssh_options(hosts: SshHosts, engines: dict[str, int]) -> dict[str, object]:
    return {
        "SSHEngineSetLauncher.engines": engines,
        "SSHEngineSetLauncher.ssh_args": hosts.ssh_args,
        "SSHEngineSetLauncher.scp_args": hosts.ssh_args,
        "SSHEngineSetLauncher.remote_profile_dir": str(hosts.remote_profile),
    }


def start_seconds(launcher: str, options: Mapping[str, object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        cluster.stop_pool()
        started = time.perf_counter()
        cluster.start_pool(4, launcher=launcher, options=dict(options), timeout=300)
        times.append(time.perf_counter() - started)
    cluster.stop_pool()
    return times


def step_time(steps: int) -> float:
    result = sagenb.train(CLASSIFY_CELL, batch_size=128, steps=steps, dashboard=False)
    return statistics.median(row["step_time(s)"] for row in result.history[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ["SAGENB_PREWARM"] = "0"
    starts: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}
    starts["local"] = start_seconds("local", {}, args.repeats)
    if shutil.which("mpiexec") and importlib.util.find_spec("mpi4py"):
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # Open MPI refuses root unless told
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        mpi = {"MPILauncher.mpi_args": ["--oversubscribe"]}  # 4 ranks on 2 cores
        starts["mpi"] = start_seconds("mpi", mpi, args.repeats)
    else:
        skipped["mpi"] = "no mpiexec or mpi4py"
    throughput: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        reason = ssh_missing()
        if reason:
            skipped["ssh"] = reason
        else:
            hosts = SshHosts(Path(folder))
            try:
                hosts.create()
                a, b = hosts.addresses
                starts["ssh"] = start_seconds("ssh", ssh_options(hosts, {a: 2, b: 2}), args.repeats)
                for label, engines in (("1x4", {a: 4}), ("2x2", {a: 2, b: 2})):
                    cluster.start_pool(4, launcher="ssh", options=ssh_options(hosts, engines))
                    throughput[label] = 128 / step_time(args.steps)
                    cluster.stop_pool()
            finally:
                cluster.stop_pool()
                hosts.remove()
    with tempfile.TemporaryDirectory() as folder:
        reason = slurm_missing()
        if reason:
            skipped["slurm"] = reason
        else:
            nodes = SlurmNodes(Path(folder))
            try:
                nodes.create()
                os.environ.update(nodes.env)
                starts["slurm"] = start_seconds("slurm", {}, args.repeats)
            finally:
                cluster.stop_pool()
                nodes.remove()
    local = statistics.median(starts["local"])
    report = {
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "load_1min": os.getloadavg()[0],
        "start_s": {k: statistics.median(v) for k, v in starts.items()},
        "start_runs_s": starts,
        "start_vs_local": {k: statistics.median(v) / local for k, v in starts.items()},
        "throughput_samples_s": throughput,
        "skipped": skipped,
    }
    if len(throughput) == 2:
        report["2x2_vs_1x4"] = throughput["2x2"] / throughput["1x4"]
    OUT.mkdir(exist_ok=True)
    (OUT / "launchers.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Launchers: pool start time, and 2 hosts x 2 engines against 1 x 4",
        "",
        f"`.venv/bin/python benchmarks/launchers.py --repeats {args.repeats} --steps "
        f"{args.steps}` on {report['machine']} (1-minute load {report['load_1min']:.1f} at the "
        "end). Hosts are network namespaces on a bridge (tests/hosts.py); four engines share "
        "this machine's cores.",
        "",
        "| launcher | pool of 4 started in (median) | runs | against local |",
        "|---|---|---|---|",
    ]
    for name, runs in starts.items():
        lines.append(
            f"| {name} | {statistics.median(runs):.1f} s | "
            f"{', '.join(f'{t:.1f}' for t in runs)} | {statistics.median(runs) / local:.2f}x |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | not measured: {why} | | |")
    if "2x2_vs_1x4" in report:
        lines += [
            "",
            "Data parallel, the classifier of benchmarks/peers/workload.py, batch 128, "
            f"median of steps {WARMUP + 1}-{args.steps}, engines started through ssh:",
            "",
            "| layout | samples/s |",
            "|---|---|",
            f"| 1 host x 4 engines | {throughput['1x4']:.0f} |",
            f"| 2 hosts x 2 engines | {throughput['2x2']:.0f} |",
            "",
            f"2 x 2 against 1 x 4: **{report['2x2_vs_1x4']:.2f}x** (the all-reduce crosses the "
            "bridge; compute is the same, on the same shared cores).",
        ]
    (OUT / "launchers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
