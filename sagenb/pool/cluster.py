"""The warm engine pool: ipyparallel engines reused by every cell.

This module owns ipyparallel. A pool is started once (engines ready, torch imported) and every
`%%smp_train` reuses it, so a cell pays seconds only the first time. A rank is an engine's
position in the pool, never its id: ipyparallel does not reuse ids after a restart.

Engines are started by ipyparallel's own launchers: `local` (the default; everything on
127.0.0.1), or `mpi`, `slurm`, `ssh` for engines on other hosts (startup.py: the launch and the
engines' registration). A pool someone started with `ipcluster start` is attached to by profile
and cluster id, and left running when the notebook lets go of it. A pool started here ends
with the process that started it, even one killed by a signal (reaper.py).

Cold start: `%load_ext sagenb` starts the default pool in a background thread (`prewarm`; off
with SAGENB_PREWARM=0; prewarm.py); the first run that needs a pool waits for that one
(`ensure_pool`), and starting, stopping or attaching another pool cancels it first, so two
pools of ours never run at once. Where a start's seconds go: benchmarks/results/first_step.md.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ipyparallel as ipp
import psutil

from sagenb.config.options import DEFAULT_ENGINES
from sagenb.pool import reaper, remote, startup, waits
from sagenb.pool.launchers import LAUNCHERS, LOOPBACK
from sagenb.pool.prewarm import BackgroundStart, prewarm_wanted
from sagenb.pool.startup import StartCancelled

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
    "prewarm",
    "prewarm_wanted",
    "StartCancelled",
]


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
    #: what the engine keeps of a run for --continue: {"cell", "step", "mib"}, or None
    kept: dict[str, Any] | None = None


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
        #: stop() was called (`%smp_cluster stop` or `restart`, maybe from another thread)
        self.stopped = False
        self.closed = False  # stop() has run: a second call does nothing
        #: every rank task runs of this process submitted (their msg_ids): one still pending
        #: when a later run takes the pool's lock is an orphan (pool/orphans.py)
        self.run_tasks: set[str] = set()

    @classmethod
    def start(
        cls,
        n: int,
        *,
        launcher: str = "local",
        options: dict[str, Any] | None = None,
        timeout: float = 120.0,
        cancel: threading.Event | None = None,
        say: Callable[[str], None] | None = None,
    ) -> EnginePool:
        """Start a controller and n engines with ipyparallel's `launcher`; `options` are
        launcher settings as ipyparallel names them ("SlurmEngineSetLauncher.partition").
        `timeout`: seconds for the engines to register; `say` is told what a batch job of
        engines waits for while it waits ("Slurm job 12: pending: Resources").
        Setting `cancel` (a background start) stops what was started and raises StartCancelled
        at the next check (every 50 ms while waiting on the engines). pool/startup.py says
        how each stage goes."""
        cluster = startup.launch(n, launcher=launcher, options=options or {})
        pool = None
        try:
            startup.owner_only(cluster)
            client = startup.connect(cluster)
            pool = cls(cluster, client, n, launcher=launcher, options=options)
            pool._remember()  # controller and engines, watched from their launch on
            warm, _ = _engine_side()
            check = pool._check(cancel)
            startup.register(client, cluster, n, timeout, warm=warm, check=check, say=say)
            pool._remember()  # and the nanny each engine started as it registered
            pool.warm(cancel=cancel)
        except BaseException:
            if pool is not None:
                pool.stop()  # ends and forgets every process it noted
            else:
                startup.stop_cluster(cluster, 30)
            raise
        return pool

    @classmethod
    def attach(
        cls, *, profile: str | None = None, cluster_id: str = "", timeout: float = 60.0
    ) -> EnginePool:
        """Connect to a pool started elsewhere (`ipcluster start --profile P --cluster-id C`)
        and use every engine it has; stopping lets go of it without stopping it. `profile` is
        a profile name, or a profile directory's path."""
        cluster, client = startup.attach(profile, cluster_id, timeout)
        pool = cls(cluster, client, len(client.ids), launcher="attached", owned=False)
        startup.say_busy(client)  # the warm-up waits behind what they run: said, not silent
        pool.warm()
        return pool

    @property
    def controller_host(self) -> str:
        """The controller's address as the engines reach it: the location it was given or told
        them (this process's client may reach it through loopback)."""
        return startup.controller_host(self.cluster, self.client)

    @property
    def run_lock_path(self) -> str:
        """The file whose lock a run holds on this pool (run_lock.py): beside the cluster file
        that every process attaching to the pool reads, so all of them find the same one."""
        security = os.path.join(self.cluster.profile_dir, "security")
        return os.path.join(security, f"sagenb-run-{self.cluster.cluster_id or 'default'}.lock")

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
        """Run fn(*args) for rank r on the r-th engine, each as its own AsyncResult (a run's
        rank tasks: noted in `run_tasks`)."""
        ids = self.engine_ids
        if len(per_rank_args) > len(ids):
            raise ValueError(f"{len(per_rank_args)} ranks but the pool has {len(ids)} engines")
        ars = [self.client[ids[r]].apply_async(fn, *args) for r, args in enumerate(per_rank_args)]
        self.run_tasks.update(ar.msg_ids[0] for ar in ars)
        return ars

    @property
    def session_id(self) -> str:
        """This process's client session with the controller: every task it submits carries
        it (pool/occupancy.py tells whose a task is by it)."""
        return str(self.client.session.session)

    def warm(
        self, engine_ids: Sequence[int] | None = None, *, cancel: threading.Event | None = None
    ) -> None:
        """Import torch, sagenb and DDP's lazy imports on the engines, all at once; note
        where each engine runs (host name, address toward the controller)."""
        warm, locate = _engine_side()
        ids = sorted(self.client.ids) if engine_ids is None else engine_ids
        for ar in [self.client[e].apply_async(warm) for e in ids]:
            self.result(ar, startup.WARM_S, cancel=cancel)
        where = {e: self.client[e].apply_async(locate, self.controller_host) for e in ids}
        pids = {e: self.client[e].apply_async(os.getpid) for e in ids}
        self.places.update(
            {e: tuple(self.result(ar, 60, cancel=cancel)) for e, ar in where.items()}
        )
        self.pids.update({e: self.result(ar, 60, cancel=cancel) for e, ar in pids.items()})

    def result(self, ar: Any, timeout: float, *, cancel: threading.Event | None = None) -> Any:
        """A task's value within `timeout` s (TimeoutError after that); PoolDiedError within
        a fraction of a second once the controller is gone, StartCancelled once `cancel` is
        set (pool/waits.py)."""

        return waits.result(ar, timeout, check=self._check(cancel))

    def _check(self, cancel: threading.Event | None) -> Callable[[], None]:
        """What a wait on this pool checks between its slices: the cancel of a background
        start, then the controller (pool/waits.py)."""

        def check() -> None:
            startup.check_cancel(cancel)
            self.check_alive()

        return check

    def check_alive(self) -> None:
        """Raise PoolDiedError when the controller is gone, after closing the pool (its
        engines killed by pid, its processes ended) so the next run starts a new one; every
        wait on the pool calls it between its slices (pool/waits.py)."""
        if self.controller_alive():
            return
        if self.stopped:
            raise waits.PoolDiedError(
                "the engine pool was stopped or restarted (%smp_cluster stop or restart, or "
                "sagenb.stop_pool/restart_pool from another thread), so nothing runs on its "
                "engines any more. Run the cell again: it trains on the running pool, or "
                "starts a new one."
            )
        pid = getattr(getattr(self.cluster, "controller", None), "process", None)
        self.kill(self.engine_ids)  # by pid: nothing goes through the dead controller
        drop(self)
        raise waits.PoolDiedError(
            f"the engine pool's controller (pid {getattr(pid, 'pid', '?')}) has died, so "
            f"nothing can run on its engines: they were stopped and the pool closed. Run the "
            f"cell again: the next run starts a new pool (or %smp_cluster start -n "
            f"{self.target_size})."
        )

    def status(self) -> list[EngineStatus]:
        from sagenb.engine.entry import probe

        reaper.check()  # `%smp_cluster status`: a dead watcher is replaced, and said so
        ids = self.engine_ids
        results = [self.client[e].apply_async(probe) for e in ids]
        rows = []
        for rank, (eid, ar) in enumerate(zip(ids, results)):
            info = self.result(ar, 60)
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
                    kept=info.get("kept"),
                )
            )
        return rows

    def interrupt(self, engine_ids: Sequence[int]) -> None:
        """SIGINT to engines: their Python code raises KeyboardInterrupt."""
        self.send_signal(engine_ids, signal.SIGINT)

    def send_signal(self, engine_ids: Sequence[int], sig: int) -> None:
        """Send `sig` to engines, without waiting for them (SIGUSR1: dump the running
        rank's stack, engine/wire/tracing.py)."""
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
        # and those on other hosts, through the command that ends them
        reaper.watch_remote(remote.enders(self.cluster, grace=reaper.GRACE_S))

    def controller_alive(self) -> bool:
        """Whether the controller process of a pool started here still runs: not once the
        pool was stopped, nor once ipyparallel has dropped its controller (`cluster.controller`
        is None after its stop). An attached pool's controller is someone else's: assumed
        alive until this process lets go of the pool."""
        if self.stopped:
            return False
        if not self.owned:
            return True
        controller = getattr(self.cluster, "controller", None)
        if controller is None:
            return False
        proc = getattr(controller, "process", None)
        if proc is None:  # a launcher that does not say: nothing to check
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
        self.check_alive()  # engines started for a dead controller would never register
        missing = self.target_size - self.size
        if missing <= 0 or not self.owned:
            self.target_size = min(self.target_size, self.size)
            return
        alive = [self.places.get(e, ("", ""))[1] for e in self.client.ids]
        startup.start_engines(self.cluster, missing, self.launcher, self.options, alive=alive)
        self._remember()
        if not waits.until(lambda: self.size >= self.target_size, timeout, check=self.check_alive):
            raise TimeoutError(
                f"{self.size} of {self.target_size} engines registered within {timeout:g} s "
                f"while the pool replaced lost ones: restart it with `%smp_cluster restart`"
            )
        self.warm()

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop controller, nannies and engines, and wait until every one of them has exited
        (an attached pool is only let go of: whoever started it stops it)."""
        if self.closed:  # found dead and closed already (check_alive), or stopped twice
            return
        alive = self.controller_alive()
        self.stopped = True  # a run on this pool ends now, saying so (run/training_run.py)
        self.closed = True
        if not self.owned:
            self.client.close()
            return
        procs = _pool_processes()
        # ipyparallel drops its launchers as it stops them
        hosts = remote.enders(self.cluster, grace=reaper.GRACE_S)
        # a cell's child in a session of its own (start_new_session=True) is neither in an
        # engine's process group nor, once its engine has stopped, its descendant: noted now
        known = {**self.known, **reaper.identities(reaper.with_descendants(procs))}
        stopped = False
        try:
            self.client.close()
            if alive:  # ipyparallel's stop waits on its controller
                # engines on other hosts are ended through their launcher (ssh: a kill sent
                # over ssh per engine, then polled), which takes longer than local signals
                bound = timeout if self.launcher == "local" else max(timeout, 60.0)
                stopped = startup.stop_cluster(self.cluster, bound)
        finally:
            if not stopped:  # a dead controller, or a stop that hung: over ssh from here
                remote.end_remote(hosts)
            # stopped here: ipyparallel's own stop at interpreter exit would start again what
            # may still be running in the bounded thread, and for ssh engines it connects to
            # hosts that may be gone by then, which held the exiting process for minutes
            self.cluster.shutdown_atexit = False
            # whatever is left (an engine stuck in C++ ignores SIGTERM; a killed controller's
            # children), by pid and process group, bounded
            reaper.end(known)
            reaper.forget(procs)
            reaper.forget_remote(hosts)
            _remove(self.run_lock_path)  # no run can hold a lock on a stopped pool
            startup.remove_batch_script(self.cluster, self.launcher)
            _remove_crash_files(self.pids.values())


def _remove_crash_files(pids: Iterable[int]) -> None:
    """The engines' crash report files (engine/wire/tracing.py), in the user's private
    scratch directory: none outlives its pool."""
    with IMPORTS:
        from sagenb.engine.wire.tracing import crash_path
    for pid in pids:
        try:
            os.remove(crash_path(pid))
        except OSError:
            pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:  # never made: no run trained on the pool
        pass


#: held while this process imports the engine side (torch): `%load_ext` holds it while the
#: notebook's thread imports the magics (torch among them) and a background start takes it
#: before it needs the engine functions, so the two threads never import torch at once
#: (concurrent imports of a package with circular submodule imports can deadlock, which
#: Python turns into an ImportError of a partially initialized module in one of them)
IMPORTS = threading.RLock()


def _engine_side() -> tuple[Callable[[], None], Callable[[str], Any]]:
    """The engine functions a start sends: warm (imports) and locate (host, address)."""
    with IMPORTS:
        from sagenb.engine.entry import warm
        from sagenb.engine.wire.rendezvous import locate
    return warm, locate


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
_background: BackgroundStart | None = None


def current_pool() -> EnginePool | None:
    """The running pool (None while the one `%load_ext` started is still starting)."""
    return _current


def starting() -> int | None:
    """How many engines the pool `%load_ext` is starting in the background has (None: none)."""
    return _background.n if _background is not None else None


def prewarm(n: int = DEFAULT_ENGINES) -> None:
    """Start a pool of n local engines in the background and return at once (what
    `%load_ext sagenb` does): the first run that needs a pool waits for this one instead of
    starting its own, and its error, if it fails, is raised there. Nothing happens while a
    pool runs or is starting."""
    global _background
    if n < 1:
        raise ValueError(f"prewarm({n}): an engine pool needs at least 1 engine")
    if _current is None and _background is None:
        _background = BackgroundStart(n, EnginePool.start)


def _join_background(*, raise_error: bool) -> EnginePool | None:
    """Wait for the background start (an interrupt leaves it running) and make its pool the
    running one; a failed start is dropped, its error raised when `raise_error`."""
    global _current, _background
    start = _background
    if start is None:
        return None
    start.thread.join()
    _background = None
    if start.pool is None and not raise_error:
        return None
    _current = start.result()
    return _current


def _cancel_background() -> bool:
    """Cancel a background start and end what it started; whether there was one."""
    global _background
    start, _background = _background, None
    if start is None:
        return False
    start.stop()
    return True


def start_pool(
    n: int = DEFAULT_ENGINES,
    *,
    launcher: str = "local",
    options: dict[str, Any] | None = None,
    timeout: float = 120.0,
    say: Callable[[str], None] | None = None,
) -> EnginePool:
    """Start a pool of n engines with ipyparallel's `launcher`, replacing any running one; the
    pool `%load_ext` is starting in the background is that pool when it is the same.
    `timeout` and `say` as `EnginePool.start`."""
    global _current
    if _background is not None and (n, launcher, options or {}) == (_background.n, "local", {}):
        joined = _join_background(raise_error=False)
        if joined is not None:
            return joined
    stop_pool()
    started = time.perf_counter()
    _current = EnginePool.start(n, launcher=launcher, options=options, timeout=timeout, say=say)
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
    """The running pool; else the one starting in the background, waited for, when it has at
    least n engines (its error, if it failed, is raised here); else a new one of n engines."""
    if _current is None and _background is not None and _background.n >= n:
        _join_background(raise_error=True)
    reaper.check()  # each run: a dead watcher is replaced, and said so
    return _current if _current is not None else start_pool(n)


def drop(pool: EnginePool) -> None:
    """Stop `pool`, which was found dead: as `stop_pool` when it is the running one (the
    next run starts a new pool), else on its own."""
    if _current is pool:
        stop_pool()
    else:
        pool.stop()


def stop_pool() -> bool:
    """Stop the running pool, and cancel a background start; False when there was neither."""
    global _current
    cancelled = _cancel_background()
    if _current is None:
        return cancelled
    pool, _current = _current, None
    pool.stop()
    return True


def restart_pool(n: int | None = None) -> EnginePool:
    """Fresh engines (and controller), n of them or as many as before, with the same launcher
    (a pool still starting in the background counts as fresh)."""
    if _current is None and _background is not None:
        size = n if n is not None else _background.n
        return start_pool(size)
    size = n if n is not None else (_current.size if _current is not None else DEFAULT_ENGINES)
    if _current is not None and not _current.owned:
        raise ValueError(
            "the pool was attached, not started here: restart it where it was started "
            "(ipcluster), or `%smp_cluster start` a pool of sagenb's own"
        )
    launcher = _current.launcher if _current is not None else "local"
    options = _current.options if _current is not None else None
    return start_pool(size, launcher=launcher, options=options)
