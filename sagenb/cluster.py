"""The warm engine pool: local ipyparallel engines reused by every cell.

This module owns ipyparallel. A pool is started once (engines ready, torch imported) and every
`%%smp_train` reuses it, so a cell pays seconds only the first time. A rank is an engine's
position in the pool, never its id: ipyparallel does not reuse ids after a restart.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ipyparallel as ipp
import psutil

__all__ = [
    "EnginePool",
    "EngineStatus",
    "current_pool",
    "ensure_pool",
    "start_pool",
    "stop_pool",
    "restart_pool",
]

LOOPBACK = "127.0.0.1"
DEFAULT_ENGINES = 2


@dataclass(frozen=True)
class EngineStatus:
    rank: int
    engine_id: int
    pid: int
    host: str
    threads: int
    device: str
    rss_mib: float


class EnginePool:
    """A running ipyparallel cluster (controller + engines) bound to 127.0.0.1."""

    def __init__(self, cluster: ipp.Cluster, client: ipp.Client, size: int) -> None:
        self.cluster, self.client, self.target_size = cluster, client, size

    @classmethod
    def start(cls, n: int, *, timeout: float = 120.0) -> EnginePool:
        if n < 1:
            raise ValueError(f"an engine pool needs at least 1 engine, got {n}")
        # ERROR: at stop, ipyparallel logs each engine's whole output as a warning (engines
        # stopped by SIGTERM exit with code 1), which buried the cell's own output.
        cluster = ipp.Cluster(n=n, controller_ip=LOOPBACK, log_level=logging.ERROR)
        cluster.start_cluster_sync()
        try:
            _owner_only(cluster)
            client = cluster.connect_client_sync()
            client.wait_for_engines(n, timeout=timeout, interactive=False)
            pool = cls(cluster, client, n)
            pool.warm()
        except BaseException:
            cluster.stop_cluster_sync()
            raise
        return pool

    @property
    def engine_ids(self) -> list[int]:
        return sorted(self.client.ids)

    @property
    def size(self) -> int:
        return len(self.client.ids)

    def submit(self, fn: Callable[..., Any], per_rank_args: Sequence[tuple]) -> list[Any]:
        """Run fn(*args) for rank r on the r-th engine, each as its own AsyncResult."""
        ids = self.engine_ids
        if len(per_rank_args) > len(ids):
            raise ValueError(f"{len(per_rank_args)} ranks but the pool has {len(ids)} engines")
        return [self.client[ids[r]].apply_async(fn, *args) for r, args in enumerate(per_rank_args)]

    def warm(self, engine_ids: Sequence[int] | None = None) -> None:
        """Import torch, sagenb and DDP's lazy imports on the engines, all at once."""
        from sagenb.engine.entry import warm

        ids = self.engine_ids if engine_ids is None else engine_ids
        for ar in [self.client[e].apply_async(warm) for e in ids]:
            ar.get(timeout=120)

    def status(self) -> list[EngineStatus]:
        from sagenb.engine.entry import probe

        ids = self.engine_ids
        results = [self.client[e].apply_async(probe) for e in ids]
        rows = []
        for rank, (eid, ar) in enumerate(zip(ids, results)):
            info = ar.get(timeout=60)
            rows.append(
                EngineStatus(
                    rank=rank,
                    engine_id=eid,
                    pid=info["pid"],
                    host=info["host"],
                    threads=info["threads"],
                    device=info["device"],
                    rss_mib=info["rss_mib"],
                )
            )
        return rows

    def interrupt(self, engine_ids: Sequence[int]) -> None:
        """SIGINT to engines (through their nannies): their Python code raises KeyboardInterrupt."""
        for eid in engine_ids:
            try:
                self.client.send_signal(signal.SIGINT, targets=[eid], block=True)
            except Exception:  # noqa: BLE001 - an engine that is already gone needs no signal
                pass

    def kill(self, engine_ids: Sequence[int], *, timeout: float = 10.0) -> None:
        """SIGKILL engines and wait until the controller has dropped them.

        The last resort after a failure: a process's death closes every connection it held, so
        peers blocked in a collective with it fail within a fraction of a second. (Seen here:
        with DDP and rank 0 hosting the rendezvous store, a failed rank's destroy_process_group
        left its gloo connections open and its peer blocked until the process-group timeout.)
        """
        for eid in engine_ids:
            try:
                self.client.send_signal(signal.SIGKILL, targets=[eid], block=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        deadline = time.monotonic() + timeout
        while set(engine_ids) & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def heal(self, *, timeout: float = 120.0) -> None:
        """Start engines until the pool is back to its size, and warm them."""
        missing = self.target_size - self.size
        if missing <= 0:
            return
        self.cluster.start_engines_sync(n=missing)
        self.client.wait_for_engines(self.target_size, timeout=timeout, interactive=False)
        self.warm()

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop controller, nannies and engines, and wait until every one of them has exited."""
        procs = _pool_processes()
        try:
            self.client.close()
        finally:
            self.cluster.stop_cluster_sync()
            _, alive = psutil.wait_procs(procs, timeout=timeout)
            for proc in alive:  # an engine stuck in C++ ignores SIGTERM
                proc.kill()
            psutil.wait_procs(alive, timeout=timeout)


def _owner_only(cluster: ipp.Cluster) -> None:
    """The controller's connection files are written 0600; the cluster file too, here."""
    if cluster.cluster_file and os.path.exists(cluster.cluster_file):
        os.chmod(cluster.cluster_file, 0o600)


def _pool_processes() -> list[psutil.Process]:
    """This process's ipyparallel children: controller, nannies, engines."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "ipyparallel" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


_current: EnginePool | None = None


def current_pool() -> EnginePool | None:
    return _current


def start_pool(n: int = DEFAULT_ENGINES) -> EnginePool:
    """Start a pool of n engines, replacing any running one."""
    global _current
    stop_pool()
    started = time.perf_counter()
    _current = EnginePool.start(n)
    logging.getLogger(__name__).info(
        "pool of %d engines in %.1f s", n, time.perf_counter() - started
    )
    return _current


def ensure_pool(n: int = DEFAULT_ENGINES) -> EnginePool:
    """The running pool, or a new one of n engines when none runs."""
    return _current if _current is not None else start_pool(n)


def stop_pool() -> bool:
    """Stop the running pool; False when none ran."""
    global _current
    if _current is None:
        return False
    pool, _current = _current, None
    pool.stop()
    return True


def restart_pool(n: int | None = None) -> EnginePool:
    """Fresh engines (and controller), n of them or as many as before."""
    size = n if n is not None else (_current.size if _current is not None else DEFAULT_ENGINES)
    return start_pool(size)
