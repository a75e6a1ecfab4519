"""The warm engine pool: ipyparallel engines reused by every cell.

This module owns ipyparallel. A pool is started once (engines ready, torch imported) and every
`%%smp_train` reuses it, so a cell pays seconds only the first time. A rank is an engine's
position in the pool, never its id: ipyparallel does not reuse ids after a restart.

Engines are started by ipyparallel's own launchers: `local` (the default; everything on
127.0.0.1), or `mpi`, `slurm`, `ssh` for engines on other hosts, in which case (and only then)
the controller listens beyond loopback. A pool someone started with `ipcluster start` is
attached to by profile and cluster id, and left running when the notebook lets go of it.
A pool started here ends with the process that started it, even one killed by a signal
(reaper.py).

Cold start: `%load_ext sagenb` starts the default pool in a background thread (`prewarm`; off
with SAGENB_PREWARM=0; prewarm.py), so the seconds a pool takes to start
(benchmarks/results/first_step.md) pass while the user writes the first cell; the first run that
needs a pool waits for that one (`ensure_pool`), and starting, stopping or attaching another
pool cancels it first, so two pools of ours never run at once. A start's time goes to the
controller, the engines registering (imports, a nanny process each, and the controller noticing
the heart beat) and torch and torch._dynamo imported on the engines:
benchmarks/results/first_step.md and measured_in_code.md there.

Placement: ranks are numbered host by host (engines on one host get consecutive ranks), so a
pipeline replica's stages and a tensor-parallel group, which take consecutive ranks, share a
host when they fit on one, and only the data-parallel gradient all-reduce, once a step,
crosses hosts: the "keep a model replica together" placement that SageMaker calls cluster.
"""

from __future__ import annotations

import json
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
from sagenb.pool.ipyparallel_private import client_config, iopub_guarded
from sagenb.pool.launchers import (
    CONTROLLER_HEARTBEAT,
    LAUNCHERS,
    LOOPBACK,
    controller_location,
    launcher_config,
)
from sagenb.pool.prewarm import BackgroundStart, prewarm_wanted

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

