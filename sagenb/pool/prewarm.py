"""The pool `%load_ext sagenb` starts in the background (cluster.prewarm), and the setting
that turns it off.

A pool takes seconds to start (controller, engines registering, torch imported on them:
benchmarks/first_step.py, its figures in benchmarks/results/first_step.md); started when the
extension loads, it is ready by the time the user has written the first cell. The start runs in
a daemon thread that checks a cancel event between its stages, so another start, a stop or an
attach cancels it and ends what it started; its error, if it fails, is kept for the first run
that needs the pool.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["PREWARM_ENV", "BackgroundStart", "prewarm_wanted"]

#: the environment variable that turns the background start on `%load_ext sagenb` off ("0")
PREWARM_ENV = "SAGENB_PREWARM"


def prewarm_wanted() -> bool:
    """Whether `%load_ext sagenb` starts a pool in the background: yes unless the environment
    says SAGENB_PREWARM=0 (or off, false, no)."""
    value = os.environ.get(PREWARM_ENV, "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value not in ("", "1", "on", "true", "yes"):
        warnings.warn(
            f"{PREWARM_ENV}={value!r}: must be 1 or 0 (on or off); starting the pool in the "
            "background as by default",
            stacklevel=2,
        )
    return True


class BackgroundStart:
    """A pool of n local engines being started in a daemon thread (`prewarm`)."""

    def __init__(self, n: int, start: Callable[..., Any]) -> None:
        self.n, self._start = n, start
        self.cancel = threading.Event()
        self.pool: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="sagenb-prewarm")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.pool = self._start(self.n, cancel=self.cancel)
        except BaseException as exc:  # noqa: BLE001 - kept for the first run that needs it
            self.error = exc

    def result(self) -> Any:
        """The started pool (after the thread has ended), or its error with what to do."""
        if self.pool is not None:
            return self.pool
        raise RuntimeError(
            f"the engine pool of {self.n} engines that `%load_ext sagenb` started in the "
            f"background failed: {type(self.error).__name__}: {self.error}. Run the cell again "
            f"to start a new pool, or `%smp_cluster start -n N`; {PREWARM_ENV}=0 in the "
            "environment turns the background start off"
        ) from self.error

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel the start and end whatever it started (the thread does, at its next check)."""
        self.cancel.set()
        self.thread.join(timeout)
        if self.thread.is_alive():  # stuck inside ipyparallel: starting another would race it
            raise RuntimeError(
                f"the background pool start did not stop within {timeout:.0f} s; restart the "
                "kernel (its engines end with it)"
            )
        if self.pool is not None:  # finished before it saw the cancel
            self.pool.stop()
