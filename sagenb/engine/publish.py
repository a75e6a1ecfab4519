"""Streaming metrics from an engine to the notebook, one message per step, none lost.

ipyparallel merges published dicts into `AsyncResult.data` with `dict.update`, so a key reused
every step would keep only the latest value when the notebook polls slowly. Each step is
published under its own sequence number instead; the client reads them back in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Publisher", "collecting_publisher"]


class Publisher:
    """Publishes `{str(seq): metrics}` through ipyparallel's data channel and counts messages."""

    def __init__(self, send: Callable[[dict[str, Any]], None] | None = None) -> None:
        if send is None:  # imported here: ipyparallel.datapub pulls IPython into the process
            from ipyparallel.datapub import publish_data as send
        self._send = send
        self.count = 0

    def __call__(self, metrics: dict[str, Any]) -> None:
        self._send({str(self.count): metrics})
        self.count += 1


def collecting_publisher() -> tuple[Publisher, list[dict[str, Any]]]:
    """A publisher that keeps messages in a list (single-process use, tests)."""
    sent: list[dict[str, Any]] = []

    def send(message: dict[str, Any]) -> None:
        sent.extend(message.values())

    return Publisher(send), sent
