"""How a pool begins: ours started (what dead pools left tidied, the controller and its engines
launched, the engines' registration awaited), or someone else's attached to, and the engines a
pool replaces launched. `EnginePool.start` (cluster.py) calls these in order, then warms the
pool; it and its stop share `stop_cluster`, ipyparallel's stop bounded.

Launch: all n engines are launched at once (ipyparallel's engine set launchers start them
without waiting on each other), once the controller has written its connection file; the
controller listens beyond loopback only when engines may run on other hosts (launchers.py).

Registration: each engine's warm-up imports (torch, DDP's torch._dynamo: the longest part of a
start) start as soon as it has registered rather than when the last one has. A batch job's
state (Slurm's squeue) is watched meanwhile and said when it changes (remote.JobWatcher), and
named if the wait times out. Setting a background start's `cancel` raises StartCancelled at the
next check (every 50 ms).

Stale files: ipyparallel writes each cluster's record (`security/cluster-<id>.json`), its
connection files (`security/ipcontroller-<id>-client.json`, `-engine.json`) and its logs
(`log/ipcontroller-<id>-*`, `log/ipengine-<id>-*`, `log/engines<id>.json`) in the profile
directory, and removes them when the cluster is stopped. A pool ended any other way (its kernel
killed, the watcher ending it, reaper.py) leaves them, and they piled up: dozens of
`cluster-*.json` after a day of tests. ipyparallel's own `clean_cluster_files` removes every log
and connection file of the profile, running clusters' included; `remove_stale` removes only
those of clusters whose controller process no longer runs.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
import psutil

from sagenb.pool import remote, waits
from sagenb.pool.ipyparallel_private import client_config, iopub_guarded
from sagenb.pool.launchers import (
    CONTROLLER_HEARTBEAT,
    LAUNCHERS,
    LOOPBACK,
    controller_location,
    launcher_config,
)

__all__ = [
    "StartCancelled",
    "attach",
    "check_cancel",
    "connect",
    "controller_host",
    "launch",
    "owner_only",
    "register",
    "remove_batch_script",
    "remove_stale",
    "say_busy",
    "start_engines",
    "stop_cluster",
]

#: how often the registration wait looks at the engines again
REGISTER_POLL_S = 0.05
#: how often attaching looks for the attached cluster's engines
ATTACH_POLL_S = 0.2
#: how long an engine's warm-up may take (EnginePool.warm), and the controller a queue query
WARM_S = 120.0
BUSY_QUERY_S = 5.0


class StartCancelled(Exception):
    """A background pool start was cancelled (another pool was asked for, or none)."""


def check_cancel(cancel: threading.Event | None) -> None:
    """Raise StartCancelled once a background start's `cancel` is set."""
    if cancel is not None and cancel.is_set():
        raise StartCancelled("the background pool start was cancelled")


def launch(n: int, *, launcher: str, options: dict[str, Any]) -> ipp.Cluster:
    """A controller and n engines launched with ipyparallel's `launcher` (settings as
    ipyparallel names them, "SlurmEngineSetLauncher.partition"), not yet registered. A launch
    that fails leaves no controller behind."""
    if n < 1:
        raise ValueError(f"an engine pool needs at least 1 engine, got {n}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: must be one of {', '.join(LAUNCHERS)}")
    # ERROR: at stop, ipyparallel logs each engine's whole output as a warning (engines
    # stopped by SIGTERM exit with code 1), which buried the cell's own output.
    cluster = ipp.Cluster(
        n=n,
        engine_launcher_class=launcher,
        # beyond loopback only when engines may run on other hosts
        controller_ip=LOOPBACK if launcher == "local" else "*",
        controller_location=controller_location(launcher, options),
        controller_args=CONTROLLER_HEARTBEAT,
        log_level=logging.ERROR,
        config=launcher_config(launcher, options),
    )
    if launcher == "slurm" and "SlurmEngineSetLauncher.batch_file_name" not in options:
        # ipyparallel writes the job's script into the notebook's folder (its work_dir
        # '.'); beside the job's output in the profile's log folder instead
        logs = os.path.join(cluster.profile_dir, "log")
        os.makedirs(logs, exist_ok=True)
        name = os.path.join(logs, f"ipengine-{cluster.cluster_id}.sbatch")
        cluster.config.SlurmEngineSetLauncher.batch_file_name = name  # removed at stop
    try:  # what pools ended by a kill left in the profile
        remove_stale(cluster.profile_dir)
    except Exception:  # noqa: BLE001 - tidying never stops a start
        pass
    try:
        cluster.start_cluster_sync()
    except BaseException:  # an engine that could not be launched (ssh refused, say)
        stop_cluster(cluster, 30)  # leaves no controller behind
        raise
    return cluster


