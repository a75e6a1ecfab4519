"""The checks of notebook 02 (02_model_parallel.ipynb)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from sagenb.teaching.bubble_lab import LabPoint, smallest_m
from sagenb.teaching.exercises import check_equal, check_number, check_same_model, idle_share


def exercise_1(answer: Any, gpipe: Any, one_f_one_b: Any, peak: Callable[[Any], Any]) -> None:
    """GPipe / 1F1B peak activations of stage 0, carried from m = 8 to m = 16: GPipe's stage 0
    holds all m microbatches, 1F1B's p of them, so the ratio grows as m."""
    at_8 = peak(gpipe)[0] / peak(one_f_one_b)[0]
    check_number(
        1,
        answer,
        measured=at_8 * 16 / 8,
        rel=0.10,
        what="the ratio measured at m = 8, carried to m = 16",
        hint="write each schedule's peak as (microbatches held) x (one microbatch's "
        "activations): which factor changes with m, and which does not?",
        mistakes={0.5: "a factor of 2: the ratio at m = 8; what changes when m doubles?"},
    )


def exercise_2(answer: Any, gpipe: Any) -> None:
    """The GPipe run's measured idle share, the mean over its stages."""
    check_number(
        2,
        answer,
        measured=statistics.mean(idle_share(gpipe.metrics, skip=2).values()),
        absolute=0.02,
        what="the measured idle share of GPipe's stages",
        hint="sum each kind over the steps first, then divide; leave out steps 1 and 2",
    )


def exercise_3(answer: Any, hybrid: Any) -> None:
    """The student's one-process loop against the hybrid run's parameters."""
    check_same_model(
        3, answer, expected=hybrid.state_dict(), atol=1e-5, what="the hybrid run on 4 engines"
    )


def exercise_4(answer: Any, lab: Sequence[LabPoint]) -> None:
    """The smallest m of the sweep whose measured GPipe idle share on p = 2 is under 0.6 x
    the one at m = 1 (0 where none is)."""
    at_1 = next(
        pt.idle_share
        for pt in lab
        if (pt.partitions, pt.schedule, pt.microbatches) == (2, "gpipe", 1)
    )
    check_equal(
        4,
        answer,
        expected=smallest_m(lab, partitions=2, schedule="gpipe", below=0.6 * at_1) or 0,
        what="the smallest m of the sweep whose measured idle share is under 0.6 x m = 1's",
        hint="read the p = 2 GPipe points in increasing m; compare each idle_share with 0.6 x "
        "the one at m = 1",
    )
