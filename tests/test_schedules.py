"""torch's looped breadth-first and interleaved zero-bubble schedules (issue 30 item 4): each
equals one process on a real 2-engine pipeline, zero bubble records its weights' gradients (W)
apart from the input's (B); the orders the estimate and the planner read are torch's own; the
bubble each order implies on equal stages is the known formula where there is one, and zero
bubble's below interleaved 1F1B's (that zero bubble's order is torch's own:
tests/test_private_apis.py); bad values are refused with the numbers."""

from __future__ import annotations

import pytest

import sagenb
from sagenb.config import ConfigError
from sagenb.engine.strategies.pipeline import bubble_fraction
from sagenb.engine.strategies.pipeline.orders import ideal_bubble
from sagenb.metrics import keys

from .helpers import check_equal
from .models import GPT_CELL

OPTIONS = dict(batch_size=32, steps=4)
PIPELINE = dict(strategy="model", partitions=2, virtual_stages=2, microbatches=4)


@pytest.mark.parametrize("schedule", ["looped-bfs", "zero-bubble"])
def test_a_schedule_of_torchs_trains_like_one_process(pool, schedule):
    result = sagenb.train(GPT_CELL, schedule=schedule, dashboard=False, **PIPELINE, **OPTIONS)
    check_equal(result, GPT_CELL, **OPTIONS)
    last = [rec.values for rec in result.metrics if rec.step == OPTIONS["steps"]]
    assert {tuple(v["stages"]) for v in last} == {(0, 2), (1, 3)}
    for values in last:  # each chunk-microbatch forward once, backward once (and W once)
        kinds = [event[0] for event in values["timeline"]]
        assert kinds.count("F") == kinds.count("B") == 2 * 4
        assert kinds.count("W") == (2 * 4 if schedule == "zero-bubble" else 0)
        weights = sum(e[4] - e[3] for e in values["timeline"] if e[0] in "BW")
        assert values[keys.BUSY_BACKWARD] == pytest.approx(weights, abs=1e-4)  # timeline: µs


@pytest.mark.parametrize("ranks, microbatches", [(2, 1), (2, 4), (2, 8), (4, 4), (4, 8)])
def test_the_bubble_of_each_order_on_equal_stages(ranks, microbatches):
    one = bubble_fraction(ranks, microbatches)
    for schedule in ("gpipe", "1f1b"):
        assert ideal_bubble(schedule, ranks, 1, microbatches) == pytest.approx(one)
    if microbatches < ranks:
        return  # interleaved and zero bubble need a microbatch per rank
    two = bubble_fraction(ranks, microbatches, 2)
    assert ideal_bubble("interleaved", ranks, 2, microbatches) == pytest.approx(two)
    assert ideal_bubble("looped-bfs", ranks, 2, microbatches) == pytest.approx(two)
    zero = ideal_bubble("zero-bubble", ranks, 2, microbatches)
    assert 0 < zero < 0.5 * two  # the W of later microbatches fills most of what is left


def test_the_estimate_and_the_planner_know_the_zero_bubble():
    est = sagenb.estimate(GPT_CELL, schedule="zero-bubble", batch_size=32, **PIPELINE)
    assert est.step.bubble == pytest.approx(ideal_bubble("zero-bubble", 2, 2, 4))
    assert "zero-bubble, 4 microbatches" in est.table().splitlines()[0]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(schedule="zero-bubble", virtual_stages=1), r"--virtual-stages 1: zero-bubble needs"),
        (dict(schedule="looped-bfs", virtual_stages=1), r"--virtual-stages 1: looped-bfs needs"),
        (
            dict(schedule="zero-bubble", microbatches=5),
            r"--microbatches 5: zero-bubble needs a multiple of the rounds \(2\); try 4",
        ),
    ],
)
def test_bad_values_are_refused(options, message):
    config = {**PIPELINE, **options}
    with pytest.raises(ConfigError, match=message):
        sagenb.train(GPT_CELL, dashboard=False, batch_size=40, **config)
