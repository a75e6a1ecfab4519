"""Engines on other hosts, started through ssh: how to end them from here, and where to start
their replacements.

ipyparallel's SSH launcher starts each engine with `nohup ... &` in an ssh session that then
ends (its launcher.py, `ShellCommandSend.cmd_start`), so nothing on this machine is the
engine's parent: a kernel killed by SIGKILL ends its controller through the watcher
(reaper.py), but the engines on the other hosts would run on until they miss the controller's
heartbeat for minutes (launchers.ENGINE_HEARTBEAT). So the watcher is also told each ssh
engine's host and remote pid, and ends them over ssh, SIGTERM then SIGKILL, one ssh session per
host, each bounded: a host that no longer answers holds the watcher for at most `timeout`.

A replacement engine (`EnginePool.heal`) goes to the host that lost one: ipyparallel's
`SSHEngineSetLauncher.start(n)` fills its `engines` hosts in order, which would put every
replacement on the first host and leave the layout (2 x 2 becomes 3 + 1) unlike the one the
user asked for.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ssh_engines", "end_remote", "replacements"]

#: seconds ssh waits for a host that does not answer, when ending its engines
CONNECT_TIMEOUT_S = 10


def ssh_engines(cluster: Any) -> list[list[Any]]:
    """[[location, ssh command with its arguments, remote pid], ...] of the cluster's engines
    started through ssh (none for other launchers)."""
    from ipyparallel.cluster.launcher import SSHLauncher

    found = []
    for engine_set in list(getattr(cluster, "engines", {}).values()):
        for launcher in list(getattr(engine_set, "launchers", {}).values()):
            pid = getattr(launcher, "pid", 0)
            if isinstance(launcher, SSHLauncher) and launcher.location and pid and pid > 0:
                command = [*launcher.ssh_cmd, *launcher.ssh_args]
                found.append([launcher.location, command, int(pid)])
    return found


def end_remote(entries: Iterable[list[Any]], *, grace: float, timeout: float = 30.0) -> None:
    """End the remote pids of `entries` (ssh_engines' rows): on each host, in one ssh session
    and in parallel across hosts, SIGTERM, then SIGKILL `grace` seconds later to whatever is
    left; waits at most `timeout` seconds for all hosts together."""
    by_host: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for location, command, pid in entries:
        by_host.setdefault((location, tuple(command)), []).append(int(pid))
    threads = []
    for (location, command), pids in by_host.items():
        listed = " ".join(str(p) for p in sorted(set(pids)))
        script = (
            f"kill -TERM {listed} 2>/dev/null; sleep {grace:g}; kill -KILL {listed} 2>/dev/null; "
            "true"
        )
        argv = [
            *command,
            "-o",
            f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o",
            "BatchMode=yes",
            location,
            shlex.join(["sh", "-c", script]),
        ]
        thread = threading.Thread(target=_run, args=(argv, timeout), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout)


def _run(argv: list[str], timeout: float) -> None:
    try:
        subprocess.run(
            argv,
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
