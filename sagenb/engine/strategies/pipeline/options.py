"""The pipeline's own options, declared by its strategies (model, hybrid) and checked here.

Each is an `Option` of sagenb.config (a keyword, a flag, a row of docs/flags.md and a widget of
the control panel, with nothing to edit elsewhere), in the order the flags list them;
`PipelineOptions.of(config)` reads them back as one typed value, with what follows from them
(`stages`, `chunks`). The other strategies refuse any value but the defaults, so a config of
theirs reads the defaults here: one stage, one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sagenb.config.errors import ConfigError
from sagenb.config.spec import Option
from sagenb.engine.strategies.pipeline.orders import V_SHAPED

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = [
    "MULTI_STAGE",
    "OPTIONS",
    "PARTITION_METHODS",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "PipelineOptions",
    "check_options",
    "parse_cuts",
]

#: --schedule: GPipe (all forwards, then all backwards), 1F1B; those that hold several stages
#: (--virtual-stages) on each rank, round the ranks in a loop: interleaved 1F1B, looped
#: breadth-first (Lamy-Poirier 2023, arXiv:2211.05953) and interleaved zero bubble (its
#: backward split into the input's gradient and the weights', the latter filling the bubble:
#: Qi et al. 2024, arXiv:2401.10241); and those that hold two stages per rank in a V: ZB-V
#: (the same paper, section 6) and DualPipeV (DeepSeek-V3, arXiv:2412.19437). Each is torch's
#: own schedule
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zero-bubble", "zbv", "dualpipev")
#: the schedules whose ranks hold --virtual-stages stages each (exactly 2 for the V-shaped)
MULTI_STAGE = ("interleaved", "looped-bfs", "zero-bubble", *V_SHAPED)
#: the schedules that run the weights' gradients on their own, apart from the input's
SPLIT_BACKWARD = ("zero-bubble", *V_SHAPED)
#: --partition-by: how the cuts are chosen (balance.py holds each method)
PARTITION_METHODS = ("auto", "parameters", "uniform", "manual")


def parse_cuts(text: str | tuple[int, ...]) -> tuple[int, ...]:
    """'2,5' -> (2, 5): the blocks where stages 2, 3, ... begin (for --partition-by manual)."""
    if isinstance(text, tuple):
        return text
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigError(
            "cuts", text, "must be block indices separated by commas, e.g. 2,4"
        ) from None


OPTIONS = (
    Option("partitions", "parallelism", 1, "pipeline stages the model is split into"),
    Option(
        "microbatches",
        "parallelism",
        4,
        "microbatches each pipeline splits its slice of a batch into",
    ),
    Option(
        "schedule",
        "parallelism",
        "1f1b",
        "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (backwards as early "
        "as possible), interleaved (1F1B over --virtual-stages chunks per engine), looped-bfs "
        "(every microbatch through an engine's first chunk, then its next), zero-bubble "
        "(interleaved, each backward split in two: the weights' gradients fill the bubble), zbv "
        "and dualpipev (two chunks per engine in a V, engine 0 holding the first and the last; "
        "zero bubble's ZB-V and DeepSeek's DualPipeV)",
        choices=SCHEDULES,
    ),
    Option(
        "virtual_stages",
        "parallelism",
        2,
        "model chunks per engine with --schedule interleaved, looped-bfs or zero-bubble (2 with "
        "zbv and dualpipev)",
    ),
    Option(
        "partition_by",
        "parallelism",
        "auto",
        "how cut points are chosen: auto (balance measured time within --memory-budget), "
        "parameters (balance parameter counts), uniform (equal block counts), manual (--cuts)",
        choices=PARTITION_METHODS,
    ),
    Option(
        "cuts",
        "parallelism",
        (),
        "blocks where stages 2, 3, ... begin, e.g. 2,4 (with --partition-by manual)",
        parse=parse_cuts,
        shown="none",
    ),
    Option(
        "memory_budget",
        "parallelism",
        None,
        "GiB one engine may hold (auto partitioning keeps every stage within it)",
        type=float,
        shown="none",
    ),
)


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline's options of one config, typed (OPTIONS says what each means)."""

    partitions: int
    microbatches: int
    schedule: str
    virtual_stages: int
    partition_by: str
    cuts: tuple[int, ...]
    memory_budget: float | None

    @classmethod
    def of(cls, config: EngineConfig) -> PipelineOptions:
        return cls(**{option.name: config.option(option.name) for option in OPTIONS})

    @property
    def chunks(self) -> int:
        """Stages per engine: --virtual-stages for the schedules that hold several, else 1."""
        return self.virtual_stages if self.schedule in MULTI_STAGE else 1

    @property
    def stages(self) -> int:
        """Pipeline stages in all: partitions x chunks."""
        return self.partitions * self.chunks


