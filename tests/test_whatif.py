"""The what-if view: Amdahl's law fitted to runs of different sizes, and the 10 h -> 1 h case."""

from __future__ import annotations

import pytest

import sagenb
from sagenb.sizing.whatif import Scaling, fit_scaling, teaching_case, what_if

from .conftest import REGRESSION_CELL


def test_perfect_scaling_gives_ten_times_faster_at_the_same_cost():
    perfect = Scaling({1: 100.0, 2: 200.0}, 1.0)
    one, ten = what_if(perfect, samples=3.6e6, instance="ml.g5.xlarge", instances=(1, 10))
    assert ten.hours == pytest.approx(one.hours / 10)
    assert ten.on_demand_usd == pytest.approx(one.on_demand_usd)
    text = teaching_case(perfect, instance="ml.g5.xlarge")
    assert "perfect scaling (p = 1): on 10 instances 1.00 h, $14 (vs $14 on one)" in text


def test_a_serial_part_makes_ten_instances_slower_and_dearer():
    amdahl = Scaling({1: 100.0}, 0.9)
    one, ten = what_if(amdahl, samples=3.6e6, instance="ml.g5.xlarge", instances=(1, 10))
    assert ten.hours == pytest.approx(one.hours * (0.1 + 0.9 / 10))
    assert ten.on_demand_usd > one.on_demand_usd
    assert ten.spot_usd == pytest.approx(0.3 * ten.on_demand_usd)


def test_fit_on_real_runs_of_one_and_two_engines(pool):
    runs = [
        sagenb.train(
            REGRESSION_CELL, engines=n, threads=1, batch_size=16, epochs=3, dashboard=False
        )
        for n in (1, 2)
    ]
    scaling = fit_scaling(runs)
    assert set(scaling.throughput) == {1, 2}
    assert 0.0 <= scaling.parallel_fraction <= 1.0
    # the fit passes through the measured 2-engine speed when it can (p within [0, 1])
    measured = scaling.throughput[2] / scaling.throughput[1]
    if 0.5 <= measured <= 1.0 / 0.5:
        assert scaling.speedup(2) == pytest.approx(min(max(measured, 1.0), 2.0), rel=1e-6)
    assert "fitted to runs of this job (1 engine:" in scaling.assumption
    # what_if counts `samples` (the dataset's size) as these runs would: 3 epochs of 16
    assert scaling.config == runs[0].config
    (row,) = what_if(scaling, samples=160, instance="ml.g5.xlarge", instances=(1,))
    assert row.steps == 3 * 10
    assert row.hours == pytest.approx(3 * 160 / scaling.throughput[1] / 3600)
    with pytest.raises(ValueError, match="need a run on 1 engine"):
        fit_scaling(runs[1:])