#: seconds between two reads of a batch job's state while its engines are awaited (squeue)
JOB_POLL_S = 2.0


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
        at the next check (every 50 ms while waiting on the engines)."""
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
            controller_location=controller_location(launcher, options or {}),
            controller_args=CONTROLLER_HEARTBEAT,
            log_level=logging.ERROR,
            config=launcher_config(launcher, options or {}),
        )
        if launcher == "slurm" and "SlurmEngineSetLauncher.batch_file_name" not in (options or {}):
            # ipyparallel writes the job's script into the notebook's folder (its work_dir
            # '.'); beside the job's output in the profile's log folder instead
            logs = os.path.join(cluster.profile_dir, "log")
            os.makedirs(logs, exist_ok=True)
            name = os.path.join(logs, f"ipengine-{cluster.cluster_id}.sbatch")
            cluster.config.SlurmEngineSetLauncher.batch_file_name = name  # removed at stop
        try:  # what pools ended by a kill left in the profile (startup.py)
            startup.remove_stale(cluster.profile_dir)
        except Exception:  # noqa: BLE001 - tidying never stops a start
            pass
        # all n engines are launched at once (ipyparallel's engine set launchers start them
        # without waiting on each other), once the controller has written its connection file
        try:
            cluster.start_cluster_sync()
        except BaseException:  # an engine that could not be launched (ssh refused, say)
            _stop_cluster(cluster, 30)  # leaves no controller behind
            raise
        pool = None
        try:
            _owner_only(cluster)
            client = _connect(cluster)
            pool = cls(cluster, client, n, launcher=launcher, options=options)
            pool._remember()  # controller and engines, watched from their launch on
            pool._register(n, timeout, cancel, say)
            pool._remember()  # and the nanny each engine started as it registered
            pool.warm(cancel=cancel)
        except BaseException:
            if pool is not None:
                pool.stop()  # ends and forgets every process it noted
            else:
                _stop_cluster(cluster, 30)
            raise
        return pool

    def _register(
        self,
        n: int,
        timeout: float,
        cancel: threading.Event | None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """Wait until n engines have registered, starting each one's warm-up imports (torch,
        DDP's torch._dynamo: the longest part of a start) as soon as it has registered rather
        than when the last one has. A batch job's state (Slurm's squeue) is read every few
        seconds and said when it changes, and named if the wait times out."""
        warm, _ = _engine_side()
        waiting = self.client.wait_for_engines(n, timeout=timeout, block=False, interactive=False)
        warming: set[int] = set()
        jobs = remote.batch_jobs(self.cluster)
        states: dict[str, str] = {}
        asked = time.monotonic()
        while not waiting.done():
            for eid in set(self.client.ids) - warming:
                self.client[eid].apply_async(warm)  # warm() below waits for it and checks it
                warming.add(eid)
            _check(cancel)
            self.check_alive()  # a controller that died while engines start ends the wait
            if jobs and time.monotonic() - asked > JOB_POLL_S:
                asked, seen = time.monotonic(), remote.job_states(jobs)
                for job, state in seen.items():
                    if say is not None and states.get(job) != state:
                        say(f"Slurm job {job}: {state}")
                states.update(seen)
            time.sleep(0.05)
        try:
            waiting.result(timeout=0)  # done: its value, or its TimeoutError
        except TimeoutError:
            queued = "; ".join(f"Slurm job {j}: {s}" for j, s in states.items())
            raise TimeoutError(
                f"{len(self.client.ids)} of {n} engines registered within {timeout:g} s"
                + (f" ({queued})" if queued else "")
                + ": allow longer with `%smp_cluster start --timeout SECONDS`; what was "
                "started is stopped" + (" and the job cancelled" if jobs else "")
            ) from None

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
            named = f"profile {profile or 'default'!r}, cluster id {cluster_id!r}"
            raise ValueError(f"no running ipyparallel cluster found for {named}") from None
        client = _connect(cluster)
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
        """The controller's address as the engines reach it: the location it was given or told
        them (this process's client may reach it through loopback)."""
        if getattr(self.cluster, "controller_location", ""):
            return str(self.cluster.controller_location)
        config = _engine_connection(self.cluster) or client_config(self.client)
        interface = config.get("interface", f"tcp://{LOOPBACK}")
        host = interface.split("://", 1)[-1]
        if host in ("*", "0.0.0.0", ""):
            host = config.get("location") or LOOPBACK
        return host

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
            self.result(ar, 120, cancel=cancel)
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

        def check() -> None:
            _check(cancel)
            self.check_alive()

        return waits.result(ar, timeout, check=check)

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
        hosts = self.options.get("SSHEngineSetLauncher.engines")
        where = None
        if self.launcher == "ssh" and hosts:  # where they were lost, not on the first host
            alive = [self.places.get(e, ("", ""))[1] for e in self.client.ids]
            where = remote.replacements(hosts, alive, missing)
        if where is not None:
            self.cluster.config.SSHEngineSetLauncher.engines = where
        try:
            self.cluster.start_engines_sync(n=missing)
        finally:
            if where is not None:  # the next start (a restart) takes the user's setting
                self.cluster.config.SSHEngineSetLauncher.engines = hosts
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
        known = {**self.known, **reaper.identities(procs + _descendants(procs))}
        stopped = False
        try:
            self.client.close()
            if alive:  # ipyparallel's stop waits on its controller
                # engines on other hosts are ended through their launcher (ssh: a kill sent
                # over ssh per engine, then polled), which takes longer than local signals
                bound = timeout if self.launcher == "local" else max(timeout, 60.0)
                stopped = _stop_cluster(self.cluster, bound)
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
            if self.launcher == "slurm":  # the job's script sagenb placed (start)
                script = self.cluster.config.SlurmEngineSetLauncher.get("batch_file_name", "")
                if os.path.isabs(script) and script.endswith(".sbatch"):
                    _remove(script)
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


def _connect(cluster: ipp.Cluster) -> ipp.Client:
    """The pool's client, whose IOPub handler survives a message it cannot handle: an engine's
    widget in an IPython without a kernel stopped every later message of the run, its metrics
    among them (ipyparallel_private.iopub_guarded; the engines draw no widgets during a run,
    engine/wire/output.py, so this is the guard for the one that slips through)."""
    with iopub_guarded(ipp.Client):
        return cluster.connect_client_sync()


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


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:  # never made: no run trained on the pool
        pass


def _stop_cluster(cluster: ipp.Cluster, timeout: float) -> bool:
    """ipyparallel's stop, waited for at most `timeout` s (it waits on its controller, which
    may be dead); whether it stopped. A stop that failed or hung leaves the processes to the
    caller's ending by pid."""
    try:
        return waits.bounded(cluster.stop_cluster_sync, timeout)[0]
    except Exception:  # noqa: BLE001 - ended by pid instead, as a hung stop is
        return False


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


class StartCancelled(Exception):
    """A background pool start was cancelled (another pool was asked for, or none)."""


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise StartCancelled("the background pool start was cancelled")


def _owner_only(cluster: ipp.Cluster) -> None:
    """The controller's connection files are written 0600; the cluster file too, here."""
    if cluster.cluster_file and os.path.exists(cluster.cluster_file):
        os.chmod(cluster.cluster_file, 0o600)


def _descendants(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    found = []
    for proc in procs:
        try:
            found += proc.children(recursive=True)
        except psutil.Error:
            pass
    return found


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
