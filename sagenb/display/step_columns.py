"""The per-step columns the dashboard's lines are drawn from, kept as the run's history grows.

A live redraw draws ~svg_figure.MAX_POINTS rows of each line, but some lines are derived from
every row: the smoothed loss and throughput (moving averages, their window suited to the
run's length: smoothing_for), each replica's loss, the step time's compute / bubble split and
the eval points. Derived afresh at every redraw, they made a
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

__all__ = ["SMOOTHING", "Smoothed", "smoothed", "smoothing_for", "StepColumns"]

SMOOTHING = 0.9  # the heaviest smoothing, a run's of 100 steps or more: TensorBoard's 0.6-0.9
#: the smoothing's window, 1 / (1 - weight) steps, is at most this share of the run's steps
WINDOW_SHARE = 0.1


def smoothing_for(steps: int | None) -> float:
    """The moving average's weight for a run of `steps` steps (None: not known, SMOOTHING).
    An exponential moving average of weight w averages over ~1 / (1 - w) steps and lags the
    loss by ~w / (1 - w) of them: 9 steps at 0.9. On a run of 16 steps that lag ended the
    smoothed loss at 1.9 while the loss was 0.24 (issue 35), so the window is kept to a tenth
    of the run (none below 10 steps) and grows to SMOOTHING's 10 steps from 100 steps on."""
    if steps is None:
        return SMOOTHING
    window = min(1 / (1 - SMOOTHING), max(1.0, WINDOW_SHARE * steps))
    return 1 - 1 / window


class Smoothed:
    """An exponential moving average with TensorBoard's bias correction, extended value by
    value: it starts from 0 and divides by 1 - weight^n after n values, so that the first
    points are the average of the values so far, not pulled towards the first (TensorBoard's
    smoothing: tensorflow/tensorboard, tensorboard/components/vz_line_chart2/line-chart.ts at
    commit 34877f15, `resmoothDataset`). A NaN
    (a step whose loss was lost with its engine) stays a NaN, a gap in the line, not a NaN
    trail."""

    def __init__(self, weight: float = SMOOTHING) -> None:
        self.weight = weight
        self.values: list[float] = []
        self._sum = 0.0  # the average before its correction
        self._seen = 0  # the values averaged so far

    def add(self, value: float) -> None:
        if math.isnan(value):
            self.values.append(value)
            return
        self._sum = self.weight * self._sum + (1 - self.weight) * value
        self._seen += 1
        # the first value is itself, exactly (the division would round it)
        first = self._seen == 1 or self.weight == 0
        self.values.append(value if first else self._sum / (1 - self.weight**self._seen))


def smoothed(values: Iterable[float], weight: float = SMOOTHING) -> list[float]:
    """The moving average of `values` (Smoothed), all at once."""
    line = Smoothed(weight)
    for value in values:
        line.add(value)
    return line.values


class StepColumns:
    """One value per history row for each line derived from every row."""

    def __init__(self, replicas: int) -> None:
        self.rows = 0  # the history rows taken so far
        self.replica_losses: list[list[float]] = [[] for _ in range(replicas)]
        self.steps: int | None = None  # the run's steps, which set the smoothing's window
        self.loss = Smoothed()
        self.busy: list[float] = []  # compute seconds (pipelines measure it; else the step)
        self.idle: list[float] = []  # pipeline bubble seconds (0 without a pipeline)
        self.evals: list[tuple[int, float]] = []  # (step, eval loss) where measured
        self.rate_key: str | None = None
        self.rate = Smoothed()

    def update(
        self, rows: Sequence[Mapping[str, Any]], rate_key: str, steps: int | None = None
    ) -> StepColumns:
        """Take the rows added since the last update. `rate_key`: the throughput drawn
        (samples/s, or tokens/s once the dashboard sees token ids); `steps`: the run's steps
        (smoothing_for), None when not known. When either changes, the smoothed lines that
        depend on it are derived again from the first row."""
        if steps != self.steps:
            self.steps, self.loss = steps, Smoothed(smoothing_for(steps))
            for row in rows[: self.rows]:
                self.loss.add(row[keys.LOSS])
            self.rate_key = None  # the throughput too, below
        if rate_key != self.rate_key:
            self.rate_key, self.rate = rate_key, Smoothed(smoothing_for(steps))
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
