"""Streaming metrics from an engine to the notebook, every step, none lost.

ipyparallel merges published dicts into `AsyncResult.data` with `dict.update`, so a key reused
every step would keep only the latest value when the notebook polls slowly. Each step is
published under its own sequence number instead; the client reads them back in order.

Steps are sent in batches, at most every INTERVAL_S seconds: each message crosses the
controller to the notebook, and on a small machine one message per step per rank cost the
engines several percent of their throughput (benchmarks/against_peers.py). The dashboard
redraws its header and loss every second (dashboard.REDRAW_S): twice as often as that, each
redraw has new steps to show, and sending more often shows nothing sooner; the first step is
sent at once, for the time to the first step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Publisher", "collecting_publisher"]


INTERVAL_S = 0.5


class Publisher:
    """Publishes `{str(seq): metrics}` through ipyparallel's data channel; counts the steps."""

    def __init__(
        self, send: Callable[[dict[str, Any]], None] | None = None, interval: float = INTERVAL_S
    ) -> None:
        if send is None:  # imported here: ipyparallel.datapub pulls IPython into the process
            from ipyparallel.datapub import publish_data

            send = publish_data
        self._send, self.interval = send, interval
        self.count = 0
        self._pending: dict[str, Any] = {}
        self._sent_at = 0.0

    def __call__(self, metrics: dict[str, Any]) -> None:
        self._pending[str(self.count)] = metrics
        self.count += 1
        if time.monotonic() - self._sent_at >= self.interval:
            self.flush()

    def flush(self) -> None:
        """Send what is pending (also called when the run ends, however it ends)."""
        if self._pending:
            batch, self._pending = self._pending, {}
            self._send(batch)
        self._sent_at = time.monotonic()


def collecting_publisher() -> tuple[Publisher, list[dict[str, Any]]]:
    """A publisher that keeps messages in a list (single-process use, tests)."""
    sent: list[dict[str, Any]] = []

    def send(message: dict[str, Any]) -> None:
        sent.extend(message.values())

    return Publisher(send, interval=0.0), sent
