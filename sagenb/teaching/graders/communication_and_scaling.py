"""The checks of notebook 08 (08_communication_and_scaling.ipynb)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sagenb.sizing.estimates import estimate
from sagenb.teaching.exercises import check_equal, check_number, draw

#: the engines of exercise 1 and the GiB limit of exercise 3, one student's of these
ENGINES = (4, 8, 16, 32)
#: (for the 1B GPT's 3.78 + 3.78 + 7.55 GiB: 10, 7, 6, 5 and 3 GPUs, none of them a power of 2,
#: which is all the table above the exercise lists)
LIMIT_GIB = (5.0, 5.5, 6.0, 6.5, 9.0)


def figures(student: Any) -> dict[str, Any]:
    """This student's figures for the exercises."""
    return {
        "engines": draw(student, ENGINES, what="08 engines"),
        "limit_gib": draw(student, LIMIT_GIB, what="08 limit"),
    }


def exercise_1(answer: Any, data_run: Any, student: Any) -> None:
    """MB each engine sends per step, from the estimate on this student's engine count."""
    n = figures(student)["engines"]
    sent = estimate(data_run.source, data_run.config, engines=n).footprint.comm_bytes_per_step
    check_number(
        1,
        answer,
        measured=sent[0]["all_reduce"] / 1e6,
        rel=0.02,
        what=f"the MB the estimate says each of {n} engines sends",
        hint="a ring all-reduce sends 2(N-1)/N of the buffer, per rank",
        mistakes={
            0.5: "a factor of 2: count both halves of the ring, the reduce-scatter and the "
            "all-gather",
            n / (2 * (n - 1)): "the whole buffer: a rank sends only what its neighbours lack",
        },
    )


def exercise_2(answer: Any, fit: Any) -> None:
    """The message size where the fitted bandwidth term equals the latency term."""
    check_number(
        2,
        answer,
        measured=fit.alpha_s / fit.beta_s_per_byte,
        rel=0.02,
        what="the size where this run's fit has n x beta = alpha",
        hint="solve alpha = n x beta with fit.alpha_s and fit.beta_s_per_byte",
    )


def smallest_zero2_gpus(p: float, g: float, o: float, limit: float) -> int:
    """The fewest GPUs on which ZeRO-2 (gradients and optimizer state divided by N, the
    parameters whole) holds under `limit` GiB a GPU: P + (G + O) / N < limit."""
    if p >= limit:
        raise ValueError(f"limit={limit}: the parameters alone take {p:.2f} GiB")
    return math.floor((g + o) / (limit - p)) + 1


def exercise_3(answer: Any, pgo: tuple[float, float, float], student: Any) -> None:
    """The fewest GPUs under this student's limit, from the estimate's P, G and O."""
    limit = figures(student)["limit_gib"]
    check_equal(
        3,
        answer,
        expected=smallest_zero2_gpus(*pgo, limit),
        what=f"the fewest GPUs on which ZeRO-2's model state is under {limit} GiB",
        hint="ZeRO-2 keeps P whole and divides G + O by the GPUs; solve for N, then round",
    )


def exercise_4(
    answer: Any, step_time: Callable[[Any], float], one_engine: Any, strong_4: Any
) -> None:
    """Strong-scaling efficiency on 4 engines: t(1) / (4 t(4))."""
    check_number(
        4,
        answer,
        measured=step_time(one_engine) / (4 * step_time(strong_4)),
        absolute=0.02,
        what="the strong-scaling efficiency on 4 engines",
        hint="the same global batch: ideal is t(1) / 4",
    )
