"""Engines through Slurm, for real (issue 33 item 2): a two-node Slurm cluster made on this
machine (tests/hosts.py: slurmctld, a slurmd in each of two network namespaces, munge), into
which `%smp_cluster start -n 4 --launcher slurm` submits the engines with ipyparallel's Slurm
launcher. The pool trains like one process; stop, a killed kernel and a start that times out
in the queue each leave no job behind."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest

from sagenb.pool import cluster

from .helpers import THREE_STRATEGIES, check_strategies
from .hosts import SlurmNodes, slurm_missing
from .models import SEQUENTIAL_CELL


@pytest.fixture
def slurm(_stop_pool_at_end, tmp_path, monkeypatch):
    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    cluster.stop_pool()
    nodes = SlurmNodes(tmp_path)
    try:
        nodes.create()
        for key, value in nodes.env.items():  # as a user's shell on a login node has it
            monkeypatch.setenv(key, value)
        yield nodes
    finally:
        cluster.stop_pool()
        nodes.remove()


def _jobs_within(nodes: SlurmNodes, seconds: float, *, keep: str = "") -> list[str]:
    """squeue's jobs (but `keep`) once none is left, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := [j for j in nodes.jobs() if keep not in j or not keep]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    return left


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    return shell


def test_a_slurm_pool_trains_like_one_process_and_stop_cancels_its_job(slurm):
    shell = _shell()
    shell.run_line_magic("smp_cluster", "start -n 4 --launcher slurm")  # the line a user types
    pool = cluster.current_pool()
    assert pool is not None and pool.launcher == "slurm" and pool.multi_host
    places = sorted((row.host, row.address) for row in pool.status())
    assert places == sorted(list(zip(slurm.names, slurm.addresses)) * 2)  # 2 on each node
    assert pool.controller_host == slurm.address  # on the route to slurmctld, not loopback
    assert any("ipengine" in job and "RUNNING" in job for job in slurm.jobs())
    check_strategies(SEQUENTIAL_CELL, THREE_STRATEGIES, batch_size=32, steps=6)
    shell.run_line_magic("smp_cluster", "stop")
    assert _jobs_within(slurm, 30) == []
    assert not os.path.exists("slurm_engine.sbatch")  # the job's script is not left in the cwd


KERNEL = """
import sagenb
pool = sagenb.start_pool(2, launcher="slurm")
print(len(pool.client.ids), flush=True)
import time; time.sleep(600)  # killed here
"""


def test_a_kernel_killed_by_sigkill_cancels_its_job(slurm):
    """The watcher (pool/reaper.py) runs the job's scancel: nothing on this machine is the
    engines' parent, and the job would otherwise hold both nodes."""
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert kernel.stdout is not None
        assert kernel.stdout.readline().strip() == "2"
        assert any("ipengine" in job for job in slurm.jobs())
    finally:
        kernel.kill()
        kernel.wait(timeout=30)
    assert _jobs_within(slurm, 30) == []


def test_a_job_waiting_in_the_queue_says_why_and_times_out_on_the_flag(slurm, capsys):
    # another user's job holds every CPU of both nodes
    blocker = slurm.run(
        "sbatch", "-n", "4", "-J", "blocker", "-o", os.devnull, "--wrap", "sleep 600"
    ).split()[-1]  # its output nowhere: by default slurm-JOB.out in the cwd
    shell = _shell()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"(?s)0 of 4 engines registered within 8 s.*"
                       r"pending: Resources.*--timeout SECONDS.*job cancelled"):  # fmt: skip
        shell.run_line_magic("smp_cluster", "start -n 4 --launcher slurm --timeout 8")
    assert time.monotonic() - started < 60
    assert "pending: Resources" in capsys.readouterr().out  # said while it waited
    assert not glob.glob("slurm-*.out") and not os.path.exists("slurm_engine.sbatch")
    assert _jobs_within(slurm, 30, keep="blocker") == []  # ours is gone, the blocker is not
    assert any(blocker in job for job in slurm.jobs())
