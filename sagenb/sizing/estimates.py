"""Estimate before you run (issue 16): will the cell's model fit on `--instance`, how long
the run takes and what it costs, without starting an engine and without allocating the model.

    est = sagenb.estimate(cell, instance="ml.p4d.24xlarge", engines=16, strategy="sharded")
    est.fits, est.step_time_s, est.hours, est.cost_usd, est.table(), est.figure()

`%%smp_plan --instance I --engines N` shows the same. (The module is `estimates`: a
submodule named `estimate` would replace the function `sagenb.estimate` once imported.)

The memory per rank and the FLOPs and bytes of a step come from `sagenb.sizing.footprint`
(the cell's model on fake tensors at the requested world size); the hardware from
sagenb/sizing/tables/hardware.json (`--hardware-table`); the step time from step_model.py;
prices from sagenb/sizing/tables/prices.json. Every figure is a (low, high) range, and `assumptions`
says what it rests on.
"""

from __future__ import annotations

import dataclasses
import html
import math
from dataclasses import dataclass, field
from typing import Any

from sagenb.config.errors import ConfigError
from sagenb.config.job import Job
from sagenb.config.options import TrainConfig, describe
from sagenb.metrics import keys
from sagenb.sizing import drawer
from sagenb.sizing.cost import CostMeter, InstancePrice, check_price, seconds_span, seconds_text
from sagenb.sizing.footprint import Footprint, footprint
from sagenb.sizing.hardware import Hardware, check_hardware
from sagenb.sizing.step_model import (
    MEMORY_OVERHEAD_GIB,
    MEMORY_USABLE_FRACTION,
    MFU_RANGE,
    StepTime,
    memory_limit_mib,
    rank_total_mib,
    step_time,
)

__all__ = ["Estimate", "RunSteps", "ScalingRow", "check_samples", "estimate", "run_steps"]

Range = tuple[float, float]
#: instance counts of the scaling table
INSTANCE_COUNTS = (1, 2, 4, 8)
#: most footprints the advice computes when a run does not fit
MAX_ADVICE_TRIES = 6


@dataclass(frozen=True)
class ScalingRow:
    """Hours and dollars of the whole run on `instances` instances (None: the strategy or the
    batch cannot use that many engines; `why` says so)."""

    instances: int
    engines: int
    step_time_s: Range | None
    hours: Range | None
    cost_usd: Range | None
    spot_usd: Range | None
    why: str = ""


@dataclass(frozen=True)
class RunSteps:
    """The run's optimizer steps and where they come from: `samples` (the dataset's size, one
    epoch) x --epochs / --batch-size, capped at --steps, as the run itself counts them
    (engine/data/order.py, total_steps); or --steps alone when no dataset size is known."""

    steps: int
    #: the dataset's size (one epoch); None when --steps alone set the steps
    samples: int | None
    #: "samples=" (given), "cell" (the cell's own dataset) or "--steps"
    source: str
    epochs: int
    batch_size: int

    def describe(self) -> str:
        """'--epochs 2 x 595,000 steps of 64 samples (samples=38,080,000: the dataset's size,
        one epoch)'."""
        if self.samples is None:
            return f"--steps {self.steps:,}"
        per_epoch = self.samples // self.batch_size
        where = (
            f"samples={self.samples:,}"
            if self.source == "samples="
            else f"the cell's dataset, {self.samples:,} samples"
        )
        text = (
            f"--epochs {self.epochs} x {per_epoch:,} steps of {self.batch_size} samples "
            f"({where}: the dataset's size, one epoch)"
        )
        return text + (", capped at --steps" if self.steps < per_epoch * self.epochs else "")


def check_samples(samples: Any) -> int:
    """`samples` as the whole number of samples it counts, or a ConfigError naming it."""
    if isinstance(samples, bool) or not isinstance(samples, (int, float)) or not samples >= 1:
        raise ConfigError("samples", samples, "must be a number >= 1 (the dataset's size)")
    return int(samples)


