"""The estimate before a run (issue 16): the fit verdict and its advice, the time and cost
ranges, the hardware table and its override, bad input, %%smp_plan without a pool, and the
live cost's "this run" / "projected on I" labels. Every estimate here is the real footprint
of the cell on fake tensors: no engine starts (the pool is checked before and after)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from IPython.core.error import UsageError

import sagenb
from sagenb.config import ConfigError, TrainConfig
from sagenb.config.job import Job
from sagenb.display.dashboard import Dashboard
from sagenb.metrics import keys
from sagenb.notebook.examples import gpt_cell
from sagenb.pool import cluster
from sagenb.sizing.cost import CostMeter, instance_price, seconds_span, seconds_text
from sagenb.sizing.hardware import hardware_table
from sagenb.sizing.projection import DEFERRED, LATER_RUN, Projection, saturates
from sagenb.sizing.step_model import MFU_RANGE, memory_limit_mib

from .conftest import REGRESSION_CELL
from .models import GPT_CELL

P4D = "ml.p4d.24xlarge"
#: a GPT whose activations at a global batch of 1024 (128 samples of 2048 tokens per rank)
#: overflow an A100's 40 GB in fp32, and fit with activation checkpointing
WIDE_GPT = gpt_cell(layers=4, width=1024, heads=16, vocab=1024, context=2048, samples=4096)


@pytest.fixture
def no_pool():
    """The estimate must never start engines: none runs before, none after."""
    cluster.stop_pool()
    yield
    assert cluster.current_pool() is None, "an estimate started an engine pool"


def test_a_small_gpt_fits_and_every_figure_is_a_range(no_pool):
    # 100 steps in all: --steps, with epochs enough for them over the cell's 128 samples
    est = sagenb.estimate(GPT_CELL, instance=P4D, engines=8, batch_size=64, steps=100, epochs=50)
    assert est.fits and est.advice is None
    assert len(est.ranks) == 8
    assert set(est.ranks[0]) >= {keys.memory(k) for k in keys.MEMORY_KINDS}
    for low, high in (est.step_time_s, est.hours, est.cost_usd, est.spot_usd):
        assert 0 < low <= high
    price = instance_price(P4D)
    assert est.hours[1] == pytest.approx(100 * est.step_time_s[1] / 3600)
    assert est.cost_usd[1] == pytest.approx(est.hours[1] * price.usd_per_hour)  # 8 GPUs, 1 box
    assert est.spot_usd[1] == pytest.approx(0.3 * est.cost_usd[1])
    text = repr(est)
    for assumption in ("MFU 0.3-0.5", "19.5 TFLOPS fp32", "usable", "GB/s per rank"):
        assert assumption in text
    assert "arXiv:2204.02311" in text and price.as_of in text


def test_the_time_scales_with_the_instances_as_the_model_says(no_pool):
    est = sagenb.estimate(GPT_CELL, instance=P4D, engines=8, batch_size=64, steps=100)
    peak = hardware_table()[P4D].peak("fp32") * 1e12
    rows = {row.instances: row for row in est.scaling}
    assert sorted(rows) == [1, 2, 4, 8]
    for k, row in rows.items():
        assert row.engines == 8 * k
        compute_low = est.flops_per_step / (row.engines * peak * MFU_RANGE[1])
        compute_high = est.flops_per_step / (row.engines * peak * MFU_RANGE[0])
        low, high = row.step_time_s
        assert low >= compute_low * (1 - 1e-9) and high >= compute_high * (1 - 1e-9)
        assert row.cost_usd[0] == pytest.approx(k * instance_price(P4D).usd_per_hour * row.hours[0])
    # one instance: all traffic on NVLink; from two on, the ring crosses EFA
    assert rows[1].step_time_s == pytest.approx(est.step_time_s)
    # the chart of the same rows, drawn by the display (the package's face gives its drawer)
    assert [(t.name, len(t.x)) for t in est.figure().data] == [
        ("hours (low-high)", 4),
        ("on-demand (low-high)", 4),
        ("spot (low-high)", 4),
    ]


def test_a_model_that_does_not_fit_says_what_would(no_pool):
    est = sagenb.estimate(WIDE_GPT, instance=P4D, engines=8, batch_size=1024, steps=10)
    assert not est.fits
    worst = max(est.rank_totals())
    assert worst > memory_limit_mib(est.hardware)
    # bf16 is tried first (autocast keeps fp32 copies: not enough here), then checkpointing
    assert est.advice and "it would fit with --activation-checkpointing" in est.advice
    assert "does NOT fit" in est.table()


def test_an_own_hardware_table_replaces_the_package_one(tmp_path, no_pool):
    table = {
        "as_of": "2099-01",
        "instances": {
            P4D: {
                "accelerator": "doubled A100",
                "accelerators": 8,
                "fp32_tflops": 39.0,
                "accelerator_memory_gib": 40,
                "intra_instance_gb_s": 300,
                "inter_instance_gbit_s": 400,
                "sources": ["my own measurements"],
            }
        },
    }
    path = tmp_path / "hardware.json"
    path.write_text(json.dumps(table))
    base = sagenb.estimate(GPT_CELL, instance=P4D, engines=1, batch_size=64, steps=10)
    mine = sagenb.estimate(
        GPT_CELL, instance=P4D, engines=1, batch_size=64, steps=10, hardware_table=str(path)
    )
    assert mine.step.compute_s[1] == pytest.approx(base.step.compute_s[1] / 2)
    assert "2099-01" in mine.table() and "my own measurements" in mine.table()
    path = tmp_path / "bad.json"  # (tables are cached by path, as price tables are)
    path.write_text(json.dumps({"instances": {P4D: {"accelerators": 8}}}))
    with pytest.raises(ConfigError, match=r"--hardware-table .*accelerator_memory_gib"):
        sagenb.estimate(GPT_CELL, instance=P4D, engines=1, batch_size=64, hardware_table=str(path))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"instance": "ml.x9.huge"}, r"--instance 'ml.x9.huge': must be one of"),
        (
            {"instance": "ml.c5.xlarge", "precision": "bf16"},
            r"--precision 'bf16': --instance ml.c5.xlarge .*has no bf16 peak",
        ),
        (
            {"strategy": "model", "partitions": 2, "engines": 3},
            r"--engines 3|--batch-size",
        ),
        ({"strategy": "tensor", "engines": 4, "tensor_parallel": 3}, r"--tensor-parallel 3"),
        ({"engines": 3, "batch_size": 64}, r"--batch-size 64: must be divisible"),
    ],
)
def test_bad_input_is_a_clear_error_before_anything_runs(options, message, tmp_path, no_pool):
    marker = tmp_path / "ran"
    cell = f"open({str(marker)!r}, 'w').close()\n" + GPT_CELL
    with pytest.raises(ConfigError, match=message):
        sagenb.estimate(cell, **{"batch_size": 64, **options})
    assert not marker.exists(), "the cell ran before the bad option was refused"


def test_the_magic_answers_without_a_pool(shell, capsys, no_pool):
    line = f"--instance {P4D} --engines 16 --strategy sharded --batch-size 64 --steps 10"
    shell.run_cell_magic("smp_plan", line, GPT_CELL)
    out = capsys.readouterr().out
    assert "estimate: sharded (ZeRO-3) on 16 engines = 2 x ml.p4d.24xlarge" in out
    assert "fits:" in out and "assumptions:" in out and "on-demand" in out
    assert isinstance(shell.user_ns["smp_estimate"], sagenb.Estimate)
    shell.run_cell_magic("smp_plan", "--strategy model --partitions 2 --batch-size 32", GPT_CELL)
    assert "%smp_cluster start, then %%smp_plan again" in capsys.readouterr().out
    with pytest.raises(UsageError, match=r"%%smp_plan: --precision 'bf16'.*ml.c5.xlarge"):
        shell.run_cell_magic("smp_plan", "--instance ml.c5.xlarge --precision bf16", GPT_CELL)


def projected_on_p4d(step_s: tuple[float, float]) -> str:
    """The run's projection on a p4d, 100 steps of `step_s` (low, high) seconds each."""
    return CostMeter(instance_price(P4D), 8, projection=Projection(step_s)).projected_on(100)


