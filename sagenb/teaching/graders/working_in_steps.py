"""The checks of notebook 09 (09_working_in_steps.ipynb)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sagenb.teaching.exercises import check_equal


def exercise_1(answer: Any, result: Any) -> None:
    """The optimizer steps of the second segment."""
    second = [row for row in result.history if row["step"] >= result.segments[1]]
    check_equal(
        1,
        answer,
        expected=len(second),
        what="the number of steps the history holds from the second segment's first step",
        hint="--steps is the run's total, as with --resume, not the steps to add",
    )


def exercise_2(answer: Any, held_per_rank: Mapping[int, int]) -> None:
    """The parameters rank 0 held, as the engines counted them."""
    check_equal(
        2,
        answer,
        expected=held_per_rank[0],
        what="the parameters rank 0 held, counted on the engine by on_engines",
        hint="a parameter of n rows gives rank 0 ceil(n / 2) of them; the tied embedding and "
        "head are one parameter",
    )
