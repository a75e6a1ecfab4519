"""The projection on --instance of a run that no `%%smp_plan` estimated: `sagenb.estimate`
with the run's own options, made in a child process while the engines train (issue 31).

A run's header and `result.summary()` say "projected on I: ... s, $..." from it. The child, not
the notebook's process, runs the cell on fake tensors: nothing the cell does (its prints, its
seeding, its patches to torch) reaches the kernel, and the kernel's threads are never blocked.
It runs at the lowest CPU priority Linux has (SCHED_IDLE, sched(7)), so on a machine whose cores
the engines keep busy it takes only the time they leave idle, and it is SIGKILLed when the
kernel dies (prctl PR_SET_PDEATHSIG). A slow or failing estimate never stops the run: the
header then says why there is no projection.

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

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sagenb.sizing.cost import NO_ESTIMATE

__all__ = ["DEFERRED", "Projection", "saturates"]

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
                _latest.cancel("no estimate (a later run started before it was made)")
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
        if child is not None and child.poll() is None:
            child.kill()

    def _follow(self, payload: bytes) -> None:
        child = self._child
        assert child is not None  # start made it before this thread
        try:
            out, _ = child.communicate(payload, timeout=ESTIMATE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            self._end(None, f"no estimate (it took over {ESTIMATE_TIMEOUT_S:.0f} s)")
            return
        except OSError as err:  # the child died before reading its input
            self._end(None, f"no estimate (its process failed: {err})")
            return
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


def _lowest_priority() -> None:
    """Run only on CPU time nothing else wants (SCHED_IDLE), or at nice 19 where that policy
    is missing; and die with the parent."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1


def main() -> None:
    _lowest_priority()
    try:
        job, config = pickle.loads(sys.stdin.buffer.read())
        from sagenb.sizing.estimates import estimate

        # the cell's prints stay out of the answer on stdout
        real_stdout, sys.stdout = sys.stdout, sys.stderr
        try:
            made = estimate(job, config)
        finally:
            sys.stdout = real_stdout
        answer: dict[str, Any] = {"step_time_s": list(made.step_time_s)}
    except Exception as err:  # noqa: BLE001 - whatever failed is the header's reason
        answer = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
