"""The checks of notebook 07 (07_fine_tune.ipynb)."""

from __future__ import annotations

from typing import Any

from sagenb.teaching.exercises import check_number, last_step_memory


def _optimizer(result: Any) -> float:
    return max(last_step_memory(result.metrics, "optimizer").values())


def exercise_1(answer: Any, data_run: Any) -> None:
    """AdamW's state per engine when only the adapters train."""
    check_number(
        1,
        answer,
        measured=_optimizer(data_run),
        rel=0.05,
        what="the optimizer state each engine measured",
        hint="count the parameters with requires_grad (the adapters), 8 bytes each; the frozen "
        "base has no optimizer state",
        mistakes={0.5: "a factor of 2: AdamW keeps two moments of 4 bytes a parameter"},
    )


def exercise_2(answer: Any, data_run: Any, sharded_run: Any) -> None:
    """Sharded optimizer state per engine as a fraction of data parallel's."""
    check_number(
        2,
        answer,
        measured=_optimizer(sharded_run) / _optimizer(data_run),
        rel=0.05,
        what="the measured ratio of optimizer state per engine",
        hint="each engine keeps its share of every adapter's rows, and their moments",
    )
