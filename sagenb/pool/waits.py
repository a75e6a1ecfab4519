"""Every wait on the pool has a bound, and a dead controller ends it within a fraction of a
second.

ipyparallel's `AsyncResult.get()`, `Client.queue_status()` and the `*_sync` calls wait without a
timeout by default, and a controller that has died never answers: a run that waited so on the
restore of its engines hung for ever when the controller had died between two runs. Here a wait
on a task or a future is sliced: between slices the caller's `check` runs (the pool's is
`EnginePool.check_alive`, which raises PoolDiedError once its controller process is gone, and a
background start adds its cancel), and the wait's own bound ends it with TimeoutError.
tests/test_bounded_waits.py lists every wait in sagenb/ and fails on one without a bound.

One wait has no bound by design: a run waiting for a pool busy with other work (another run's
lock, run_lock.py; another client's tasks on its engines, orphans.py) waits until it is free,
saying so under the cell each second, until the user interrupts it (`while_busy`, with the
note `stderr_note` writes; --if-busy fail raises instead of waiting).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "PoolDiedError",
    "result",
    "until",
    "bounded",
    "while_busy",
    "stderr_note",
    "CHECK_S",
    "BUSY_POLL_S",
    "NOTE_S",
]

#: how often a wait on the pool runs its check (a psutil read of the controller: microseconds)
CHECK_S = 0.1
#: how often a run waiting for a busy pool asks again (the lock, the controller's queues)
BUSY_POLL_S = 0.2
#: how often the note under the cell of a run that waits is rewritten
NOTE_S = 1.0

T = TypeVar("T")


class PoolDiedError(RuntimeError):
    """The pool's controller died, or the pool was stopped or restarted under the run: no
    rank can report or be told anything any more. The run's engines were stopped and the pool
    closed; the next run starts a new pool (or trains on the one a restart started)."""


def until(ready: Callable[[], bool], timeout: float, *, check: Callable[[], None]) -> bool:
    """Wait until `ready()` or `timeout` s have passed, calling `check()` (which raises to end
    the wait) before each slice of CHECK_S; whether it became ready."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() >= deadline:
            return False
        check()
        time.sleep(CHECK_S)
    return True


def result(ar: Any, timeout: float, *, check: Callable[[], None]) -> Any:
    """An ipyparallel AsyncResult's value within `timeout` s (its TimeoutError after that),
    calling `check()` between slices of CHECK_S, in which the result's own wait sleeps."""
    deadline = time.monotonic() + timeout
    while not ar.ready():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        check()
        ar.wait(min(CHECK_S, left))
    return ar.get(timeout=0)  # ipyparallel's TimeoutError when it is still not ready


def bounded(fn: Callable[[], T], timeout: float) -> tuple[bool, T | None]:
    """fn() in a daemon thread, waited for at most `timeout` s: for calls that take no
    timeout of their own (a controller query, ipyparallel's `*_sync` stops). Returns whether it
    returned in time and its value; its error is raised here. A call that hangs on a dead peer
    is left behind in its thread, not waited for."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = err

    worker = threading.Thread(target=call, daemon=True, name="sagenb-bounded")
    worker.start()
    worker.join(timeout)
    if "error" in box:
        raise box["error"]
    return not worker.is_alive(), box.get("value")


def while_busy(busy: Callable[[float], str], note: Callable[[str], None]) -> float | None:
    """Wait while `busy(seconds waited)` says what the pool is busy with (the note's text; ""
    once free), asking every BUSY_POLL_S; `busy` raises to give up (PoolBusyError under
    --if-busy fail). The text goes to `note` at once and then every NOTE_S, and "" once the
    pool is free. Returns the seconds waited, or None when it was free at once."""
    started, shown = time.monotonic(), None
    while text := busy(time.monotonic() - started):
        waited = time.monotonic() - started
        if shown is None or waited - shown >= NOTE_S:
            note(text)
            shown = waited
        time.sleep(BUSY_POLL_S)
    if shown is None:
        return None
    note("")
    return time.monotonic() - started


def stderr_note(free: str) -> Callable[[str], None]:
    """A note of one line under the cell, rewritten in place (a carriage return: Jupyter's
    output area and terminals both overwrite the line), ended by "sagenb: `free`" on a line of
    its own once told "" (the wait is over)."""

    def note(text: str) -> None:
        if text:
            sys.stderr.write(f"\r{text}")
        else:
            sys.stderr.write(f"\nsagenb: {free}\n")
        sys.stderr.flush()

    return note