def test_the_live_cost_keeps_this_run_and_the_projection_apart():
    p4d = instance_price(P4D)
    here = CostMeter(p4d, 2, runs_on="cpu")
    assert not here.billed_here
    assert here.this_run(1.5) == "this run: 1.5 s on cpu (not a ml.p4d.24xlarge: not priced as one)"
    assert "no estimate" in here.projected_on(10)
    on_a100 = CostMeter(p4d, 8, runs_on="NVIDIA A100-SXM4-40GB", projection=Projection((0.5, 1.0)))
    assert on_a100.billed_here and on_a100.this_run(3600).startswith("this run: $37.6880 on 1")
    assert on_a100.projected_on(100, 25) == (
        "projected on 1 x ml.p4d.24xlarge: 50-100 s, $0.5234-$1.0469 (estimate, 25/100 steps done)"
    )
    # a span of time in a unit that needs no exponent, chosen by its upper end; cents'
    # hundredths, or less than one
    spans = {
        (2.17e-7, 5.15e-7): "21.7-51.5 µs, under $0.0001",
        (2e-6, 5e-4): "0.2-50 ms, up to $0.0005",
        (2, 12): "3.33-20 min, $2.0938-$12.5627",
        (400, 800): "11.1-22.2 h, $418.7556-$837.5111",
    }
    for step_s, text in spans.items():
        assert f"ml.p4d.24xlarge: {text} (estimate)" in projected_on_p4d(step_s)
    assert (seconds_text(0), seconds_text(7.14e-6), seconds_text(90)) == ("0 s", "7.14 µs", "90 s")
    assert CostMeter(instance_price("ml.c5.xlarge"), 1, runs_on="cpu").billed_here
    assert not CostMeter(p4d, 8, runs_on="NVIDIA H200").billed_here
    config = TrainConfig(engines=2, batch_size=8)
    meter = CostMeter(p4d, 2, runs_on="cpu", projection=Projection((0.1, 0.2)))
    board = Dashboard(config, meter, live=False)
    board.log({"step": 1, "total_steps": 4, "epoch": 0, "loss": 1.0, "lr": 0.1}, 1, 0)
    board.elapsed = 1.5
    header = board.header_text()
    assert "this run: 1.5 s on cpu (not a ml.p4d.24xlarge" in header
    assert (
        "projected on 1 x ml.p4d.24xlarge: 0.4-0.8 s" in header
        and "$" not in header.split("this run")[1].split("|")[0]
    )


