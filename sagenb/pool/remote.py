"""Engines on other hosts, started through ssh or a batch system (Slurm): how to end them from
here, and where to start their replacements.

ipyparallel's SSH launcher starts each engine with `nohup ... &` in an ssh session that then
ends (its launcher.py, `ShellCommandSend.cmd_start`), and its Slurm launcher submits a job that
slurmd runs on the nodes: nothing on this machine is the engines' parent. A kernel killed by
SIGKILL ends its controller through the watcher (reaper.py), but the engines would run on until
they miss the controller's heartbeat for minutes (launchers.ENGINE_HEARTBEAT), and a Slurm job
would hold its nodes as long. So the watcher is also handed, for each engine on another host,
the command that ends it: a kill over ssh (SIGTERM, then SIGKILL, in one bounded session), or
`scancel JOBID` with the Slurm settings of this process's environment. The commands run in
parallel, each bounded: a host that no longer answers holds the watcher for at most `timeout`.

A replacement engine (`EnginePool.heal`) goes to the host that lost one: ipyparallel's
`SSHEngineSetLauncher.start(n)` fills its `engines` hosts in order, which would put every
replacement on the first host and leave the layout (2 x 2 becomes 3 + 1) unlike the one the
user asked for.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["enders", "end_remote", "replacements", "batch_jobs", "job_states", "JobWatcher"]

#: seconds ssh waits for a host that does not answer, when ending its engines
CONNECT_TIMEOUT_S = 10
#: what a batch command needs from this process's environment (SLURM_CONF: which cluster)
_BATCH_ENV = ("SLURM_", "PATH")
#: seconds between two reads of a batch job's state while its engines are awaited (squeue)
JOB_POLL_S = 2.0


def enders(cluster: Any, *, grace: float) -> list[list[Any]]:
    """[[key, argv, env], ...]: for each of the cluster's engines started through ssh, the
    command that ends it (SIGTERM, SIGKILL `grace` s later), and for each batch job of engines,
    the command that cancels it. Empty for local and MPI engines (this machine's processes)."""
    from ipyparallel.cluster.launcher import BatchSystemLauncher, SSHLauncher

    found = []
    for engine_set in list(getattr(cluster, "engines", {}).values()):
        if isinstance(engine_set, BatchSystemLauncher) and engine_set.job_id:
            env = {k: v for k, v in os.environ.items() if k.startswith(_BATCH_ENV)}
            argv = [*engine_set.delete_command, str(engine_set.job_id)]
            found.append([f"job {engine_set.job_id}", argv, env])
        for launcher in list(getattr(engine_set, "launchers", {}).values()):
            pid = getattr(launcher, "pid", 0)
            if isinstance(launcher, SSHLauncher) and launcher.location and pid and pid > 0:
                script = f"kill -TERM {pid}; sleep {grace:g}; kill -KILL {pid}"
                argv = [
                    *launcher.ssh_cmd,
                    *launcher.ssh_args,
                    *("-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-o", "BatchMode=yes"),
                    launcher.location,
                    shlex.join(["sh", "-c", script + " 2>/dev/null; true"]),
                ]
                found.append([f"{launcher.location} pid {pid}", argv, {}])
    return found


def batch_jobs(cluster: Any) -> list[str]:
    """The ids of the cluster's batch jobs of engines (Slurm), in the order submitted."""
    from ipyparallel.cluster.launcher import BatchSystemLauncher

    sets = list(getattr(cluster, "engines", {}).values())
    return [str(s.job_id) for s in sets if isinstance(s, BatchSystemLauncher) and s.job_id]


def job_states(jobs: list[str]) -> dict[str, str]:
    """{job id: 'pending: Resources' / 'running' / ...} as `squeue` tells them; a job squeue
    no longer lists is absent, and {} when squeue cannot be asked."""
    try:
        shown = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs), "-o", "%i|%T|%r"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in shown.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job:
            why = f": {reason}" if reason and reason != "None" else ""
            states[job] = f"{state.lower()}{why}"
    return states


class JobWatcher:
    """A cluster's batch jobs of engines (Slurm) watched while their engines are awaited:
    `poll` reads their queue state at most every JOB_POLL_S and tells `say` each change
    ("Slurm job 12: pending: Resources"); `summary` names the last states seen. Nothing to
    watch (no batch job) costs nothing."""

    def __init__(self, cluster: Any, say: Callable[[str], None] | None) -> None:
        self.jobs = batch_jobs(cluster)
        self.say = say
        self.states: dict[str, str] = {}
        self._asked = time.monotonic()

    def poll(self) -> None:
        if not self.jobs or time.monotonic() - self._asked <= JOB_POLL_S:
            return
        self._asked, seen = time.monotonic(), job_states(self.jobs)
        for job, state in seen.items():
            if self.say is not None and self.states.get(job) != state:
                self.say(f"Slurm job {job}: {state}")
        self.states.update(seen)

    def summary(self) -> str:
        return "; ".join(f"Slurm job {j}: {s}" for j, s in self.states.items())


def end_remote(entries: Iterable[list[Any]], *, timeout: float = 30.0) -> None:
    """Run the `enders` commands, in parallel; waits at most `timeout` seconds for them all."""
    threads = []
    for _, argv, env in entries:
        thread = threading.Thread(target=_run, args=(argv, env, timeout), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout)


def _run(argv: list[str], env: dict[str, str], timeout: float) -> None:
    try:
        subprocess.run(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        pass  # a host gone: its engines went with it, or their heartbeat ends them


def replacements(
    engines: Mapping[str, Any], addresses: Iterable[str], missing: int
) -> dict[str, Any] | None:
    """The `SSHEngineSetLauncher.engines` setting that starts `missing` engines where the pool
    lost them: `engines` is the user's setting ({'user@host:port': n or {'n': n, ...}}), and
    `addresses` the addresses of the engines still running. None when it cannot tell (a host
    that does not resolve, or counts that do not add up): ipyparallel's own order then."""
    alive = Counter(addresses)
    wanted: dict[str, Any] = {}
    for key, setting in engines.items():
        n = setting.get("n", 1) if isinstance(setting, Mapping) else int(setting)
        host = str(key).rsplit("@", 1)[-1].split(":", 1)[0]
        try:
            address = socket.gethostbyname(host)
        except OSError:
            return None
        lost = n - alive.pop(address, 0)
        if lost > 0:  # a copy: ipyparallel pops "n" from a host's own settings
            wanted[key] = {**setting, "n": lost} if isinstance(setting, Mapping) else lost
    counts = (w["n"] if isinstance(w, Mapping) else w for w in wanted.values())
    if sum(counts) != missing:
        return None
    return wanted
