"""The checks of notebook 01 (01_quickstart.ipynb)."""

from __future__ import annotations

from typing import Any

from sagenb.teaching.exercises import check_equal, check_number, last_step_memory


def exercise_1(answer: Any, result: Any) -> None:
    """Samples per engine per step with 4 engines and the same global batch."""
    step_1 = sum(m.values["samples"] for m in result.metrics if m.step == 1)
    check_equal(
        1,
        answer,
        expected=step_1 // 4,
        what="the samples each of 4 engines computes per step",
        hint="add up what the ranks computed in one step: data parallel splits that global "
        "batch among the engines, however many there are",
    )


def exercise_2(answer: Any, result: Any) -> None:
    """AdamW's state per engine, against what each engine measured."""
    per_engine = last_step_memory(result.metrics, "optimizer")
    check_number(
        2,
        answer,
        measured=max(per_engine.values()),
        rel=0.05,
        what="the optimizer state each engine measured",
        hint="data parallel: every engine holds the whole model, so the whole optimizer state",
        mistakes={
            0.5: "a factor of 2: AdamW keeps two moments a parameter, on every engine",
            2.0: "a factor of 2: only the two moments, not the parameters and gradients",
        },
    )
