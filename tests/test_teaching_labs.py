"""The arithmetic behind two lessons: notebook 02's bubble lab (sagenb/teaching/bubble_lab.py)
and notebook 05's checkpoint interval (sagenb/teaching/checkpoint_interval.py). Fast lane: no
engines; the metrics are records as the pipeline's engines publish them, with hand-made
timelines, and the formulas are held to values computed by hand. tests/test_notebooks.py runs
both on the notebooks' real runs."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest

from sagenb.config import TrainConfig
from sagenb.metrics import keys
from sagenb.metrics.stream import StepMetrics
from sagenb.teaching import bubble_lab
from sagenb.teaching import checkpoint_interval as ci


# -- the checkpoint interval ---------------------------------------------------------------------
def test_young_and_daly_against_hand_computed_values():
    # C = 18 s, M = 1 h: sqrt(2 x 18 x 3600) = sqrt(129600) = 360 s
    assert ci.young_interval(18, 3600) == pytest.approx(360, rel=1e-12)
    # C / 2M = 0.0025, its root 0.05: 360 x (1 + 0.05 / 3 + 0.0025 / 9) - 18 = 348.1 s
    assert ci.daly_interval(18, 3600) == pytest.approx(348.1, rel=1e-12)
    # Daly (2006): once the write takes 2M or more, checkpoint every M
    assert ci.daly_interval(8000, 3600) == 3600


def test_waste_against_hand_computed_values():
    # tau = 360 s, C = 18 s, M = 3600 s: (tau + C) / M = 0.105, e^0.105 - 1 = 0.1107106
    # (its series to the 5th power), x 3600 = 398.5582 s of wall time per 360 s of work:
    # 1 - 360 / 398.5582 = 1 - 0.9032557 = 0.0967443
    assert ci.waste(360, 18, 3600) == pytest.approx(0.0967443, abs=1e-6)
    # a restart of M ln 2 doubles the wall time: 1 - 0.9032557 / 2 = 0.5483722
    with_restart = ci.waste(360, 18, 3600, restart_s=3600 * math.log(2))
    assert with_restart == pytest.approx(0.5483722, abs=1e-6)
    # the llama 3 rate: 16,384 GPUs x 1,296 h / 419 failures; 16,384 GPUs: 4,665,600 s / 419
    assert ci.LLAMA3_GPU_HOURS_PER_FAILURE == pytest.approx(16_384 * 1_296 / 419)
    assert ci.job_mtbf_s(16_384) == pytest.approx(11_135.08, abs=0.01)


def _argmin_waste(write_s: float, mtbf_s: float) -> float:
    """The interval of least waste, by golden-section search on Daly's exact model."""
    lo, hi = write_s * 1e-3, 3 * mtbf_s
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if ci.waste(a, write_s, mtbf_s) < ci.waste(b, write_s, mtbf_s):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


@pytest.mark.parametrize("ratio", [1e-4, 1e-2, 0.1])
def test_daly_is_the_least_waste_and_young_its_first_order(ratio):
    """Daly's interval within 1% of the exact model's minimum for C/M up to 0.1 (his paper's
    claim is a good estimate while C < 2M); Young's, a first-order estimate, drifts from it as
    C/M grows (13% long at C/M = 0.1), and the waste at either is within 1% of the least."""
    mtbf = 3600.0
    write = ratio * mtbf
    best = _argmin_waste(write, mtbf)
    assert ci.daly_interval(write, mtbf) == pytest.approx(best, rel=0.01)
    young = ci.young_interval(write, mtbf)
    assert young >= best
    least = ci.waste(best, write, mtbf)
    assert ci.waste(ci.daly_interval(write, mtbf), write, mtbf) <= least * 1.0001
    assert ci.waste(young, write, mtbf) <= least * 1.01
    if ratio >= 0.1:
        assert young / best > 1.1