def test_a_run_after_an_estimate_is_projected_from_it(pool):
    options = dict(engines=2, batch_size=32, steps=4, dashboard=False)
    est = sagenb.estimate(REGRESSION_CELL, **options)
    result = sagenb.train(REGRESSION_CELL, estimate=est, **options)
    summary = result.summary()
    assert "this run:" in summary and f"on cpu (not a {P4D}" in summary
    low, high = (4 * s for s in est.step_time_s)
    assert f"projected on 1 x {P4D}: {seconds_span(low, high)}" in summary
    # an estimate of other options does not project this run: the run makes its own
    other = sagenb.train(REGRESSION_CELL, estimate=est, **{**options, "steps": 2})
    assert other.wait_for_projection(120), other.summary()
    low, high = (2 * s for s in est.step_time_s)
    assert f"projected on 1 x {P4D}: {seconds_span(low, high)}" in other.summary()


def test_a_run_makes_its_own_projection_off_the_notebooks_process():
    """sizing/projection.py: the estimate a run makes of itself runs in a child process, as
    `sagenb.estimate` would in the notebook; a cell the estimate cannot run says why."""
    config = TrainConfig(engines=2, batch_size=32, steps=4).with_engines(2)
    first = Projection.start(Job.of(REGRESSION_CELL), config)
    assert first.pending and first.why.startswith("estimating")
    # a cell that only runs where a process group is up (the engines): its estimate fails;
    # and it replaces the first, still pending: one child at a time
    failing = Projection.start(Job.of(NEEDS_ENGINES_CELL), config)
    assert not first.pending and first.why == LATER_RUN
    assert failing.wait(120)
    made = Projection.start(Job.of(REGRESSION_CELL), config)
    assert made.wait(120), made.why
    expected = sagenb.estimate(REGRESSION_CELL, config).step_time_s
    assert made.step_time_s == pytest.approx(expected, rel=1e-9)
    assert failing.step_time_s is None
    assert "AssertionError: the cell runs on engines only" in failing.why, failing.why
    meter = CostMeter(instance_price(P4D), 2, runs_on="cpu", projection=failing)
    assert meter.projected_on(4).startswith(f"projected on 1 x {P4D}: no estimate (AssertionError")


def test_where_the_engines_fill_the_cores_the_estimate_waits_for_the_runs_end():
    """sizing/projection.py: a child estimating beside engines that keep every core busy
    takes its CPU from their steps (20-25% of a 300-step run on 2 cores), so there it starts
    when the run ends; the header says so meanwhile."""
    cores = len(os.sched_getaffinity(0))
    assert saturates(cores) and not saturates(cores - 1)
    # a batch no other test estimates: no figure kept from before (for_run)
    config = TrainConfig(engines=2, batch_size=12, steps=4).with_engines(2)
    deferred = Projection.start(Job.of(REGRESSION_CELL), config, defer=True)
    assert deferred.pending and deferred._child is None and deferred.why == DEFERRED
    meter = CostMeter(instance_price(P4D), 2, runs_on="cpu", projection=deferred)
    assert meter.projected_on(4) == f"projected on 1 x {P4D}: {DEFERRED}"
    # a run of the same cell meanwhile does not follow an estimate that has not started
    again = Projection.for_run(None, Job.of(REGRESSION_CELL), config, defer=True)
    assert not deferred.pending and again.pending and again._child is None
    again.release()
    assert again._child is not None and again.why.startswith("estimating (in the background)")
    assert again.wait(120) and again.step_time_s is not None, again.why
    again.release()  # once only: the figure stays
    assert again.step_time_s is not None


