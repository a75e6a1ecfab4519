"""The checks of notebook 04 (04_time_and_money.ipynb)."""

from __future__ import annotations

from typing import Any

from sagenb.sizing.cost import CostMeter, instance_price
from sagenb.teaching.exercises import check_choice, check_number, draw

#: the engines of exercise 3, one student's of these
ENGINES = (5, 6, 7, 10, 11)  # ratios at least 4% apart: a neighbour's answer fails


def figures(student: Any) -> dict[str, int]:
    """This student's figures for the exercises."""
    return {"engines": draw(student, ENGINES, what="04 engines")}


def exercise_1(answer: Any, scaling: Any) -> None:
    """Amdahl's speed-up on 4 engines from the fitted parallel fraction."""
    check_number(
        1,
        answer,
        measured=scaling.speedup(4),
        rel=0.02,
        what="the speed-up the fitted Amdahl law gives for 4 engines",
        hint="speedup(n) = 1 / ((1 - p) + p / n), with this run's p",
    )


def exercise_2(answer: Any) -> None:
    """Why the estimate and what_if part on 2 x p4d."""
    options = {
        "a": "--epochs counted by one only",
        "b": "the network between instances",
        "c": "spot against on-demand",
        "d": "a lower MFU",
    }
    wrong = {
        "a": "both count the same samples and epochs: they agree on one instance",
        "c": "both tables give hours, which no price enters",
        "d": "the estimate's MFU is an assumption of its own, the same for every instance "
        "count (est.assumptions)",
    }
    check_choice(2, answer, options=options, correct="b", wrong=wrong)


def exercise_3(answer: Any, student: Any) -> None:
    """An hour of this student's engines on ml.g5.12xlarge (4 GPUs) against ml.g5.xlarge (1)."""
    engines = figures(student)["engines"]
    hour = {
        name: CostMeter(instance_price(name), engines=engines).cost(3600)
        for name in ("ml.g5.12xlarge", "ml.g5.xlarge")
    }
    check_number(
        3,
        answer,
        measured=hour["ml.g5.12xlarge"] / hour["ml.g5.xlarge"],
        rel=0.02,
        what=f"the ratio of the two hours' cost for {engines} engines",
        hint="instances = ceil(engines / GPUs per instance): a partly used instance bills whole",
    )