def test_the_waste_table_has_a_line_per_interval():
    lines = ci.waste_table(18, 3600, [90, 360, 1440]).splitlines()
    assert len(lines) == 4 and lines[2].split() == ["360", f"{ci.waste(360, 18, 3600) * 60:.2f}"]


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: ci.young_interval(0, 3600), "write_s=0.0"),
        (lambda: ci.daly_interval(18, -1), "mtbf_s=-1.0"),
        (lambda: ci.waste(math.nan, 18, 3600), "interval_s=nan"),
        (lambda: ci.waste(360, 18, 3600, restart_s=-5), "restart_s=-5"),
        (lambda: ci.job_mtbf_s(0), "gpus=0"),
        (lambda: ci.job_mtbf_s(8, gpu_hours_per_failure=0), "gpu_hours_per_failure=0.0"),
    ],
)
def test_bad_input_names_the_argument_and_value(call, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        call()


# -- the bubble lab -------------------------------------------------------------------------------
def _step(step: int, rank: int, t0: float, events: list, activations: float = 1.0) -> StepMetrics:
    """A pipeline rank's record: its timeline relative to its own t0, as the engines send it."""
    busy_f = sum(e - s for k, _, _, s, e in events if k == "F")
    busy_b = sum(e - s for k, _, _, s, e in events if k == "B")
    return StepMetrics(
        step,
        rank,
        {
            keys.TIMELINE: events,
            keys.TIMELINE_T0: t0,
            keys.BUSY_FORWARD: busy_f,
            keys.BUSY_BACKWARD: busy_b,
            keys.IDLE: max(e for *_, e in events) - busy_f - busy_b,
            keys.MEMORY_ACTIVATIONS: activations,
        },
    )


def _gpipe_one_microbatch(step: int, offset: float = 0.0, late: float = 0.0) -> list[StepMetrics]:
    """p = 2, m = 1, every forward and backward 1 s: stage 0 F [0, 1], B [3, 4]; stage 1 F
    [1, 2], B [2, 3]. Stage 1 entered its step `late` s after stage 0 (its t0), so its
    offsets are that much less."""
    f, b = 1.0 - late, 2.0 - late
    return [
        _step(step, 0, 100.0 + offset, [["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 3.0, 4.0]], 8.0),
        _step(step, 1, 100.0 + offset + late, [["F", 1, 0, f, f + 1], ["B", 1, 0, b, b + 1]], 4.0),
    ]


def test_the_span_idle_share_is_the_formula_on_an_ideal_schedule():
    # a span of 4 s, each stage busy 2 s: 1/2 each, (p - 1) / (m + p - 1) = 1/2
    metrics = _gpipe_one_microbatch(1, offset=-50) + _gpipe_one_microbatch(2)
    assert bubble_lab.span_idle_share(metrics, skip=1) == {0: 0.5, 1: 0.5}
    # the ranks' timelines line up by their own t0s: stage 1 entering late changes nothing
    late = _gpipe_one_microbatch(2, late=0.75)
    assert bubble_lab.span_idle_share(late, skip=1) == {0: 0.5, 1: 0.5}
    # the engines' own idle(s) leaves out stage 1's wait after its backward: 1 s of 3
    rank_1 = metrics[3].values
    assert rank_1[keys.IDLE] / (rank_1[keys.IDLE] + 2) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no pipeline step after the first 2"):
        bubble_lab.span_idle_share(metrics, skip=2)


def test_measure_reads_a_result_and_smallest_m_the_points():
    config = TrainConfig(strategy="model", partitions=2, schedule="gpipe", microbatches=1)
    result = SimpleNamespace(
        config=config, metrics=_gpipe_one_microbatch(1) + _gpipe_one_microbatch(2)
    )
    point = bubble_lab.measure(result, skip=1)
    assert (point.idle_share, point.formula, point.virtual) == (0.5, 0.5, 1)
    assert point.activations == {0: 8.0, 1: 4.0}
    points = [
        point,
        bubble_lab.LabPoint(2, "gpipe", 2, 1, idle_share=0.4),
        bubble_lab.LabPoint(2, "gpipe", 4, 1, idle_share=0.29),
        bubble_lab.LabPoint(2, "gpipe", 8, 1, idle_share=0.31),
        bubble_lab.LabPoint(2, "1f1b", 2, 1, idle_share=0.1),
    ]
    assert bubble_lab.smallest_m(points, partitions=2, schedule="gpipe", below=0.3) == 4
    assert bubble_lab.smallest_m(points, partitions=2, schedule="gpipe", below=0.2) is None
    # interleaved on p = 2 with v = 2: (p - 1) / (v m + p - 1) = 1 / 9 at m = 4
    assert bubble_lab.LabPoint(2, "interleaved", 4, 2, idle_share=0.3).formula == pytest.approx(
        1 / 9
    )
    text = bubble_lab.table(points)
    assert "gpipe" in text.splitlines()[1] and "50%" in text.splitlines()[1]


def test_the_figure_draws_as_an_svg_labelled_as_this_machines():
    points = [
        bubble_lab.LabPoint(
            p, s, m, 2 if s == "interleaved" else 1, idle_share=0.5, activations={0: 1.0}
        )
        for p in (2, 4)
        for s in ("gpipe", "1f1b", "interleaved")
        for m in (1, 2, 4)
        if not (s == "1f1b" and m < p)
    ]
    html = bubble_lab.figure(points)._repr_mimebundle_()["text/html"]
    assert html.startswith("<div class='smp-static-copy'><svg")
    assert html.count("this machine&#x27;s CPU") == 2  # each idle-share panel's title