def connect(cluster: ipp.Cluster) -> ipp.Client:
    """The pool's client, whose IOPub handler survives a message it cannot handle: an engine's
    widget in an IPython without a kernel stopped every later message of the run, its metrics
    among them (ipyparallel_private.iopub_guarded; the engines draw no widgets during a run,
    engine/wire/output.py, so this is the guard for the one that slips through)."""
    with iopub_guarded(ipp.Client):
        return cluster.connect_client_sync()


def attach(profile: str | None, cluster_id: str, timeout: float) -> tuple[ipp.Cluster, ipp.Client]:
    """The cluster someone started (`ipcluster start --profile P --cluster-id C`) and a
    client of it that sees at least one engine within `timeout` s. `profile` is a profile
    name, or a profile directory's path."""
    where: dict[str, Any] = {"cluster_id": cluster_id}
    if profile is not None and os.path.isdir(profile):
        where["profile_dir"] = profile
    else:
        where["profile"] = profile
    try:
        cluster = ipp.Cluster.from_file(**where)
    except FileNotFoundError:
        named = f"profile {profile or 'default'!r}, cluster id {cluster_id!r}"
        raise ValueError(f"no running ipyparallel cluster found for {named}") from None
    client = connect(cluster)
    deadline = time.monotonic() + timeout
    while not client.ids and time.monotonic() < deadline:
        time.sleep(ATTACH_POLL_S)
    if not client.ids:
        client.close()
        raise ValueError("the attached cluster has no engines (start some with ipcluster)")
    return cluster, client


def say_busy(client: ipp.Client) -> None:
    """One line under the cell when an attached pool's engines run or queue other clients'
    tasks: the warm-up's tasks wait behind them (attaching to a busy pool blocked about 45 s
    without a word)."""
    try:
        done, status = waits.bounded(client.queue_status, BUSY_QUERY_S)
    except Exception:  # noqa: BLE001 - a note only: the warm-up says what fails
        return
    busy = {
        eid: row["queue"] + row["tasks"]
        for eid, row in (status or {}).items()
        if isinstance(row, dict) and row.get("queue", 0) + row.get("tasks", 0)
    }
    if done and busy:
        tasks = sum(busy.values())
        sys.stderr.write(
            f"sagenb: the attached pool's engine(s) {', '.join(map(str, sorted(busy)))} run or "
            f"queue {tasks} task(s) of other clients; warming them up waits for those (up to "
            f"{WARM_S:.0f} s; interrupt to give up)\n"
        )


def start_engines(
    cluster: ipp.Cluster,
    missing: int,
    launcher: str,
    options: dict[str, Any],
    *,
    alive: list[str],
) -> None:
    """Launch `missing` more engines for a running cluster (`EnginePool.heal`); over ssh, on
    the hosts that lost them (`alive`: the addresses of the engines that remain), not on the
    first host (remote.replacements). Their registration is the caller's to await."""
    hosts = options.get("SSHEngineSetLauncher.engines")
    where = None
    if launcher == "ssh" and hosts:  # where they were lost, not on the first host
        where = remote.replacements(hosts, alive, missing)
    if where is not None:
        cluster.config.SSHEngineSetLauncher.engines = where
    try:
        cluster.start_engines_sync(n=missing)
    finally:
        if where is not None:  # the next start (a restart) takes the user's setting
            cluster.config.SSHEngineSetLauncher.engines = hosts


def controller_host(cluster: ipp.Cluster, client: ipp.Client) -> str:
    """The controller's address as the engines reach it: the location it was given or told
    them (this process's client may reach it through loopback)."""
    if getattr(cluster, "controller_location", ""):
        return str(cluster.controller_location)
    config = _engine_connection(cluster) or client_config(client)
    interface = config.get("interface", f"tcp://{LOOPBACK}")
    host = interface.split("://", 1)[-1]
    if host in ("*", "0.0.0.0", ""):
        host = config.get("location") or LOOPBACK
    return host


