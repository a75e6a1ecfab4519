"""Beyond one machine: engines started by MPI, and engines on two 'hosts' (network namespaces
with their own addresses) training together with the rendezvous on a non-loopback address.
Both equal the single-process reference."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ipyparallel as ipp
import psutil
import pytest

import sagenb
from sagenb.pool import cluster
from sagenb.run.failures import EngineDiedError

from .helpers import THREE_STRATEGIES, assert_params_equal, check_strategies, fault_cell
from .hosts import SshHosts, TwoHosts, namespaces_unavailable, ssh_missing
from .models import SEQUENTIAL_CELL


def check_both_strategies():
    check_strategies(SEQUENTIAL_CELL, THREE_STRATEGIES[::2], batch_size=32, steps=6)  # data, model


# -- MPI ------------------------------------------------------------------------------------
def _mpi_missing() -> str | None:
    if shutil.which("mpiexec") is None:
        return "no mpiexec (Debian: apt-get install openmpi-bin; scripts/test.sh does it as root)"
    if importlib.util.find_spec("mpi4py") is None:
        return "no mpi4py (ipyparallel's MPI engines need it)"
    return None


@pytest.fixture
def mpi_pool(_stop_pool_at_end, monkeypatch):
    reason = _mpi_missing()
    if reason:
        pytest.skip(reason)
    if os.getuid() == 0:  # Open MPI refuses to run as root unless told
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    pool = cluster.start_pool(2, launcher="mpi")
    yield pool
    cluster.stop_pool()


def test_mpi_launcher_pool_trains_like_one_process(mpi_pool):
    assert mpi_pool.launcher == "mpi" and mpi_pool.size == 2
    check_both_strategies()
    assert cluster.restart_pool().launcher == "mpi"  # a restart keeps the launcher


# -- two hosts on one machine -----------------------------------------------------------------
@pytest.fixture
def two_host_pool(_stop_pool_at_end, tmp_path):
    """A controller on the bridge address and one engine in each namespace, started outside
    sagenb (as `ipcluster` on two machines would); sagenb attaches to it."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    cluster.stop_pool()
    hosts = TwoHosts()
    engines: list[subprocess.Popen] = []
    controller = None
    try:
        hosts.create()
        profile = tmp_path / "profile"
        controller = ipp.Cluster(
            n=0,
            controller_ip=hosts.address,
            profile_dir=str(profile),
            cluster_id="twohosts",
            log_level=logging.ERROR,
        )
        controller.start_controller_sync()
        controller.update_cluster_file()
        connection = profile / "security" / "ipcontroller-twohosts-engine.json"
        for ns in hosts.namespaces:
            command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ipyparallel.engine"]
            engines.append(
                subprocess.Popen(
                    [*command, f"--file={connection}", "--log-level=ERROR"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        client = controller.connect_client_sync()
        client.wait_for_engines(2, timeout=120, interactive=False)
        client.close()
        yield cluster.attach_pool(profile=str(profile), cluster_id="twohosts"), hosts
    finally:
        cluster.stop_pool()  # lets go of the attached pool; its engines are ours to stop
        for proc in engines:
            proc.kill()
        for proc in engines:
            proc.wait(timeout=30)
        if controller is not None:
            controller.stop_cluster_sync()
        hosts.remove()


def test_two_hosts_train_like_one_process(two_host_pool):
    pool, hosts = two_host_pool
    assert not pool.owned and pool.multi_host
    addresses = sorted(row.address for row in pool.status())
    assert addresses == [f"{hosts.subnet}.2", f"{hosts.subnet}.3"]
    check_both_strategies()
    stopped = time.perf_counter()
    cluster.stop_pool()  # an attached pool is let go of, not stopped: its engines live on
    assert time.perf_counter() - stopped < 5
    again = cluster.attach_pool(profile=str(Path(pool.cluster.profile_dir)), cluster_id="twohosts")
    assert again.size == 2


# -- two hosts reached through ssh -------------------------------------------------------------
@pytest.fixture
def ssh_hosts(_stop_pool_at_end, tmp_path):
    reason = ssh_missing()
    if reason:
        pytest.skip(reason)
    cluster.stop_pool()
    hosts = SshHosts(tmp_path)
    try:
        hosts.create()
        yield hosts
    finally:
        cluster.stop_pool()
        for proc in hosts.engines():
            proc.kill()
        hosts.remove()


def _gone_within(hosts: SshHosts, seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (left := hosts.engines()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _ssh_options(hosts: SshHosts) -> dict[str, object]:
    """The launcher options a user gives for these hosts; the ssh arguments are the test's
    own key and throwaway host keys, and the copied connection files land apart from the
    notebook's own profile (both "hosts" share this machine's disk)."""
    return {
        "SSHEngineSetLauncher.engines": {addr: 2 for addr in hosts.addresses},
        "SSHEngineSetLauncher.ssh_args": hosts.ssh_args,
        "SSHEngineSetLauncher.scp_args": hosts.ssh_args,
        "SSHEngineSetLauncher.remote_profile_dir": str(hosts.remote_profile),
    }


def _on_each_host(pool, hosts: SshHosts) -> None:
    assert sorted(row.address for row in pool.status()) == sorted(hosts.addresses * 2)


def test_ssh_launcher_starts_engines_on_two_hosts_that_train_like_one_process(ssh_hosts):
    from IPython.core.interactiveshell import InteractiveShell

    hosts = ssh_hosts
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    # the line a user types (README, docs/beyond-one-machine.md)
    options = " ".join(f'--launcher-option "{k}={v}"' for k, v in _ssh_options(hosts).items())
    shell.run_line_magic("smp_cluster", f"start -n 4 --launcher ssh {options}")
    pool = cluster.current_pool()
    assert pool is not None and pool.launcher == "ssh" and pool.multi_host
    _on_each_host(pool, hosts)
    assert pool.controller_host == hosts.address  # on the route to them, not this host's name
    assert len(hosts.engines()) >= 4  # started by the hosts' sshd, not by this process
    model = check_strategies(SEQUENTIAL_CELL, THREE_STRATEGIES, batch_size=32, steps=6)

    # an engine killed on the second host mid-run is named with its host; the next run
    # starts its replacement there (not on the first host: ipyparallel's order)
    name, addr = hosts.names[1], hosts.addresses[1]
    rank = [pool.address(e) for e in pool.engine_ids].index(addr)
    where = rf"rank {rank} \(engine \d+ on {name} \({re.escape(addr)}\)\) failed:\n.*died"
    with pytest.raises(EngineDiedError, match=where):
        kill = fault_cell("os.kill(os.getpid(), signal.SIGKILL)", rank=rank)
        sagenb.train(kill, batch_size=16, steps=20, dashboard=False)
    result = sagenb.train(SEQUENTIAL_CELL, batch_size=32, steps=6, dashboard=False)
    assert_params_equal(result.state_dict(), model, context="healed")
    _on_each_host(pool, hosts)

    # a restart ends every engine on both hosts and starts four new ones
    before = {p.pid for p in hosts.engines()}
    shell.run_line_magic("smp_cluster", "restart")
    pool = cluster.current_pool()
    _on_each_host(pool, hosts)
    assert not before & {p.pid for p in hosts.engines()}, "an engine outlived the restart"

    shell.run_line_magic("smp_cluster", "stop")
    left = _gone_within(hosts, 30)
    assert not left, f"left on the hosts after stop: {[p.cmdline() for p in left]}"


KERNEL = """
import json, sys, time
import sagenb
pool = sagenb.start_pool(2, launcher="ssh", options=json.loads(sys.argv[1]))
print(len(pool.client.ids), flush=True)
time.sleep(600)  # killed here
"""


def test_a_kernel_killed_by_sigkill_leaves_nothing_on_either_host(ssh_hosts):
    """The watcher (pool/reaper.py) ends the engines on the other hosts over ssh: nothing on
    this machine is their parent, and their heartbeat would keep them for minutes."""
    hosts = ssh_hosts
    one_each = {addr: 1 for addr in hosts.addresses}
    options = {**_ssh_options(hosts), "SSHEngineSetLauncher.engines": one_each}
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL, json.dumps(options)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert kernel.stdout is not None
        assert kernel.stdout.readline().strip() == "2"
        assert len(hosts.engines()) >= 2
    finally:
        kernel.kill()
        kernel.wait(timeout=30)
    left = _gone_within(hosts, 30)
    assert not left, f"left on the hosts after SIGKILL: {[p.cmdline() for p in left]}"


@pytest.mark.parametrize(
    "line, message",
    [
        ("start --launcher pbs", r"argument --launcher: invalid choice: 'pbs'"),
        ("start --launcher-option nope", r"--launcher-option 'nope': must be CLASS.TRAIT=VALUE"),
        ("start --timeout soon", r"--timeout: 'soon': must be a number of seconds above 0"),
        ("start --timeout 0", r"--timeout: '0': must be a number of seconds above 0"),
        ("start --profile /no/such/dir --cluster-id x", r"no running ipyparallel cluster found"),
    ],
)
def test_bad_cluster_lines_say_what_to_change(line, message):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("smp_cluster", line)


def test_replacements_go_to_the_hosts_that_lost_engines():
    from sagenb.pool.remote import replacements

    own = {"n": 2, "remote_python": "/opt/py/bin/python"}
    engines = {"10.1.1.2": 2, "me@10.1.1.3:2222": own}
    lost_on_b = replacements(engines, ["10.1.1.2", "10.1.1.2", "10.1.1.3"], 1)
    assert lost_on_b == {"me@10.1.1.3:2222": {"n": 1, "remote_python": "/opt/py/bin/python"}}
    assert own["n"] == 2  # the user's setting is left as it was
    assert replacements(engines, ["10.1.1.3"], 3) == {"10.1.1.2": 2, **lost_on_b}
    # counts that do not add up, a host that does not resolve: ipyparallel's own order
    assert replacements(engines, ["10.1.1.3"], 1) is None
    assert replacements({"no-such-host.invalid": 2}, [], 2) is None