def check_options(config: EngineConfig) -> None:
    """What the options must be for a pipeline to run (their types and choices are checked by
    the config, from OPTIONS), before any engine starts."""
    pipe = PipelineOptions.of(config)
    for name in ("microbatches", "virtual_stages"):
        if getattr(pipe, name) < 1:
            raise ConfigError(name, getattr(pipe, name), "must be an integer >= 1")
    if pipe.memory_budget is not None and pipe.memory_budget <= 0:
        raise ConfigError("memory_budget", pipe.memory_budget, "must be a finite number > 0")
    P = pipe.partitions
    if pipe.schedule == "1f1b" and pipe.microbatches < P:
        raise ConfigError(
            "microbatches",
            pipe.microbatches,
            f"1f1b needs at least one microbatch per stage: must be >= --partitions ({P}); "
            f"raise --microbatches or use --schedule gpipe",
        )
    if pipe.schedule in V_SHAPED:
        _check_v_shaped(pipe)
    elif pipe.schedule in MULTI_STAGE:
        _check_multi_stage(pipe)
    _check_cuts(pipe)


def _check_multi_stage(pipe: PipelineOptions) -> None:
    kind = pipe.schedule
    if pipe.virtual_stages < 2:
        raise ConfigError("virtual_stages", pipe.virtual_stages, f"{kind} needs at least 2")
    rounds = max(1, pipe.microbatches // pipe.partitions)
    if kind != "looped-bfs" and pipe.microbatches % rounds:  # torch's own check, earlier
        raise ConfigError(
            "microbatches",
            pipe.microbatches,
            f"{kind} needs a multiple of the rounds ({rounds}); try {rounds * pipe.partitions}",
        )


def _check_v_shaped(pipe: PipelineOptions) -> None:
    """torch's own checks (ScheduleZBVZeroBubble, ScheduleDualPipeV), before any engine starts."""
    kind = pipe.schedule
    if pipe.virtual_stages != 2:
        raise ConfigError(
            "virtual_stages",
            pipe.virtual_stages,
            f"{kind} holds exactly 2 stages per engine, in a V: must be 2",
        )
    if kind == "dualpipev" and pipe.microbatches < pipe.stages:
        raise ConfigError(
            "microbatches",
            pipe.microbatches,
            f"dualpipev needs at least one microbatch per stage: must be >= {pipe.stages} "
            f"(2 stages x --partitions {pipe.partitions})",
        )


def _check_cuts(pipe: PipelineOptions) -> None:
    """--cuts: only with --partition-by manual, then one increasing block index >= 1 per stage
    after the first (the model's block count is checked on the engines, cuts.py check_blocks)."""
    cuts = pipe.cuts
    if pipe.partition_by != "manual":
        if cuts:
            raise ConfigError("cuts", cuts, "is used only with --partition-by manual")
        return
    if len(cuts) != pipe.stages - 1 or list(cuts) != sorted(set(cuts)) or cuts[0] < 1:
        raise ConfigError(
            "cuts",
            ",".join(map(str, cuts)),
            f"needs {pipe.stages - 1} increasing block indices >= 1 (one per stage after the "
            f"first)",
        )
