"""Where a run's ranks meet: the rendezvous store's address, and the interface to talk on.

On one machine the notebook hosts the store on 127.0.0.1 (run/training_run.py). With engines
on several hosts, the rank-0 engine hosts it on its own reachable address, on a port its host
picks, and every rank (and the notebook, for interrupts) connects to it there.

The store's listening socket is made here and handed to torch: torch's TCPStore server binds to
every interface whatever host name it is given (seen with `ss -ltn`), and a rendezvous store
should be reachable on the address it is meant for only. Likewise gloo (and nccl's bootstrap)
is told which interface to use, the one that reaches the store: by default gloo resolves the
host name, which on one machine is not loopback, and in a network namespace may not exist.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = [
    "bound_store",
    "reachable_address",
    "interface_of",
    "use_interface",
    "host_for_run",
    "locate",
    "wait_for_key",
]

_hosted: dist.TCPStore | None = None  # the store this engine hosts for the current run


def bound_store(addr: str, world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on `addr` only, on `port` (0: one the OS picks)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
    )


def reachable_address(peer: str) -> str:
    """This host's address on the route to `peer` (no packet is sent: a UDP 'connect' only
    chooses the route)."""
    if ipaddress.ip_address(socket.gethostbyname(peer)).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(peer), 9))
        return probe.getsockname()[0]


def interface_of(addr: str) -> str | None:
    """The name of the network interface that holds `addr` (lo for 127.0.0.1)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    return None


def use_interface(store_addr: str) -> str | None:
    """Point gloo and nccl at the interface that reaches the store; returns its name."""
    name = interface_of(reachable_address(store_addr))
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        os.environ["NCCL_SOCKET_IFNAME"] = name
    return name


def host_for_run(controller_host: str, world_size: int, timeout_s: float) -> tuple[str, int]:
    """Run on the rank-0 engine of a multi-host pool: host this run's store on the address
    that reaches the controller (so the other hosts reach it too); returns (address, port)."""
    global _hosted
    _hosted = None  # the previous run's store: its port is released
    addr = reachable_address(controller_host)
    _hosted = bound_store(addr, world_size, timeout_s)
    return addr, _hosted.port


def locate(controller_host: str) -> tuple[str, str]:
    """(host name, address toward the controller) of this engine: its place in the pool."""
    return socket.gethostname(), reachable_address(controller_host)


#: one call's wait in `wait_for_key`; waiting again after it costs nothing (a run may last days)
_WAIT = timedelta(hours=1)


def wait_for_key(store: dist.Store, key: str) -> bool:
    """Block until `key` is set in `store`: True then, False when the store is gone (the run
    is over). For the ranks' listening threads (stopping.py, tracing.py), each on
    a connection of its own: a store client is not shared between threads."""
    while True:
        try:
            store.wait([key], _WAIT)
            return True
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                return False  # not a timeout: the store is gone
