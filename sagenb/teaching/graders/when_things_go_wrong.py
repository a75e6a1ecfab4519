"""The checks of notebook 05 (05_when_things_go_wrong.ipynb)."""

from __future__ import annotations

from typing import Any

from sagenb.teaching.exercises import check_equal, draw

CRASH = 23  # CRASHING_JOB's rank 1 dies in its 23rd step
MEASURED_EVERY = 5  # the crashed run's checkpoint_every
#: the interval of exercise 1, one student's of these
EVERY = (6, 7, 8, 11, 12)  # each resumes at another step, and none where 5 did


def figures(student: Any) -> dict[str, int]:
    """This student's figures for the exercises."""
    return {"every": draw(student, EVERY, what="05 every")}


def _resumes_at(every: int) -> int:
    """The first step of a resume after the crash: the newest checkpoint before it, + 1."""
    return (CRASH - 1) // every * every + 1


def exercise_1(answer: Any, resumed: Any, student: Any) -> None:
    """Where the resume begins with this student's checkpoint interval."""
    start = resumed.history[0]["step"]
    if start != _resumes_at(MEASURED_EVERY):
        raise ValueError(f"the resumed run began at step {start}, not after the newest checkpoint")
    every = figures(student)["every"]
    check_equal(
        1,
        answer,
        expected=_resumes_at(every),
        what=f"the step after the newest checkpoint written before step {CRASH}, every {every}",
        hint=f"with every {MEASURED_EVERY} it began at {start}: the newest complete checkpoint "
        "was the last multiple of the interval before the crash",
    )


def exercise_2(answer: Any, part: Any, finished: Any) -> None:
    """The steps an interrupt made the resumed run compute again."""
    check_equal(
        2,
        answer,
        expected=len(part.history) - (finished.history[0]["step"] - 1),
        what="the steps before the interrupt that the resumed run computed again",
        hint="compare the steps done before the interrupt with the step the resume began at: "
        "an interrupt writes its checkpoint at the step where every rank stopped",
    )
