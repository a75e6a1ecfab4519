"""The partition planner: where the model is cut, what each stage holds and costs, before
any training. `sagenb.plan(cell, strategy="model", partitions=2)` or `%%smp_plan` with the
flags of `%%smp_train`.

The estimated step time divides by 1 - the pipeline's bubble, as its description states it
(engine/strategies/pipeline/strategy.py, bubble_fraction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sagenb.config.errors import ConfigError
from sagenb.config.job import Job, JobError
from sagenb.config.options import TrainConfig, describe, strategy_names
from sagenb.engine.strategies.pipeline import (
    MEMORY_FACTOR,
    BlockProfile,
    PipelineOptions,
    engine_of,
    plan_on_engine,
)
from sagenb.pool import cluster
from sagenb.sizing.cost import check_price

__all__ = ["Plan", "StagePlan", "plan"]

MIB = 2**20


@dataclass(frozen=True)
class StagePlan:
    stage: int
    engine: int
    blocks: tuple[str, ...]
    params_mib: float
    #: parameters + gradients + optimizer state (AdamW), MiB
    training_state_mib: float
    #: activations saved for backward by one microbatch, MiB
    activations_per_microbatch_mib: float
    #: forward + backward of one microbatch, seconds (measured)
    seconds_per_microbatch: float


@dataclass(frozen=True)
class Plan:
    config: TrainConfig
    method: str
    starts: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    bubble: float
    #: slowest stage time / mean stage time (1.0 is perfect balance)
    balance: float
    estimated_step_s: float
    alternatives: dict[str, Any]
    #: False with --delay-init: meta parameters are counted, never run, so the times,
    #: activations, balance and step estimate are NaN (training cuts by parameters then)
    measured: bool = True

    @property
    def cuts(self) -> tuple[int, ...]:
        """The blocks where stages 1, 2, ... begin, as --cuts spells them (what training
        reports as its first step's "cuts")."""
        return self.starts[1:]

    def table(self) -> str:
        pipe = PipelineOptions.of(self.config)
        timing = (
            f"balance (slowest/mean stage) {self.balance:.2f}, "
            f"estimated {self.estimated_step_s * 1e3:.1f} ms per optimizer step"
            if self.measured
            else "times not measured (--delay-init: meta parameters are not run)"
        )
        lines = [
            f"{pipe.partitions} partitions x {pipe.chunks} chunk(s), "
            f"{pipe.microbatches} microbatches, {pipe.schedule}, partition by {self.method}: "
            f"cut before blocks {list(self.cuts)}",
            f"bubble {self.bubble:.1%}, {timing}",
            f"{'stage':>5} {'engine':>6} {'blocks':<24} {'params MiB':>10} {'train MiB':>10} "
            f"{'act/mb MiB':>10} {'ms/mb':>7}",
        ]
        for s in self.stages:
            names = f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0]
            lines.append(
                f"{s.stage:>5} {s.engine:>6} {names:<24} {s.params_mib:>10.3f} "
                f"{s.training_state_mib:>10.3f} {s.activations_per_microbatch_mib:>10.3f} "
                f"{s.seconds_per_microbatch * 1e3:>7.2f}"
            )
        lines.append(
            "train MiB: params + grads + AdamW's two moments (4 x params, the default "
            "optimizer's); SGD with momentum holds 3 x params, plain SGD 2 x"
        )
        for method, starts in self.alternatives.items():
            shown = starts[1:] if isinstance(starts, list) else starts
            lines.append(f"  with --partition-by {method}: cut before blocks {shown}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def figure(self):
        """A bar chart of each stage's time and memory (plotly)."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        labels = [f"stage {s.stage} (engine {s.engine})" for s in self.stages]
        fig = make_subplots(rows=1, cols=2, subplot_titles=("Time per microbatch", "Memory"))
        bars = (  # (values, legend, colour, column)
            (
                [s.seconds_per_microbatch * 1e3 for s in self.stages],
                "forward+backward (ms)",
                "#4C78A8",
                1,
            ),
            (
                [s.training_state_mib for s in self.stages],
                "params+grads+optimizer (MiB)",
                "#54A24B",
                2,
            ),
            (
                [s.activations_per_microbatch_mib for s in self.stages],
                "activations per microbatch (MiB)",
                "#B279A2",
                2,
            ),
        )
        for values, name, colour, col in bars:
            fig.add_trace(go.Bar(x=labels, y=values, name=name, marker_color=colour), 1, col)
        fig.update_layout(
            barmode="stack",
            height=360,
            template="plotly_white",
            title=f"Partition plan ({self.method}); bubble {self.bubble:.1%}",
        )
        fig.update_yaxes(title_text="ms", row=1, col=1)
        fig.update_yaxes(title_text="MiB", row=1, col=2)
        return fig


def plan(job: Any, config: TrainConfig | None = None, *, pool=None, **options: Any) -> Plan:
    """Profile the cell's blocks on one engine and show how `config` would cut the model."""
    config = TrainConfig(**options) if config is None else dataclasses.replace(config, **options)
    strategy = describe(config.strategy)
    if not strategy.pipelined:
        pipelines = " or ".join(n for n in strategy_names() if describe(n).pipelined)
        raise ConfigError("strategy", config.strategy, f"the planner is for {pipelines}")
    check_price(config)  # as sagenb.train: the same line must be refused the same way
    prepared = Job.of(job)
    pool = pool or cluster.ensure_pool(PipelineOptions.of(config).partitions)
    pool.heal()  # engines lost in a failed run are replaced first (session.train does too)
    engines = strategy.engines_for(config, pool.size)
    config = config.with_engines(engines)
    threads = config.threads_per_engine(engines)
    task = pool.client[pool.engine_ids[0]].apply_async(
        plan_on_engine, prepared, config.for_engines(), engines, threads
    )
    try:
        raw = task.get(timeout=600)
    except Exception as exc:  # noqa: BLE001 - a JobError on the engine reads as training's
        if getattr(exc, "ename", None) == "JobError":
            raise JobError(str(getattr(exc, "evalue", exc))) from None
        raise
    return _assemble(config, raw)


def _assemble(config: TrainConfig, raw: dict[str, Any]) -> Plan:
    profile = BlockProfile(**{k: tuple(v) for k, v in raw["profile"].items()})
    if not raw["measured"]:
        unknown = (float("nan"),) * len(profile.seconds)
        # NaN stands for "not measured" in the byte counts too
        profile = dataclasses.replace(
            profile,
            seconds=unknown,
            activation_bytes=unknown,  # type: ignore[arg-type]
        )
    pipe = PipelineOptions.of(config)
    starts = raw["starts"]
    sums = profile.stage_sums(starts)
    bounds = [*starts, len(raw["blocks"])]
    stages = tuple(
        StagePlan(
            stage=s,
            engine=engine_of(pipe.schedule, pipe.partitions, s),
            blocks=tuple(raw["blocks"][bounds[s] : bounds[s + 1]]),
            params_mib=sums["param_bytes"][s] / MIB,
            training_state_mib=sums["param_bytes"][s] * MEMORY_FACTOR / MIB,
            activations_per_microbatch_mib=sums["activation_bytes"][s] / MIB,
            seconds_per_microbatch=sums["seconds"][s],
        )
        for s in range(len(starts))
    )
    per_engine = [0.0] * pipe.partitions
    for s in stages:
        per_engine[s.engine] += s.seconds_per_microbatch
    bubble = describe(config.strategy).bubble(config)
    slowest, mean = max(per_engine), sum(per_engine) / len(per_engine)
    return Plan(
        config=config,
        method=raw["method"],
        starts=tuple(starts),
        stages=stages,
        bubble=bubble,
        balance=slowest / mean if raw["measured"] else float("nan"),
        estimated_step_s=config.grad_accum * pipe.microbatches * slowest / (1 - bubble),
        alternatives=raw["alternatives"],
        measured=raw["measured"],
    )
