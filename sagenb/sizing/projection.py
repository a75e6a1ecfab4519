"""The projection on --instance of a run that no `%%smp_plan` estimated: `sagenb.estimate`
with the run's own options, made in a child process while the engines train (issue 31).

A run's header and `result.summary()` say "projected on I: ... s, $..." from it. The child, not
the notebook's process, runs the cell on fake tensors: nothing the cell does (its prints, its
seeding, its patches to torch) reaches the kernel, and the kernel's threads are never blocked.
It runs at the lowest CPU priority Linux has (SCHED_IDLE, sched(7)), so on a machine whose cores
the engines keep busy it takes only the time they leave idle. A slow or failing estimate never
stops the run: the header then says why there is no projection.

The cell runs there in full, so whatever processes it starts (a `subprocess.Popen`, in a session
of its own or not) start there, outside the pool, and were left with ppid 1 once the child had
exited. So nothing the cell starts outlives the child: it is their subreaper
(prctl PR_SET_CHILD_SUBREAPER, man 2 PR_SET_CHILD_SUBREAPER), so they stay its descendants
however they detach, and it ends them (SIGTERM, SIGKILL a second later) before it answers,
and when it is asked to stop (SIGTERM: a cancel, a timeout) or its kernel dies (the signal
PR_SET_PDEATHSIG sends it); the pool's watcher guards it as it guards the engines
(pool/reaper.py), ending its descendants should the kernel die while the child cannot run
its handler. The cell's processes cannot hold the child's answer back either: they inherit
stderr (/dev/null) as their stdout, and the answer goes out on a descriptor they do not get.

A figure made is kept, by what it estimated (the cell and every option that reaches the
engines but --steps and --epochs, which change how many steps there are, not what a step
costs): a cell run again, the notebook's loop, is projected at once and starts no child; run
again before its figure came, it takes the figure of the child already at work. The child is
not free, SCHED_IDLE or not: on 2 cores, the seconds it takes to start Python, import torch
and trace the cell took 20-25% of the steps of a 300-step data-parallel run
(benchmarks/against_peers.py, issue 31), the engines' caches and the wake-ups of their
collectives being what it shares. So where the run's engines are as many as this machine's
cores (`saturates`), the child starts when the run ends (`release`), not beside it: the
header says "estimating after the run" meanwhile, and the figure follows within seconds.

    python -m sagenb.sizing.projection   # reads a pickled (Job, TrainConfig) on stdin
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from sagenb.pool import reaper
from sagenb.sizing.cost import NO_ESTIMATE

__all__ = ["DEFERRED", "LATER_RUN", "Projection", "saturates"]

#: most seconds the child may take; past them it is ended and the header says so
ESTIMATE_TIMEOUT_S = 600.0
#: how many figures are kept for cells run again (see above)
KEPT = 64


class Projection:
    """Seconds per step on --instance, (low, high), once known: given (an estimate the
    notebook already has) or made by a child process (`start`). `why` says why there is none
    yet, or none at all."""

    def __init__(self, step_time_s: tuple[float, float] | None = None, why: str = NO_ESTIMATE):
        self.step_time_s = step_time_s
        self.why = why
        self._ended = False  # under _lock: the figure (or why none) is final
        self._done = threading.Event()  # set once every listener has been told too
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._child: subprocess.Popen[bytes] | None = None
        self._guarded: psutil.Process | None = None  # the child, as the watcher guards it
        self._key: bytes | None = None  # what it estimates, where its figure is to be kept
        self._later: tuple[Any, Any] | None = None  # (job, config) of a deferred estimate
        if step_time_s is not None:
            self._ended = True
            self._done.set()

    @classmethod
    def for_run(cls, estimate: Any, job: Any, config: Any, *, defer: bool = False) -> Projection:
        """Seconds per step on --instance: from `estimate` (a sizing.estimates.Estimate, or
        None) when it estimated this job with these options (engines resolved), else from the
        run's own estimate, made in a child process while the engines train; with `defer`
        (`saturates`), once the run ends and calls `release`."""
        if estimate is not None and estimate.describes(job, config):
            return cls(estimate.step_time_s)
        key = _what(job, config)
        with _kept:
            made = _made.get(key)
            if made is not None:
                _made.move_to_end(key)
        if made is not None:
            return cls(made)
        with _starting:
            pending = _latest
        if pending is not None and pending.pending and pending._key == key and not pending._later:
            # the same cell run again before its figure came (a short run, then the long
            # one): this run takes that child's figure; a second child would compete too
            follower = cls(why=pending.why)
            pending.on_end(lambda: follower._end(pending.step_time_s, pending.why))
            return follower
        return cls.start(job, config, keep_as=key, defer=defer)

    @classmethod
    def start(
        cls, job: Any, config: Any, *, keep_as: bytes | None = None, defer: bool = False
    ) -> Projection:
        """Estimate `job` with `config` (engines resolved) in a child process, now (or, with
        `defer`, when `release` is called); the figure is kept under `keep_as` (for_run) once
        made."""
        why = DEFERRED if defer else "estimating (in the background)"
        projection = cls(why=why)
        projection._key = keep_as
        global _latest
        with _starting:  # one estimate at a time: a run's own is moot once the next starts
            if _latest is not None:
                _latest.cancel(LATER_RUN)
            _latest = projection
        if defer:
            projection._later = (job, config)
        else:
            projection._launch(job, config)
        return projection

    def release(self) -> None:
        """Start the child of a deferred estimate (the run has ended); nothing otherwise."""
        later, self._later = self._later, None
        if later is not None and not self._ended:
            self.why = "estimating (in the background)"
            self._launch(*later)

    def _launch(self, job: Any, config: Any) -> None:
        projection = self
        try:
            projection._child = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=_child_env(),
            )
        except OSError as err:
            projection._end(None, f"no estimate (its process did not start: {err})")
            return
        projection._guarded = _guard(projection._child.pid)
        payload = pickle.dumps((job, config))
        threading.Thread(
            target=projection._follow, args=(payload,), name="sagenb-projection", daemon=True
        ).start()

    @property
    def pending(self) -> bool:
        return not self._ended

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the estimate; whether it has ended (made or failed), its
        listeners told (a saved dashboard then shows the figure)."""
        return self._done.wait(timeout_s)

    def cancel(self, why: str) -> None:
        """No estimate after all, for `why`: the child is ended (a run that failed, or that
        stopped waiting for the figure)."""
        self._end(None, why)
        child = self._child
        if child is not None and child.poll() is None:  # bounded, but not this caller's wait
            threading.Thread(
                target=_stop, args=(child,), name="sagenb-projection-stop", daemon=True
            ).start()

    def _follow(self, payload: bytes) -> None:
        child = self._child
        assert child is not None  # start made it before this thread
        try:
            out, _ = child.communicate(payload, timeout=ESTIMATE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(child)
            with contextlib.suppress(subprocess.TimeoutExpired, OSError, ValueError):
                child.communicate(timeout=5)  # its pipes, closed
            self._end(None, f"no estimate (it took over {ESTIMATE_TIMEOUT_S:.0f} s)")
            return
        except OSError as err:  # the child died before reading its input
            _stop(child)
            self._end(None, f"no estimate (its process failed: {err})")
            return
        finally:
            if self._guarded is not None:  # it has ended, and ended what the cell started
                reaper.forget([self._guarded])
        self._end(*_answer(out, child.returncode))

    def on_end(self, listener: Callable[[], None]) -> None:
        """Call `listener()` once the estimate has ended (now, if it has), from the thread
        that ends it: the run's result and its dashboard take the figure when it comes."""
        with self._lock:
            if not self._ended:
                self._listeners.append(listener)
                return
        _tell(listener)

    def _end(self, step_time_s: tuple[float, float] | None, why: str) -> None:
        with self._lock:  # the first end stays (a cancel, then the killed child's exit)
            if self._ended:
                return
            self.step_time_s, self.why = step_time_s, why
            self._ended = True
            if step_time_s is not None and self._key is not None:
                _keep(self._key, step_time_s)
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            _tell(listener)
        self._done.set()


#: why a run's own estimate was not made: the next run ended its child (one at a time)
LATER_RUN = (
    "no estimate (a later run started before it was made; %%smp_plan with the same flags makes one)"
)

#: what the header says of a run's own estimate until its run ends (`saturates`)
DEFERRED = "estimating after the run (its engines fill every core here)"


def saturates(engines_here: int) -> bool:
    """Whether `engines_here` engines on this machine keep all of its cores busy, so that a
    child estimating beside them would take its CPU from their steps."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return engines_here >= cores


#: the latest run's own estimate, and the lock its replacement takes
_latest: Projection | None = None
_starting = threading.Lock()


#: figures made, by what they estimated (`_what`), the latest used last; under _kept
_kept = threading.Lock()
_made: OrderedDict[bytes, tuple[float, float]] = OrderedDict()


def _what(job: Any, config: Any) -> bytes:
    """What a figure estimates: the key `Estimate.describes` compares, but for the number of
    steps (a step costs the same however many there are)."""
    from sagenb.sizing.estimates import estimate_key

    return pickle.dumps(estimate_key(job, dataclasses.replace(config, steps=None, epochs=1)))


def _keep(key: bytes, step_time_s: tuple[float, float]) -> None:
    with _kept:
        _made[key] = step_time_s
        _made.move_to_end(key)
        while len(_made) > KEPT:
            _made.popitem(last=False)


def _tell(listener: Callable[[], None]) -> None:
    try:
        listener()
    except Exception as err:  # noqa: BLE001 - a figure that could not be shown loses no run
        warnings.warn(f"sagenb: the projection could not be shown: {err!r}", stacklevel=1)


def _answer(out: bytes, returncode: int) -> tuple[tuple[float, float] | None, str]:
    try:
        answer = json.loads(out.decode() or "{}")
    except ValueError:
        answer = {}
    if "step_time_s" in answer:
        low, high = answer["step_time_s"]
        return (float(low), float(high)), ""
    error = answer.get("error") or f"its process exited with {returncode}"
    return None, f"no estimate ({error}; %%smp_plan with the same flags says more)"


def _child_env() -> dict[str, str]:
    """This process's environment, with the folder sagenb was imported from on the path (a
    checkout used without installing it, as the tests do)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _guard(pid: int) -> psutil.Process | None:
    """Have the pool's watcher end the child and its descendants should this process die."""
    try:
        proc = psutil.Process(pid)
        reaper.watch([proc])
        return proc
    except psutil.Error:  # gone already: nothing to guard
        return None


