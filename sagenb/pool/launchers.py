"""Settings for ipyparallel's engine launchers: the ones a user passes through
(`--launcher-option CLASS.TRAIT=VALUE`) and the defaults sagenb adds for each launcher.

`local` keeps everything on 127.0.0.1. `mpi`, `slurm` and `ssh` may put engines on other
hosts, so the controller listens beyond loopback and must tell the engines an address they can
reach: ipyparallel tells them this machine's host name, which many machines (Debian's
/etc/hosts among them) resolve to a loopback address, where an engine on another host finds
nothing and the pool start waits out its timeout. Then the controller's location is this
machine's address on the route to the engines' network: for `ssh`, to the first engine host
named; for `slurm`, to the Slurm controller (`scontrol show config`'s SlurmctldHost), unless
the user names one (`Cluster.controller_location`). The engines on the other hosts run the same
Python as the notebook (same path: `SSHEngineSetLauncher.remote_python` says otherwise).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import sys
from typing import Any

from traitlets.config import Config

__all__ = [
    "LAUNCHERS",
    "LOOPBACK",
    "HEARTBEAT_MS",
    "CONTROLLER_HEARTBEAT",
    "ENGINE_HEARTBEAT",
    "launcher_config",
    "controller_location",
    "ssh_hosts",
]

LOOPBACK = "127.0.0.1"
#: ipyparallel's engine launchers sagenb passes through; all but local may span hosts
LAUNCHERS = ("local", "mpi", "slurm", "ssh")
#: ms between the controller's heartbeat pings. An engine counts as registered only once the
#: controller has seen its heart beat, at a ping (ipyparallel's hub.py, handle_new_heart), so
#: the default 3000 ms added up to 3 s to every pool start (the registration times with
#: either: benchmarks/results/measured_in_code.md)
HEARTBEAT_MS = 500
#: pings missed before an engine counts as dead, keeping ipyparallel's default tolerance
#: (10 x 3000 ms = 30 s at the controller; 50 x (3000 + 500) ms = 175 s at the engine)
CONTROLLER_HEARTBEAT = [
    f"--HeartMonitor.period={HEARTBEAT_MS}",
    "--HeartMonitor.max_heartmonitor_misses=60",
]
ENGINE_HEARTBEAT = ["--IPEngine.max_heartbeat_misses=175"]


def launcher_config(launcher: str, options: dict[str, Any]) -> Config:
    """{"SlurmEngineSetLauncher.partition": "gpu"} -> the traitlets Config ipyparallel reads,
    with sagenb's defaults where the options say nothing: engines get the heartbeat tolerance
    that goes with HEARTBEAT_MS; ssh engines run this Python."""
    config = Config()
    config.EngineLauncher.engine_args = list(ENGINE_HEARTBEAT)
    if launcher == "ssh":
        config.SSHEngineSetLauncher.remote_python = sys.executable
    for key, value in options.items():
        section, _, trait = key.rpartition(".")
        if not section or not trait:
            raise ValueError(
                f"launcher option {key!r}: must be Class.trait, e.g. "
                "MPILauncher.mpi_args or SSHEngineSetLauncher.engines"
            )
        config[section][trait] = value
    return config


def ssh_hosts(options: dict[str, Any]) -> list[str]:
    """The host names of `SSHEngineSetLauncher.engines` ({'user@host:port': n, ...}), bare."""
    engines = options.get("SSHEngineSetLauncher.engines") or {}
    hosts = []
    for key in engines:
        host = str(key).rsplit("@", 1)[-1]
        hosts.append(host.split(":", 1)[0])
    return hosts


def controller_location(launcher: str, options: dict[str, Any]) -> str:
    """The address the controller tells the engines ('' leaves ipyparallel's choice, this
    machine's host name): when the host name would send the engines to a loopback address,
    the address on the route to the first ssh engine host, or to the Slurm controller."""
    given = options.get("Cluster.controller_location")
    if given:
        return str(given)
    if launcher not in ("ssh", "slurm") or not _resolves_to_loopback(socket.gethostname()):
        return ""
    hosts = ssh_hosts(options) if launcher == "ssh" else _slurm_controller()
    if not hosts:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(hosts[0]), 22))  # chooses a route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return ""  # unresolvable host: ssh itself says so when the engines start


def _slurm_controller() -> list[str]:
    """The Slurm controller's address (or name), as `scontrol show config` gives it:
    'SlurmctldHost[0] = name(address)'; [] when scontrol cannot tell."""
    try:
        shown = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", shown, re.M)
    if not found:
        return []
    address = found.group(2) or found.group(1)
    if address.startswith("127."):
        return []
    return [address]


def _resolves_to_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except OSError:
        return True