def _engine_connection(cluster: ipp.Cluster) -> dict[str, Any] | None:
    """What the controller told its engines (the connection file it wrote for them), if it
    can be read here."""
    name = f"ipcontroller-{cluster.cluster_id}-engine.json" if cluster.cluster_id else ""
    path = os.path.join(cluster.profile_dir or "", "security", name or "ipcontroller-engine.json")
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None


def remove_batch_script(cluster: ipp.Cluster, launcher: str) -> None:
    """The Slurm job's script `launch` placed in the profile's log folder, removed at stop
    (one the user named stays theirs)."""
    if launcher != "slurm":
        return
    script = cluster.config.SlurmEngineSetLauncher.get("batch_file_name", "")
    if os.path.isabs(script) and script.endswith(".sbatch"):
        try:
            os.remove(script)
        except OSError:
            pass


def owner_only(cluster: ipp.Cluster) -> None:
    """The controller's connection files are written 0600; the cluster file too, here."""
    if cluster.cluster_file and os.path.exists(cluster.cluster_file):
        os.chmod(cluster.cluster_file, 0o600)


def register(
    client: ipp.Client,
    cluster: ipp.Cluster,
    n: int,
    timeout: float,
    *,
    warm: Callable[[], None],
    check: Callable[[], None],
    say: Callable[[str], None] | None = None,
) -> None:
    """Wait until n engines have registered with `client`, sending each `warm` as soon as it
    has (its caller waits for it and checks it); `check()` between polls raises to end the
    wait (a dead controller, a cancel); `say` is told a batch job's state when it changes."""
    waiting = client.wait_for_engines(n, timeout=timeout, block=False, interactive=False)
    warming: set[int] = set()
    jobs = remote.JobWatcher(cluster, say)
    while not waiting.done():
        for eid in set(client.ids) - warming:
            client[eid].apply_async(warm)
            warming.add(eid)
        check()
        jobs.poll()
        time.sleep(REGISTER_POLL_S)
    try:
        waiting.result(timeout=0)  # done: its value, or its TimeoutError
    except TimeoutError:
        queued = jobs.summary()
        raise TimeoutError(
            f"{len(client.ids)} of {n} engines registered within {timeout:g} s"
            + (f" ({queued})" if queued else "")
            + ": allow longer with `%smp_cluster start --timeout SECONDS`; what was "
            "started is stopped" + (" and the job cancelled" if jobs.jobs else "")
        ) from None


def stop_cluster(cluster: ipp.Cluster, timeout: float) -> bool:
    """ipyparallel's stop, waited for at most `timeout` s (it waits on its controller, which
    may be dead); whether it stopped. A stop that failed or hung leaves the processes to the
    caller's ending by pid."""
    try:
        return waits.bounded(cluster.stop_cluster_sync, timeout)[0]
    except Exception:  # noqa: BLE001 - ended by pid instead, as a hung stop is
        return False


def remove_stale(profile_dir: str) -> list[str]:
    """Remove the files of every cluster of `profile_dir` whose controller has exited; the
    cluster ids removed."""
    removed = []
    for record in glob.glob(os.path.join(profile_dir, "security", "cluster-*.json")):
        cluster_id = os.path.basename(record)[len("cluster-") : -len(".json")]
        pid = _controller_pid(record)
        if pid is None or psutil.pid_exists(pid):
            continue  # running (or a file being written): not ours to judge
        for path in _files_of(profile_dir, cluster_id) + [record]:
            try:
                os.remove(path)
            except OSError:
                pass
        removed.append(cluster_id)
    return removed


def _controller_pid(record: str) -> int | None:
    try:
        with open(record) as f:
            pid = json.load(f)["controller"]["state"]["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) else None


def _files_of(profile_dir: str, cluster_id: str) -> list[str]:
    patterns = [
        ("security", f"ipcontroller-{cluster_id}-*.json"),
        ("log", f"ipcontroller-{cluster_id}-*.log"),
        ("log", f"ipengine-{cluster_id}-*.log"),
        ("log", f"engines{cluster_id}.json"),
    ]
    return [
        p for folder, name in patterns for p in glob.glob(os.path.join(profile_dir, folder, name))
    ]
