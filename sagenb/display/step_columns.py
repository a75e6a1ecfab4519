"""The per-step columns the dashboard's lines are drawn from, kept as the run's history grows.

A live redraw draws ~svg_figure.MAX_POINTS rows of each line, but some lines are derived from
every row: the smoothed loss and throughput (moving averages), each replica's loss, the step
time's compute / bubble split and the eval points. Derived afresh at every redraw, they made a
redraw's cost grow with the run: the loss panel, redrawn every second, took 4 ms of the
notebook's CPU at 1,100 steps, 34 ms at 10,000 and 84 ms at 30,000 (issue 17: the CPU the
dashboard takes is taken from the engines on the training machine). `StepColumns.update`
derives only the rows that came since the last redraw; the history's rows are only ever
appended (metrics.History).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sagenb.metrics import keys

__all__ = ["SMOOTHING", "Smoothed", "smoothed", "StepColumns"]

SMOOTHING = 0.9  # exponential moving average of the global loss (TensorBoard's default 0.6-0.9)


class Smoothed:
    """An exponential moving average, extended value by value. A NaN (a step whose loss was
    lost with its engine) stays a NaN, a gap in the line, not a NaN trail."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self._last: float | None = None

    def add(self, value: float) -> None:
        if math.isnan(value):
            self.values.append(value)
            return
        last = self._last
        self._last = value if last is None else SMOOTHING * last + (1 - SMOOTHING) * value
        self.values.append(self._last)


def smoothed(values: Iterable[float]) -> list[float]:
    """The moving average of `values` (Smoothed), all at once."""
    line = Smoothed()
    for value in values:
        line.add(value)
    return line.values


class StepColumns:
    """One value per history row for each line derived from every row."""

    def __init__(self, replicas: int) -> None:
        self.rows = 0  # the history rows taken so far
        self.replica_losses: list[list[float]] = [[] for _ in range(replicas)]
        self.loss = Smoothed()
        self.busy: list[float] = []  # compute seconds (pipelines measure it; else the step)
        self.idle: list[float] = []  # pipeline bubble seconds (0 without a pipeline)
        self.evals: list[tuple[int, float]] = []  # (step, eval loss) where measured
        self.rate_key: str | None = None
        self.rate = Smoothed()

    def update(self, rows: Sequence[Mapping[str, Any]], rate_key: str) -> StepColumns:
        """Take the rows added since the last update. `rate_key`: the throughput drawn
        (samples/s, or tokens/s once the dashboard sees token ids); when it changes, the
        smoothed throughput is derived again from the first row."""
        if rate_key != self.rate_key:
            self.rate_key, self.rate = rate_key, Smoothed()
            for row in rows[: self.rows]:
                self.rate.add(row.get(rate_key, 0.0))
        for row in rows[self.rows :]:
            losses = row[keys.RANK_LOSSES]
            for i, series in enumerate(self.replica_losses):
                series.append(losses[i] if i < len(losses) else math.nan)
            self.loss.add(row[keys.LOSS])
            self.rate.add(row.get(rate_key, 0.0))
            self.busy.append(row.get(keys.BUSY, row[keys.STEP_TIME]))
            self.idle.append(row.get(keys.IDLE, 0.0))
            if keys.EVAL_LOSS in row:
                self.evals.append((row[keys.STEP], row[keys.EVAL_LOSS]))
        self.rows = len(rows)
        return self
