"""Metrics on the notebook side: read the engines' streams in order, aggregate, fan out to sinks.

Each rank publishes one dict per step under its sequence number (engine/wire/publish.py). A
`RankStream` reads them back in order from the rank's AsyncResult, so nothing is lost however
slowly the notebook polls. Sinks (the dashboard, the history) receive `(metrics, step, rank)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sagenb.metrics import keys

__all__ = ["StepMetrics", "MetricSink", "RankStream", "History"]

# rank 0's values a history row keeps as they are, when the step has them
COPIED = (keys.GRAD_NORM, keys.EVAL_LOSS, keys.LOSS_SCALE, keys.SKIPPED_STEP, keys.WARNINGS)


@dataclass(frozen=True)
class StepMetrics:
    step: int
    rank: int
    values: Mapping[str, Any]


class MetricSink(Protocol):
    def log(self, metrics: Mapping[str, Any], step: int, rank: int) -> None: ...

    def close(self) -> None: ...


class RankStream:
    """The messages one rank has published so far, each read once, in order."""

    def __init__(self, rank: int, async_result: Any) -> None:
        self.rank, self._ar, self.received = rank, async_result, 0

    def drain(self) -> list[StepMetrics]:
        data = self._ar.data
        out = []
        while (values := data.get(str(self.received))) is not None:
            out.append(StepMetrics(step=values[keys.STEP], rank=self.rank, values=values))
            self.received += 1
        return out


class History:
    """Per-step records across ranks: the `history` of a result.

    The loss of a step is the mean of the ranks' losses weighted by the targets each counted
    (engine/objective.py): the loss over the whole global batch.
    """

    def __init__(self, world_size: int, batch_size: int) -> None:
        self.world_size, self.batch_size = world_size, batch_size
        self._pending: dict[int, dict[int, Mapping[str, Any]]] = {}
        self.steps: list[dict[str, Any]] = []
        self.records: list[StepMetrics] = []
        self._loss_ranks: list[int] | None = None  # the ranks that report a loss (first row's)

    def log(self, metrics: Mapping[str, Any], step: int, rank: int) -> None:
        self.records.append(StepMetrics(step, rank, metrics))
        ranks = self._pending.setdefault(step, {})
        ranks[rank] = metrics
        if len(ranks) == self.world_size:
            self.steps.append(self._combine(step, self._pending.pop(step)))

    def settle(self, lost: Sequence[int]) -> list[int]:
        """After a failure: close the steps that every rank finished although the ranks in
        `lost` (whose engines died or were killed) could not send their metrics for them.

        A rank sends its steps in batches (engine/wire/publish.py), so an engine killed outright
        takes up to half a second of its steps with it, in a fast run most of the run
        (issue 17: a run killed in step 23 showed step 1). Every step ends in a collective
        of all ranks (gradient all-reduce or reduce-scatter, the pipeline's backward sends),
        so a step that the surviving ranks reported was finished by every rank. Its row is
        combined from the ranks that reported it: `lost_ranks` names the others, their
        `rank_losses` are NaN and `loss` is over the part of the batch that was reported
        (NaN when no reporting rank computes a loss). Returns the steps settled."""
        settled = []
        for step in sorted(self._pending):
            ranks = self._pending[step]
            missing = sorted(set(range(self.world_size)) - set(ranks))
            if not set(missing) <= set(lost):
                break  # a surviving rank never finished this step: nor any later one
            self.steps.append(self._combine(step, self._pending.pop(step), missing))
            settled.append(step)
        return settled

    def last_steps(self) -> dict[int, int]:
        """The last step each rank reported (0: none)."""
        last = dict.fromkeys(range(self.world_size), 0)
        for rec in self.records:
            last[rec.rank] = max(last[rec.rank], rec.step)
        return last

    def memory(self, rank: int) -> dict[str, float]:
        """The rank's memory telemetry from the last step it reported."""
        for rec in reversed(self.records):
            if rec.rank == rank:
                return {k: v for k, v in rec.values.items() if k.startswith(keys.MEMORY_PREFIX)}
        return {}

    def _combine(
        self, step: int, ranks: dict[int, Mapping[str, Any]], missing: Sequence[int] = ()
    ) -> dict[str, Any]:
        first = ranks[min(ranks)]
        slowest = max(m[keys.STEP_TIME] for m in ranks.values())
        # every data-parallel rank reports a loss; in a pipeline, only each replica's last stage
        if self._loss_ranks is None:
            self._loss_ranks = [r for r in sorted(ranks) if keys.LOSS in ranks[r]]
        reporting = [ranks[r] for r in sorted(ranks) if keys.LOSS in ranks[r]]
        losses = [ranks[r][keys.LOSS] if r in ranks else math.nan for r in self._loss_ranks]
        row: dict[str, Any] = {
            keys.STEP: step,
            keys.EPOCH: first[keys.EPOCH],
            keys.LOSS: _global_loss(reporting),
            keys.RANK_LOSSES: losses,
            keys.LR: first[keys.LR],
            keys.STEP_TIME: slowest,
            keys.THROUGHPUT: self.batch_size / slowest,
        }
        for key in COPIED:
            if key in first:
                row[key] = first[key]
        if keys.TOKENS in first:  # token-id inputs: tokens per sample x global samples per second
            row[keys.TOKEN_THROUGHPUT] = row[keys.THROUGHPUT] * (
                first[keys.TOKENS] / first[keys.SAMPLES]
            )
        if keys.IDLE in first:  # pipelines: mean busy and idle time of the engines
            row[keys.BUSY] = sum(
                m[keys.BUSY_FORWARD] + m[keys.BUSY_BACKWARD] for m in ranks.values()
            ) / len(ranks)
            row[keys.IDLE] = sum(m[keys.IDLE] for m in ranks.values()) / len(ranks)
        if keys.EXPERT_TOKENS in first:  # each expert's pairs over the whole global batch
            counts = [m[keys.EXPERT_TOKENS] for m in ranks.values() if keys.EXPERT_TOKENS in m]
            row[keys.EXPERT_TOKENS] = [sum(c) for c in zip(*counts, strict=True)]
        if missing:
            row[keys.LOST_RANKS] = list(missing)
        return row

    def close(self) -> None:
        pass


def _global_loss(reporting: list[Mapping[str, Any]]) -> float:
    """The loss over the whole global batch: each reporting rank's mean weighted by the targets
    it counted (equal shares of samples count alike unless integer targets hold -100)."""
    if not reporting:  # settled after a failure: the ranks with the loss were lost
        return math.nan
    counts = [m.get(keys.COUNTED, 1.0) for m in reporting]
    total = sum(counts)
    if not total:
        return sum(m[keys.LOSS] for m in reporting) / len(reporting)
    return sum(m[keys.LOSS] * c for m, c in zip(reporting, counts)) / total