def _stop(child: subprocess.Popen[bytes]) -> None:
    """End the child and what the cell started in it: SIGTERM, whose handler ends its
    descendants (main), then the watcher's way for whatever is left; bounded (about 4 s)."""
    try:
        proc = psutil.Process(child.pid)
        tree = [proc, *proc.children(recursive=True)]  # noted before the child can go
    except psutil.Error:
        tree = []
    child.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=2)
    reaper.end(reaper.identities(tree), grace=1.0)


#: prctl(2)'s options (linux/prctl.h)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _lowest_priority() -> None:
    """Run only on CPU time nothing else wants (SCHED_IDLE), or at nice 19 where that policy
    is missing."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _keep_what_the_cell_starts() -> None:
    """Adopt the processes the cell starts however they detach (Linux's child subreaper), and
    end them on SIGTERM: a cancel's, a timeout's, or the one the kernel's death sends."""
    signal.signal(signal.SIGTERM, _stopped)
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the kernel died before the setting took
        _stopped(signal.SIGTERM, None)


def _stopped(signum: int, _frame: Any) -> None:
    _end_descendants()
    os._exit(128 + signum)


def _end_descendants() -> None:
    """End every process the cell started here (all are descendants: the subreaper), their
    own sessions' groups included; never this process's group, which is the kernel's."""
    try:
        tree = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    reaper.reap(reaper.identities(tree), spare_pgids={os.getpgrp()}, grace=1.0)


def main() -> None:
    # the answer's own descriptor; what the cell prints, and the processes it starts, get
    # stderr as stdout, so none can hold the answer's pipe open past this process
    answer_fd = os.dup(1)  # not inherited (PEP 446)
    os.dup2(2, 1)
    _lowest_priority()
    _keep_what_the_cell_starts()
    try:
        job, config = pickle.loads(sys.stdin.buffer.read())
        from sagenb.sizing.estimates import estimate

        made = estimate(job, config)
        answer: dict[str, Any] = {"step_time_s": list(made.step_time_s)}
    except Exception as err:  # noqa: BLE001 - whatever failed is the header's reason
        answer = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
    finally:
        _end_descendants()
    os.write(answer_fd, (json.dumps(answer) + "\n").encode())


if __name__ == "__main__":
    main()