def run_steps(samples: float | None, config: TrainConfig) -> RunSteps | None:
    """The optimizer steps of a run of `config` over a dataset of `samples` samples: what
    `sagenb.estimate(samples=)` and `sagenb.what_if(samples=)` both mean by `samples` (the
    dataset's size; the run's --epochs passes over it, --steps caps it). None when neither
    `samples` nor --steps is given."""
    from sagenb.engine.data.order import total_steps

    if samples is None:
        if config.steps is None:
            return None
        return RunSteps(config.steps, None, "--steps", config.epochs, config.batch_size)
    n = check_samples(samples)
    steps = total_steps(n, batch_size=config.batch_size, epochs=config.epochs, steps=config.steps)
    return RunSteps(steps, n, "samples=", config.epochs, config.batch_size)


@dataclass(frozen=True)
class Estimate:
    """What training the job with `config` on `config.instance` would take (issue 16)."""

    config: TrainConfig
    hardware: Hardware
    price: InstancePrice
    engines: int
    instances: int
    #: one dict per rank, the keys of the engines' memory metrics (MiB)
    ranks: list[dict[str, float]]
    #: MiB one rank may hold (accelerator memory less the stated margin)
    memory_limit_mib: float
    fits: bool
    #: which memory saver or engine count would make it fit (None when it fits)
    advice: str | None
    flops_per_step: float
    params: int
    #: the run's optimizer steps (None when neither --steps nor the dataset's size says)
    steps: int | None
    #: how `steps` was counted (the dataset's size x --epochs, or --steps); None as steps
    run: RunSteps | None
    step: StepTime
    hours: Range | None
    cost_usd: Range | None
    spot_usd: Range | None
    scaling: list[ScalingRow]
    assumptions: list[str]
    footprint: Footprint = field(repr=False)
    #: what was estimated (the session projects a run from this estimate only if it is the same)
    job: Job | None = field(default=None, repr=False)

    @property
    def step_time_s(self) -> Range:
        return self.step.range_s

    def describes(self, job: Job, config: TrainConfig) -> bool:
        """Whether this estimates training `job` with `config` (engines resolved): the same
        cell and every option that reaches the engines, on the same instance and table."""
        return self.job is not None and estimate_key(self.job, self.config) == estimate_key(
            job, config
        )

    def rank_totals(self) -> list[float]:
        return [rank_total_mib(r) for r in self.ranks]

    # -- text -------------------------------------------------------------------------------
    def verdict(self) -> str:
        worst = max(self.rank_totals(), default=0.0)
        head = "fits" if self.fits else "does NOT fit"
        line = (
            f"{head}: the fullest rank holds {worst / 1024:.2f} GiB of "
            f"{self.memory_limit_mib / 1024:.2f} GiB usable per {self.hardware.accelerator}"
        )
        return line + (f"; {self.advice}" if self.advice else "")

    def table(self) -> str:
        cfg = self.config
        lines = [
            f"estimate: {describe(cfg.strategy).layout(cfg, self.engines)} = {self.instances} x "
            f"{cfg.instance} ({self.hardware.accelerators or 'no'} x {self.hardware.accelerator})"
            f", {cfg.precision}, {self.params / 1e6:,.1f} M parameters",
            self.verdict(),
            "ranks     params MiB   grads MiB   optim MiB   activ MiB    total MiB",
        ]
        lines += [_rank_line(label, row) for label, row in _grouped(self.ranks)]
        low, high = self.step_time_s
        lines.append(
            f"step: {self.flops_per_step:.3g} FLOPs, {seconds_span(low, high)} (compute "
            f"{seconds_span(*self.step.compute_s)}, communication "
            f"{seconds_text(self.step.comm_s)}, bubble {self.step.bubble:.0%})"
        )
        if self.hours and self.cost_usd and self.spot_usd:
            lines.append(
                f"run: {self.steps:,} steps, {_hours(self.hours)}, "
                f"{_range(self.cost_usd, '${:,.2f}')} on-demand, "
                f"{_range(self.spot_usd, '${:,.2f}')} spot"
            )
            if self.run is not None:
                lines.append(f"     {self.steps:,} steps = {self.run.describe()}")
        else:
            lines.append("run: steps unknown (pass --steps, or samples= to sagenb.estimate)")
        lines.append("instances  engines   step                time                on-demand")
        lines += [_scaling_line(row) for row in self.scaling]
        lines.append("assumptions:")
        lines += [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        return f"<pre class='smp-estimate'>{html.escape(self.table())}</pre>"

    def figure(self) -> Any:
        """Hours and dollars (on-demand and spot) on 1, 2, 4, 8 instances, as ranges (plotly:
        notebook side only: the display draws it, sizing/drawer.py)."""
        return drawer.draw(self)


def _range(r: Range, fmt: str) -> str:
    return f"{fmt.format(r[0])}-{fmt.format(r[1])}"


def _hours(r: Range) -> str:
    """A range of hours in the unit seconds_span picks for it."""
    return seconds_span(r[0] * 3600, r[1] * 3600)


def _grouped(ranks: list[dict[str, float]]) -> list[tuple[str, dict[str, float]]]:
    """Consecutive ranks with the same figures in one line ('0-15')."""
    out: list[tuple[str, dict[str, float]]] = []
    start = 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or _rounded(ranks[i]) != _rounded(ranks[start]):
            out.append((f"{start}" if i - 1 == start else f"{start}-{i - 1}", ranks[start]))
            start = i
    return out


def _rounded(row: dict[str, float]) -> tuple[float, ...]:
    return tuple(round(row.get(keys.memory(k), 0.0), 1) for k in keys.MEMORY_KINDS)


def _rank_line(label: str, row: dict[str, float]) -> str:
    values = [row.get(keys.memory(k), 0.0) for k in keys.MEMORY_KINDS]
    return f"{label:<8}" + "".join(f"{v:>12,.1f}" for v in values) + f"{sum(values):>13,.1f}"


def _scaling_line(row: ScalingRow) -> str:
    head = f"{row.instances:>9}  {row.engines:>7}   "
    if row.step_time_s is None or row.hours is None or row.cost_usd is None:
        return head + (row.why or "steps unknown")
    return (
        head
        # each range in a unit that needs no exponent (cost.seconds_span): "21.7-51.5 µs"
        + f"{seconds_span(*row.step_time_s):<19} "
        + f"{_hours(row.hours):<19} "
        + _range(row.cost_usd, "${:,.2f}")
    )


# -- the estimate ---------------------------------------------------------------------------


def estimate(
    job: Any, config: TrainConfig | None = None, *, samples: int | None = None, **options: Any
) -> Estimate:
    """Estimate training `job` (cell source, a callable, or a Job) with `config` or the
    options of TrainConfig (`instance=`, `engines=`, `strategy=` ...), without engines.

    `samples` is the size of the dataset the real run trains on, one epoch (the cell's may be
    a small stand-in): the run passes over it --epochs times, capped at --steps, as
    `sagenb.what_if(samples=)` counts it too. Without it, the cell's own dataset (when the
    footprint counts it) or --steps sets the steps. Bad input raises ConfigError before
    anything is computed: an instance without a price or hardware row, a precision the
    instance cannot run, a world size the strategy cannot use."""
    config = TrainConfig(**options) if config is None else dataclasses.replace(config, **options)
    price = check_price(config)
    hw = check_hardware(config)
    engines = config.engines or config.engines_to_start()
    config = config.with_engines(engines)  # the strategy's checks at this world size
    prepared = Job.of(job)
    fp = footprint(prepared, config.for_engines(), engines)
    run = _run_steps(config, samples, fp)
    return dataclasses.replace(_assemble(prepared, config, hw, price, fp, run), job=prepared)


def estimate_key(job: Job, config: TrainConfig) -> tuple[Any, ...]:
    """What an estimate depends on: the cell, every option that reaches the engines, the
    instance and its price table."""
    return (job.source, job.payload, config.for_engines(), config.instance, config.hardware_table)


def _run_steps(config: TrainConfig, samples: int | None, fp: Footprint) -> RunSteps | None:
    if samples is not None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError("samples", samples, "must be an integer >= 1 (the dataset's size)")
        return run_steps(samples, config)
    own = getattr(fp, "samples", None)
    run = run_steps(own, config)
    return run if run is None or own is None else dataclasses.replace(run, source="cell")


def _bubble(config: TrainConfig) -> float:
    return describe(config.strategy).bubble(config)


def _money(
    price: InstancePrice, config: TrainConfig, engines: int, steps: int | None, step: Range
) -> tuple[Range, Range, Range] | tuple[None, None, None]:
    """(hours, on-demand USD, spot USD) of `steps` steps at `step` seconds each."""
    if steps is None:
        return None, None, None
    meter = CostMeter(price, engines, spot_discount=config.spot_discount)
    seconds = (steps * step[0], steps * step[1])
    cost = (meter.cost(seconds[0]), meter.cost(seconds[1]))
    return (
        (seconds[0] / 3600, seconds[1] / 3600),
        cost,
        (meter.spot(cost[0]), meter.spot(cost[1])),
    )


def _assemble(
    job: Job,
    config: TrainConfig,
    hw: Hardware,
    price: InstancePrice,
    fp: Footprint,
    run: RunSteps | None,
) -> Estimate:
    steps = None if run is None else run.steps
    engines = fp.world_size
    limit = memory_limit_mib(hw)
    fits = all(rank_total_mib(r) <= limit for r in fp.ranks)
    step = step_time(fp, hw, config, bubble=_bubble(config))
    hours, cost, spot = _money(price, config, engines, steps, step.range_s)
    return Estimate(
        config=config,
        hardware=hw,
        price=price,
        engines=engines,
        instances=math.ceil(engines / hw.engines_per_instance),
        ranks=list(fp.ranks),
        memory_limit_mib=limit,
        fits=fits,
        advice=None if fits else _advice(job, config, hw),
        flops_per_step=fp.flops_per_step,
        params=fp.params,
        steps=steps,
        run=run,
        step=step,
        hours=hours,
        cost_usd=cost,
        spot_usd=spot,
        scaling=_scaling(config, hw, price, fp, steps),
        assumptions=_assumptions(config, hw, price, fp, step, steps),
        footprint=fp,
    )


def _scaling(
    config: TrainConfig, hw: Hardware, price: InstancePrice, fp: Footprint, steps: int | None
) -> list[ScalingRow]:
    """1, 2, 4, 8 instances: the footprint's FLOPs shared by more ranks, each rank sending
    the bytes it sends at --engines (a ring collective sends about 2(n-1)/n of the data per
    rank: nearly independent of n), over the links of that many instances."""
    rows = []
    for k in INSTANCE_COUNTS:
        engines = k * hw.engines_per_instance
        try:
            scaled_config = config.with_engines(engines)
        except ConfigError as exc:
            rows.append(ScalingRow(k, engines, None, None, None, None, why=f"not usable: {exc}"))
            continue
        per_rank = max(fp.comm_bytes_per_step, key=lambda b: sum(b.values()), default={})
        scaled = dataclasses.replace(
            fp, world_size=engines, comm_bytes_per_step=[per_rank] if engines > 1 else [{}]
        )
        step = step_time(scaled, hw, scaled_config, bubble=_bubble(scaled_config))
        hours, cost, spot = _money(price, scaled_config, engines, steps, step.range_s)
        rows.append(ScalingRow(k, engines, step.range_s, hours, cost, spot))
    return rows


def _advice(job: Job, config: TrainConfig, hw: Hardware) -> str:
    """The first memory saver, or engine count, whose footprint fits (cheapest first: bf16
    also speeds a step up; checkpointing costs a third more compute; sharding costs
    communication; more engines cost money), trying them one at a time and then together."""
    tries = _candidates(config, hw)
    limit = memory_limit_mib(hw)
    smallest: tuple[float, str] | None = None
    for flags, options in tries[:MAX_ADVICE_TRIES]:
        try:
            candidate = dataclasses.replace(config, **options)
        except ConfigError:
            continue  # e.g. a batch that does not split over that many engines
        assert candidate.engines is not None
        fp = footprint(job, candidate.for_engines(), candidate.engines)
        worst = max((rank_total_mib(r) for r in fp.ranks), default=0.0)
        if worst <= limit:
            return f"it would fit with {flags} ({worst / 1024:.2f} GiB on the fullest rank)"
        if smallest is None or worst < smallest[0]:
            smallest = (worst, flags)
    if smallest is None:
        return "no memory saver sagenb has could be tried with these options"
    return (
        f"none of the memory savers tried fits; the closest, {smallest[1]}, still needs "
        f"{smallest[0] / 1024:.2f} GiB on the fullest rank: a larger instance, or more engines"
    )


def _candidates(config: TrainConfig, hw: Hardware) -> list[tuple[str, dict[str, Any]]]:
    engines = config.engines or 1
    singles: list[tuple[str, dict[str, Any]]] = []
    if config.precision == "fp32" and hw.peak("bf16") is not None:
        singles.append(("--precision bf16", {"precision": "bf16"}))
    if not config.activation_checkpointing:
        singles.append(("--activation-checkpointing", {"activation_checkpointing": True}))
    if describe(config.strategy).whole_model_per_rank:
        singles.append(("--strategy sharded", {"strategy": "sharded"}))
    together: dict[str, Any] = {}
    for _, options in singles:
        together.update(options)
    combined = " ".join(flags for flags, _ in singles)
    tries = list(singles)
    if len(singles) > 1:
        tries.append((combined, dict(together)))
    for factor in (2, 4):
        more = {**together, "engines": engines * factor}
        tries.append((f"{combined} --engines {engines * factor}".strip(), more))
    return tries


def _assumptions(
    config: TrainConfig,
    hw: Hardware,
    price: InstancePrice,
    fp: Footprint,
    step: StepTime,
    steps: int | None,
) -> list[str]:
    peak = hw.peak(config.precision)
    recompute = " + recompute" if config.activation_checkpointing else ""
    out = [
        f"compute: {fp.flops_per_step:.3g} FLOPs per step (forward + backward{recompute}, "
        f"counted on fake tensors) shared by {fp.world_size} ranks, at {peak:g} TFLOPS "
        f"{config.precision} dense peak per {hw.accelerator} x MFU {MFU_RANGE[0]}-"
        f"{MFU_RANGE[1]} (PaLM, arXiv:2204.02311 Table 3; Megatron-LM, arXiv:2104.04473)",
        f"communication: {step.collective_gb_s:.3g} GB/s per rank for collectives, "
        f"{step.p2p_gb_s:.3g} GB/s point-to-point (intra-instance: {hw.intra_link}; "
        f"inter-instance {hw.inter_gbit_s:g} Gbit/s per instance shared by its "
        f"{hw.engines_per_instance} engines); low end hides it behind compute, high end adds it",
        f"memory: {hw.memory_gib:g} GiB per {hw.accelerator}, less {MEMORY_OVERHEAD_GIB:g} GiB "
        f"(CUDA context, workspaces), {MEMORY_USABLE_FRACTION:.0%} of the rest usable "
        "(allocator fragmentation, transient buffers)",
        f"price: ${price.usd_per_hour:g}/h per instance, as of {price.as_of} ({price.source}); "
        f"spot {config.spot_discount:.0%} off",
        f"hardware: as of {hw.as_of}, from {', '.join(hw.sources)}"
        + (f" ({hw.note})" if hw.note else ""),
    ]
    if step.bubble:
        out.append(
            f"pipeline bubble {step.bubble:.1%} ({config.option('schedule')}, GPipe/1F1B formula)"
        )
    if steps is not None:
        out.append(f"{steps:,} optimizer steps of {config.batch_size} samples")
    return out + list(fp.notes)