def test_a_cell_run_again_is_projected_at_once_without_a_second_child():
    """sizing/projection.py: the figure a run's own estimate made is kept by what it
    estimated, --steps and --epochs aside (they change how many steps, not a step's cost), and
    a run of the same before it came takes the figure of the child at work; a run of other
    options makes its own."""
    # a cell of its own: figures are kept for the whole process, and another test's run of
    # REGRESSION_CELL may have made the one `other` must make
    job = Job.of(REGRESSION_CELL + "\n# projected by this test alone\n")
    config = TrainConfig(engines=2, batch_size=16, steps=4).with_engines(2)
    first = Projection.for_run(None, job, config)
    assert first.pending
    # run again before the figure came: it follows the child at work, starting none
    follows = Projection.for_run(None, job, dataclasses.replace(config, steps=2))
    assert follows.pending and follows._child is None
    assert first.wait(120) and follows.wait(10), first.why
    assert first.step_time_s is not None
    assert follows.step_time_s == first.step_time_s
    again = Projection.for_run(None, job, dataclasses.replace(config, steps=9, epochs=3))
    assert not again.pending and again._child is None
    assert again.step_time_s == first.step_time_s
    other = Projection.for_run(None, job, dataclasses.replace(config, batch_size=8))
    assert other.pending and other._child is not None
    other.cancel("not needed")


NEEDS_ENGINES_CELL = REGRESSION_CELL + (
    "\nimport torch.distributed as dist\n"
    "assert dist.is_initialized(), 'the cell runs on engines only'\n"
)


def test_what_if_takes_its_absolute_speed_from_the_estimate(no_pool):
    """what_if with an estimate: the instance's hours at the estimate's engine count are the
    estimate's, and the measured Amdahl fit scales them to the other counts."""
    est = sagenb.estimate(GPT_CELL, instance=P4D, engines=8, batch_size=64, steps=100)
    scaling = sagenb.Scaling({1: 100.0, 2: 160.0}, parallel_fraction=0.75)
    samples = 64 * 100
    one, two = sagenb.what_if(
        scaling, samples=samples, instance=P4D, instances=(1, 2), estimate=est
    )
    assert one.engines == 8 and one.hours_range == pytest.approx(
        tuple(100 * s / 3600 for s in est.step_time_s)
    )
    ratio = scaling.speedup(8) / scaling.speedup(16)
    assert two.hours_range == pytest.approx(tuple(h * ratio for h in one.hours_range))
    with pytest.raises(ValueError, match="the estimate is for ml.p4d.24xlarge"):
        sagenb.what_if(scaling, samples=samples, instance="ml.g5.xlarge", estimate=est)


def test_estimate_and_what_if_read_samples_alike(no_pool):
    """`samples=` is the dataset's size, one epoch, in both: the run's --epochs pass over it,
    so both give the same hours for the same cell on the same instance (issue 35: notebook 04's
    estimate said twice the hours what_if said, counting --epochs 2 where what_if did not)."""
    est = sagenb.estimate(
        GPT_CELL, instance=P4D, engines=8, batch_size=64, epochs=2, samples=64_000
    )
    assert est.steps == 2 * 1000
    assert (
        "2,000 steps = --epochs 2 x 1,000 steps of 64 samples (samples=64,000: the dataset's "
        "size, one epoch)"
    ) in est.table()
    scaling = sagenb.Scaling({1: 100.0, 2: 160.0}, parallel_fraction=0.75, config=est.config)
    (row,) = sagenb.what_if(scaling, samples=64_000, instance=P4D, instances=(1,), estimate=est)
    assert row.steps == est.steps
    assert row.hours_range == pytest.approx(est.hours, rel=1e-12)
    # without the estimate, the measured runs' --epochs and --batch-size count them the same
    (here,) = sagenb.what_if(scaling, samples=64_000, instance="ml.g5.xlarge", instances=(1,))
    assert here.steps == est.steps
    assert here.hours == pytest.approx(2 * 64_000 / 100.0 / 3600)
    # --steps caps both, as it caps the run
    capped = sagenb.estimate(GPT_CELL, est.config, samples=64_000, steps=500)
    assert capped.steps == 500 and "capped at --steps" in capped.table()
    for bad in (0, -5, "many", True):
        with pytest.raises(ConfigError, match="--samples .*: must be a number >= 1"):
            sagenb.what_if(scaling, samples=bad, instance=P4D, estimate=est)
