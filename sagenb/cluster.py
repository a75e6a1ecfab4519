"""The warm engine pool: ipyparallel engines reused by every cell.

This module owns ipyparallel. A pool is started once (engines ready, torch imported) and every
`%%smp_train` reuses it, so a cell pays seconds only the first time. A rank is an engine's
position in the pool, never its id: ipyparallel does not reuse ids after a restart.

Engines are started by ipyparallel's own launchers: `local` (the default; everything on
127.0.0.1), or `mpi`, `slurm`, `ssh` for engines on other hosts, in which case (and only then)
the controller listens beyond loopback. A pool someone started with `ipcluster start` is
attached to by profile and cluster id, and left running when the notebook lets go of it.
A pool started here ends with the process that started it, even one killed by a signal
(sagenb/reaper.py).

Placement: ranks are numbered host by host (engines on one host get consecutive ranks), so a
pipeline replica's stages and a tensor-parallel group, which take consecutive ranks, share a
host when they fit on one, and only the data-parallel gradient all-reduce, once a step,
crosses hosts: the "keep a model replica together" placement that SageMaker calls cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ipyparallel as ipp
import psutil
from traitlets.config import Config

from sagenb import reaper
from sagenb.config import DEFAULT_ENGINES

__all__ = [
    "EnginePool",
    "EngineStatus",
    "LAUNCHERS",
    "current_pool",
    "ensure_pool",
    "start_pool",
    "attach_pool",
    "stop_pool",
    "restart_pool",
]

LOOPBACK = "127.0.0.1"
#: ipyparallel's engine launchers sagenb passes through; all but local may span hosts
LAUNCHERS = ("local", "mpi", "slurm", "ssh")


@dataclass(frozen=True)
class EngineStatus:
    rank: int
    engine_id: int
    pid: int
    host: str
    address: str
    threads: int
    device: str
    rss_mib: float


class EnginePool:
    """A running ipyparallel cluster (controller + engines): started here, or attached to."""

    def __init__(
        self,
        cluster: ipp.Cluster,
        client: ipp.Client,
        size: int,
        *,
        launcher: str = "local",
        options: dict[str, Any] | None = None,
        owned: bool = True,
    ) -> None:
        self.cluster, self.client, self.target_size = cluster, client, size
        self.launcher, self.options, self.owned = launcher, dict(options or {}), owned
        self.places: dict[int, tuple[str, str]] = {}  # engine id -> (host name, address)
        self.pids: dict[int, int] = {}  # engine id -> its process id (on its host)
        #: every local process the pool started: {pid: (start time, process group)}
        self.known: dict[int, tuple[float, int]] = {}

    @classmethod
    def start(
        cls,
        n: int,
        *,
        launcher: str = "local",
        options: dict[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> EnginePool:
        """Start a controller and n engines with ipyparallel's `launcher`; `options` are
        launcher settings as ipyparallel names them ("SlurmEngineSetLauncher.partition")."""
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
            log_level=logging.ERROR,
            config=_launcher_config(options or {}),
        )
        cluster.start_cluster_sync()
        try:
            _owner_only(cluster)
            client = cluster.connect_client_sync()
            client.wait_for_engines(n, timeout=timeout, interactive=False)
            pool = cls(cluster, client, n, launcher=launcher, options=options)
            pool._remember()
            pool.warm()
        except BaseException:
            cluster.stop_cluster_sync()
            raise
        return pool

    @classmethod
    def attach(
        cls, *, profile: str | None = None, cluster_id: str = "", timeout: float = 60.0
    ) -> EnginePool:
        """Connect to a pool started elsewhere (`ipcluster start --profile P --cluster-id C`)
        and use every engine it has; stopping lets go of it without stopping it. `profile` is
        a profile name, or a profile directory's path."""
        where: dict[str, Any] = {"cluster_id": cluster_id}
        if profile is not None and os.path.isdir(profile):
            where["profile_dir"] = profile
        else:
            where["profile"] = profile
        try:
            cluster = ipp.Cluster.from_file(**where)
        except FileNotFoundError:
            where = f"profile {profile or 'default'!r}, cluster id {cluster_id!r}"
            raise ValueError(f"no running ipyparallel cluster found for {where}") from None
        client = cluster.connect_client_sync()
        deadline = time.monotonic() + timeout
        while not client.ids and time.monotonic() < deadline:
            time.sleep(0.2)
        if not client.ids:
            client.close()
            raise ValueError("the attached cluster has no engines (start some with ipcluster)")
        pool = cls(cluster, client, len(client.ids), launcher="attached", owned=False)
        pool.warm()
        return pool

    @property
    def controller_host(self) -> str:
        """The controller's address as the engines reach it."""
        interface = self.client._config.get("interface", f"tcp://{LOOPBACK}")
        host = interface.split("://", 1)[-1]
        if host in ("*", "0.0.0.0", ""):
            host = self.client._config.get("location") or LOOPBACK
        return host

    @property
    def engine_ids(self) -> list[int]:
        """Engine ids in rank order: host by host (see Placement above), by id within a host."""
        ids = sorted(self.client.ids)
        first_on_host: dict[str, int] = {}
        for eid in ids:
            first_on_host.setdefault(self.address(eid), eid)
        return sorted(ids, key=lambda e: (first_on_host[self.address(e)], e))

    def address(self, engine_id: int) -> str:
        """The engine's address toward the controller ('' until it has been located)."""
        return self.places.get(engine_id, ("", ""))[1]

    @property
    def multi_host(self) -> bool:
        """Whether any engine reaches the controller other than through loopback."""
        return any(self.address(e) not in (LOOPBACK, "") for e in self.client.ids)

    def local_ranks(self, engines: int) -> list[tuple[int, int]]:
        """(position on its host, engines of the run on that host) for each of the first
        `engines` ranks."""
        addrs = [self.address(e) for e in self.engine_ids[:engines]]
        return [(addrs[:r].count(a), addrs.count(a)) for r, a in enumerate(addrs)]

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
        """Import torch, sagenb and DDP's lazy imports on the engines, all at once; note
        where each engine runs (host name, address toward the controller)."""
        from sagenb.engine.entry import warm
        from sagenb.engine.rendezvous import locate

        ids = sorted(self.client.ids) if engine_ids is None else engine_ids
        for ar in [self.client[e].apply_async(warm) for e in ids]:
            ar.get(timeout=120)
        where = {e: self.client[e].apply_async(locate, self.controller_host) for e in ids}
        pids = {e: self.client[e].apply_async(os.getpid) for e in ids}
        self.places.update({e: tuple(ar.get(timeout=60)) for e, ar in where.items()})
        self.pids.update({e: ar.get(timeout=60) for e, ar in pids.items()})

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
                    address=self.address(eid) or "?",
                    threads=info["threads"],
                    device=info["device"],
                    rss_mib=info["rss_mib"],
                )
            )
        return rows

    def interrupt(self, engine_ids: Sequence[int]) -> None:
        """SIGINT to engines: their Python code raises KeyboardInterrupt."""
        self.send_signal(engine_ids, signal.SIGINT)

    def send_signal(self, engine_ids: Sequence[int], sig: int) -> None:
        """Send `sig` to engines, without waiting for them (SIGUSR1: dump the running
        rank's stack, engine/tracing.py)."""
        for eid in engine_ids:
            self._signal(eid, sig)

    def _signal(self, engine_id: int, sig: int) -> None:
        """Send `sig` to an engine: by pid when it runs on this host (no round trip through a
        controller that may be dead), else through its nanny, without waiting for a reply."""
        pid = self.pids.get(engine_id)
        if pid is not None and self.places.get(engine_id, ("",))[0] == socket.gethostname():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # already gone
                pass
            return
        try:
            self.client.send_signal(sig, targets=[engine_id], block=False)
        except Exception:  # noqa: BLE001 - an engine that is already gone needs no signal
            pass

    def _remember(self) -> None:
        """Note the pool's processes (groups included: a killed controller's children leave
        this process's tree) and have the watcher end them if this process dies."""
        procs = _pool_processes()
        reaper.watch(procs)  # ended with this process, however it ends
        self.known.update(reaper.identities(procs))

    def controller_alive(self) -> bool:
        """Whether the controller process of a pool started here still runs (an attached
        pool's controller is someone else's: assumed alive)."""
        proc = getattr(getattr(self.cluster, "controller", None), "process", None)
        if not self.owned or proc is None:
            return True
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def kill(self, engine_ids: Sequence[int], *, timeout: float = 10.0) -> None:
        """SIGKILL engines and wait until the controller has dropped them.

        The last resort after a failure: a process's death closes every connection it held, so
        peers blocked in a collective with it fail within a fraction of a second. (Seen here:
        with DDP and rank 0 hosting the rendezvous store, a failed rank's destroy_process_group
        left its gloo connections open and its peer blocked until the process-group timeout.)
        """
        for eid in engine_ids:
            self._signal(eid, signal.SIGKILL)
        if not self.controller_alive():
            return  # nobody will drop them from client.ids
        deadline = time.monotonic() + timeout
        while set(engine_ids) & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def heal(self, *, timeout: float = 120.0) -> None:
        """Start engines until the pool is back to its size, and warm them. An attached pool
        is someone else's to repair: it goes on with the engines it has."""
        missing = self.target_size - self.size
        if missing <= 0 or not self.owned:
            self.target_size = min(self.target_size, self.size)
            return
        self.cluster.start_engines_sync(n=missing)
        self._remember()
        self.client.wait_for_engines(self.target_size, timeout=timeout, interactive=False)
        self.warm()

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop controller, nannies and engines, and wait until every one of them has exited
        (an attached pool is only let go of: whoever started it stops it)."""
        if not self.owned:
            self.client.close()
            return
        procs = _pool_processes()
        known = {**self.known, **reaper.identities(procs)}
        try:
            self.client.close()
            if self.controller_alive():  # ipyparallel's stop waits on its controller
                _bounded(self.cluster.stop_cluster_sync, timeout)
        finally:
            # whatever is left (an engine stuck in C++ ignores SIGTERM; a killed controller's
            # children), by pid and process group, bounded
            reaper.end(known)
            reaper.forget(procs)


def _bounded(fn: Callable[[], Any], timeout: float) -> None:
    """Call fn in a daemon thread and wait at most `timeout` s for it (a call that hangs on a
    dead peer is left behind, not waited for)."""
    worker = threading.Thread(target=fn, daemon=True, name="sagenb-bounded")
    worker.start()
    worker.join(timeout)


def _launcher_config(options: dict[str, Any]) -> Config:
    """{"SlurmEngineSetLauncher.partition": "gpu"} -> the traitlets Config ipyparallel reads."""
    config = Config()
    for key, value in options.items():
        section, _, trait = key.rpartition(".")
        if not section or not trait:
            raise ValueError(
                f"launcher option {key!r}: must be Class.trait, e.g. "
                "MPILauncher.mpi_args or SSHEngineSetLauncher.engines"
            )
        config[section][trait] = value
    return config


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


def start_pool(
    n: int = DEFAULT_ENGINES, *, launcher: str = "local", options: dict[str, Any] | None = None
) -> EnginePool:
    """Start a pool of n engines with ipyparallel's `launcher`, replacing any running one."""
    global _current
    stop_pool()
    started = time.perf_counter()
    _current = EnginePool.start(n, launcher=launcher, options=options)
    logging.getLogger(__name__).info(
        "pool of %d engines in %.1f s", n, time.perf_counter() - started
    )
    return _current


def attach_pool(*, profile: str | None = None, cluster_id: str = "") -> EnginePool:
    """Use a pool started outside the notebook (`ipcluster start`), replacing any running one
    (which keeps running if the pool cannot be found)."""
    global _current
    attached = EnginePool.attach(profile=profile, cluster_id=cluster_id)
    stop_pool()
    _current = attached
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
    """Fresh engines (and controller), n of them or as many as before, with the same launcher."""
    size = n if n is not None else (_current.size if _current is not None else DEFAULT_ENGINES)
    if _current is not None and not _current.owned:
        raise ValueError(
            "the pool was attached, not started here: restart it where it was started "
            "(ipcluster), or `%smp_cluster start` a pool of sagenb's own"
        )
    launcher = _current.launcher if _current is not None else "local"
    options = _current.options if _current is not None else None
    return start_pool(size, launcher=launcher, options=options)
