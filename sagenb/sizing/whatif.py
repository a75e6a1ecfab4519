"""What if: time and cost to train a dataset of N samples on k instances, from runs measured
on this job.

The teaching case is SageMaker's own example: 10 hours on one instance, about 1 hour on ten.
That holds only when the work scales perfectly, and then it costs the same (ten instances for
a tenth of the time). Real jobs keep a serial part: Amdahl's law,
speedup(n) = 1 / ((1 - p) + p / n), with p the parallel fraction. p is fitted here to the
throughput measured on runs of different sizes (least squares on 1 / speedup, which is linear
in 1 / n), and every figure says so.

`samples=` means what it means in `sagenb.estimate(samples=)`: the dataset's size, one epoch.
The run's --epochs pass over it and --steps caps it (estimates.run_steps), so both give the same
hours for the same job on the same instance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sagenb.config.options import TrainConfig
from sagenb.metrics import keys
from sagenb.metrics.result import TrainResult
from sagenb.sizing.cost import CostMeter, instance_price
from sagenb.sizing.estimates import check_samples, run_steps

if TYPE_CHECKING:
    from sagenb.sizing.estimates import Estimate, RunSteps

__all__ = ["Scaling", "fit_scaling", "what_if", "teaching_case"]


@dataclass(frozen=True)
class Scaling:
    """Measured throughput per engine count, and the Amdahl fit through it."""

    throughput: dict[int, float]  # engines -> samples/s (median over the run's steps)
    parallel_fraction: float
    #: the measured runs' options (fit_scaling: the 1-engine run's): what_if trains `samples`
    #: with their --epochs, --batch-size and --steps; None (made by hand): one pass, uncapped
    config: TrainConfig | None = None

    def speedup(self, engines: int) -> float:
        p = self.parallel_fraction
        return 1.0 / ((1 - p) + p / engines)

    @property
    def assumption(self) -> str:
        runs = ", ".join(
            f"{n} engine{'s' * (n > 1)}: {t:.0f} samples/s"
            for n, t in sorted(self.throughput.items())
        )
        return (
            f"Amdahl's law with parallel fraction p = {self.parallel_fraction:.3f}, fitted "
            f"to runs of this job ({runs})"
        )


def _median_throughput(result: TrainResult) -> float:
    rates = sorted(row[keys.THROUGHPUT] for row in result.history[2:] or result.history)
    return rates[len(rates) // 2]


def fit_scaling(results: Sequence[TrainResult]) -> Scaling:
    """Fit p to runs of the same job on 1 engine and on more (give them the same --threads)."""
    throughput = {res.engines: _median_throughput(res) for res in results}
    if 1 not in throughput or len(throughput) < 2:
        raise ValueError(
            f"need a run on 1 engine and at least one on more; got engine counts "
            f"{sorted(throughput)}"
        )
    one = throughput[1]
    # 1 / speedup(n) - 1 = p (1/n - 1): least squares through the origin
    xs = [1 / n - 1 for n in throughput]
    ys = [one / throughput[n] - 1 for n in throughput]
    p = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    config = next(res.config for res in results if res.engines == 1)
    return Scaling(throughput, min(1.0, max(0.0, p)), config)


@dataclass(frozen=True)
class WhatIfRow:
    instances: int
    engines: int
    hours: float
    on_demand_usd: float
    spot_usd: float
    #: with an estimate: hours as (low, high), the estimate's MFU range; hours is their middle
    hours_range: tuple[float, float] | None = None
    #: optimizer steps of the run (None: a Scaling made by hand, without a run's batch size)
    steps: int | None = None


def what_if(
    scaling: Scaling,
    *,
    samples: float,
    instance: str,
    instances: Sequence[int] = (1, 2, 4, 8, 10),
    engines_per_instance: int | None = None,
    estimate: Estimate | None = None,
) -> list[WhatIfRow]:
    """Hours and dollars to train a dataset of `samples` samples on each number of instances.

    `samples` is the dataset's size, one epoch, as in `sagenb.estimate(samples=)`: the run
    passes over it --epochs times in batches of --batch-size, capped at --steps, with the
    options of `estimate` when given, else of the measured runs (`scaling.config`); a Scaling
    made by hand, with no runs, trains `samples` samples once.

    Throughput on n engines = single-engine throughput x speedup(n). Without `estimate`, this
    machine's absolute speed stands in for the instance's, so read the hours as relative (what
    scaling does), and the dollars as the price of that time. With `estimate`
    (sagenb.estimate of this job on `instance`), its step time on the instance sets the
    absolute speed at its engine count, and the measured fit scales it to the others: the
    estimate for an instance that was not measured, the measured fit for how the job scales.
    At the estimate's own engine count the hours are the estimate's.
    """
    price = instance_price(instance)
    per = engines_per_instance or price.engines_per_instance
    config = estimate.config if estimate is not None else scaling.config
    run = run_steps(samples, config) if config is not None else None
    if run is None:
        check_samples(samples)
    seconds_at = _seconds_on_instance(scaling, samples, run, estimate, instance)
    rows = []
    for k in instances:
        engines = k * per
        low, high = seconds_at(engines)
        seconds = (low + high) / 2
        meter = CostMeter(price, engines)
        spread = (low / 3600, high / 3600) if estimate is not None else None
        cost = meter.cost(seconds)
        steps = None if run is None else run.steps
        rows.append(WhatIfRow(k, engines, seconds / 3600, cost, meter.spot(cost), spread, steps))
    return rows


def _seconds_on_instance(
    scaling: Scaling,
    samples: float,
    run: RunSteps | None,
    estimate: Estimate | None,
    instance: str,
) -> Callable[[int], tuple[float, float]]:
    """engines -> (low, high) seconds to train the run's steps (`samples` once, without one)."""
    if estimate is None:
        one = scaling.throughput[1]
        trained = samples if run is None else run.steps * run.batch_size
        return lambda n: (trained / (one * scaling.speedup(n)),) * 2
    if estimate.price.name != instance:
        raise ValueError(
            f"the estimate is for {estimate.price.name}, not {instance}: estimate the job with "
            f"instance={instance!r}"
        )
    assert run is not None  # samples >= 1 with the estimate's config: run_steps counts them
    base = estimate.engines

    def seconds(n: int) -> tuple[float, float]:
        factor = scaling.speedup(base) / scaling.speedup(n)
        low, high = (run.steps * s * factor for s in estimate.step_time_s)
        return low, high

    return seconds


def teaching_case(scaling: Scaling, *, instance: str, hours_on_one: float = 10.0) -> str:
    """'10 hours on one instance, about 1 hour on ten': what perfect scaling promises, and
    what the fitted scaling of this job gives instead."""
    price = instance_price(instance)
    per = price.engines_per_instance
    perfect = Scaling({1: 1.0}, 1.0)
    lines = [
        f"A job that takes {hours_on_one:g} h on 1 x {instance} "
        f"(${price.usd_per_hour:.2f}/h, price as of {price.as_of}):"
    ]
    for name, model in (("perfect scaling (p = 1)", perfect), ("this job's fit", scaling)):
        ten = hours_on_one * model.speedup(per) / model.speedup(10 * per)
        cost_one = hours_on_one * price.usd_per_hour
        cost_ten = ten * 10 * price.usd_per_hour
        lines.append(
            f"  {name}: on 10 instances {ten:.2f} h, ${cost_ten:,.0f} (vs ${cost_one:,.0f} on one)"
        )
    lines.append(f"  assumption: {scaling.assumption}")
    return "\n".join(lines)
