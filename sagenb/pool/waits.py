"""Every wait on the pool has a bound, and a dead controller ends it within a fraction of a
second.

ipyparallel's `AsyncResult.get()`, `Client.queue_status()` and the `*_sync` calls wait without a
timeout by default, and a controller that has died never answers: a run that waited so on the
restore of its engines hung for ever when the controller had died between two runs. Here a wait
on a task or a future is sliced: between slices the caller's `check` runs (the pool's is
`EnginePool.check_alive`, which raises PoolDiedError once its controller process is gone, and a
background start adds its cancel), and the wait's own bound ends it with TimeoutError.
tests/test_bounded_waits.py lists every wait in sagenb/ and fails on one without a bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["PoolDiedError", "result", "until", "bounded", "CHECK_S"]

#: how often a wait on the pool runs its check (a psutil read of the controller: microseconds)
CHECK_S = 0.1

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
