"""A kernel's interrupt that Python swallowed, raised again where a run next looks for one.

SIGINT's default handler (and ipykernel's, while a cell runs) raises KeyboardInterrupt in
whatever Python code the main thread is running when the signal is handled. Inside a weakref
callback or a `__del__`, which the garbage collector runs at any point, Python prints
"Exception ignored in ..." and goes on: the interrupt is lost, and the run trains to its end.
One fresh-clone CI run lost the interrupt button's signal so, in a WeakSet's callback.

While a run is followed, `InterruptLatch` records each SIGINT before handing it to the handler
it replaced; the follow loop calls `check`, which raises KeyboardInterrupt for a recorded
interrupt no KeyboardInterrupt has answered yet.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["InterruptLatch"]


class InterruptLatch:
    """While entered (on the main thread only: Python runs signal handlers there), SIGINT is
    recorded, then handled as before."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> InterruptLatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous
        if previous == signal.SIG_IGN:
            return
        self.pending = True
        if callable(previous):
            previous(signum, frame)  # raises KeyboardInterrupt, as it would have
        else:  # SIG_DFL, or a handler not set from Python (None): Python's own
            signal.default_int_handler(signum, frame)

    def check(self) -> None:
        """Raise KeyboardInterrupt if a SIGINT came and none was raised where it landed."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def answered(self) -> None:
        """A KeyboardInterrupt was caught: the interrupts so far are answered."""
        self.pending = False
