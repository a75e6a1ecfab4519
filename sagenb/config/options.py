"""Training configuration: plain, picklable, keyword-only dataclasses, in sections.

One source of truth for every option. Each field says its section (`SECTIONS`), its help
text and, where a flag needs it, how to parse the flag's text; from that alone come the
magic's argparse flags (`--batch-size` for `batch_size`), `to_flags`, the export's script and
the flag reference (`flag_reference`, docs/flags.md). A script passes them as keyword
arguments.

The sections split the config in two. `EngineConfig` holds what the engines need (training,
parallelism, memory savers, checkpoints); `TrainConfig` adds what only the notebook uses (the
dashboard, the cost estimate, the result's name), and `for_engines()` is all that is sent to
an engine, the planner or an exported script. Validation that needs nothing but the values
happens in `__post_init__`, so an impossible config never reaches an engine; checks that read
a file (the price table) happen where the file is used (cost.check_price), still before any
engine starts.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import keyword
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from sagenb.config.errors import ConfigError, flag_name
from sagenb.engine.strategies import describe
from sagenb.engine.strategies import names as strategy_names
from sagenb.engine.strategies.description import DEFAULT_ENGINES
from sagenb.engine.strategies.pipeline import PARTITION_METHODS, SCHEDULES

__all__ = [
    "DEFAULT_ENGINES",
    "PARTITION_METHODS",
    "PRECISIONS",
    "SCHEDULES",
    "ConfigError",
    "EngineConfig",
    "SECTIONS",
    "Section",
    "TrainConfig",
    "flag_arguments",
    "flag_name",
    "flag_reference",
    "describe",
    "field_type",
    "notebook_only_flags",
    "option_owners",
    "strategy_names",
]

PRECISIONS = ("fp32", "bf16", "fp16")
#: numpy seeds take 32 bits (the cell's RNGs are all seeded with --seed)
MAX_SEED = 2**32 - 1
#: beyond a week the process groups' own timeout (--timeout + 60 s) overflows gloo's
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: torch threads per engine: more than any machine's cores only makes its thread pool fail
MAX_THREADS = 1024
_Config = TypeVar("_Config", bound="EngineConfig")


class Section(NamedTuple):
    title: str
    #: whether its options travel to the engines (EngineConfig) or stay in the notebook
    engines: bool
    #: one line for the flag reference
    about: str


#: the config's sections in the order the flags are listed (the strategy first, as a
#: `%%smp_train` line reads); the engine sections are EngineConfig's fields
SECTIONS: dict[str, Section] = {
    "parallelism": Section(
        "Parallelism", True, "How the model and each batch are spread over the engines"
    ),
    "training": Section("Training", True, "What one run trains, and when it stops"),
    "memory": Section(
        "Memory savers", True, "Less memory per engine for more compute or communication"
    ),
    "checkpoints": Section("Checkpoints", True, "Saving a run and continuing it"),
    "display": Section("Display", False, "What the notebook shows while a run trains"),
    "cost": Section("Cost", False, "The cost estimate of the dashboard and the result"),
    "output": Section("Output", False, "Where the notebook puts the result"),
}


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


def _opt(section: str, default: Any, help: str, **extra: Any) -> Any:
    """A field of `section` (SECTIONS). `extra`: `choices` (a tuple, or a function that
    returns one), `parse` (the flag's text -> the value), `shown` (the default as the flag
    reference words it, where the value alone would not say what it means), `panel` (False:
    the control panel leaves the option out and keeps the value it was given)."""
    assert section in SECTIONS, section
    return field(default=default, metadata={"section": section, "help": help, **extra})


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The options the engines train with: the engine sections of SECTIONS. This is what a
    rank, the planner's engine and an exported script get (TrainConfig.for_engines())."""

    # -- parallelism --
    strategy: str = _opt("parallelism", "data", "parallelism strategy", choices=strategy_names)
    engines: int | None = _opt(
        "parallelism",
        None,
        "engines to train on (default: every engine of the running pool, or what the strategy "
        "needs when none runs: 2, one per partition for model)",
        shown="pool size",
    )
    threads: int | None = _opt(
        "parallelism",
        None,
        "torch threads per engine (default: the machine's cores / engines, at least 1, so "
        "engines do not oversubscribe the cores)",
        shown="cores / engines",
    )
    partitions: int = _opt(
        "parallelism", 1, "pipeline stages the model is split into (model, hybrid)"
    )
    microbatches: int = _opt(
        "parallelism", 4, "microbatches each pipeline splits its slice of a batch into"
    )
    schedule: str = _opt(
        "parallelism",
        "1f1b",
        "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (backwards as early "
        "as possible), interleaved (1F1B over --virtual-stages chunks per engine)",
        choices=SCHEDULES,
    )
    virtual_stages: int = _opt(
        "parallelism", 2, "model chunks per engine with --schedule interleaved"
    )
    partition_by: str = _opt(
        "parallelism",
        "auto",
        "how cut points are chosen: auto (balance measured time within --memory-budget), "
        "parameters (balance parameter counts), uniform (equal block counts), manual (--cuts)",
        choices=PARTITION_METHODS,
    )
    cuts: tuple[int, ...] = _opt(
        "parallelism",
        (),
        "blocks where stages 2, 3, ... begin, e.g. 2,4 (with --partition-by manual)",
        parse=parse_cuts,
        shown="none",
    )
    memory_budget: float | None = _opt(
        "parallelism",
        None,
        "GiB one engine may hold (auto partitioning keeps every stage within it)",
        shown="none",
    )
    tensor_parallel: int | None = _opt(
        "parallelism",
        None,
        "engines each Linear layer is split across (--strategy tensor; default: every engine); "
        "data parallel across the rest",
        shown="all engines",
    )
    # -- training --
    batch_size: int = _opt(
        "training", 32, "global batch size per optimizer step, split evenly across engines"
    )
    epochs: int = _opt("training", 1, "passes over the dataset")
    steps: int | None = _opt(
        "training",
        None,
        "stop after this many optimizer steps in total (default: run every epoch)",
        shown="all",
    )
    lr: float = _opt("training", 1e-3, "learning rate of the default AdamW optimizer")
    seed: int = _opt(
        "training", 0, "seed of torch's RNG before the cell runs, and of the sample order"
    )
    grad_accum: int = _opt(
        "training", 1, "slices of the global batch accumulated per optimizer step"
    )
    clip_grad_norm: float | None = _opt(
        "training",
        None,
        "clip the global gradient norm (over every engine) to this value",
        shown="off",
    )
    eval_every: int = _opt(
        "training", 0, "evaluate eval_dataset every N optimizer steps (0: once, after training)"
    )
    data_workers: int = _opt(
        "training",
        0,
        "processes per engine that load the next batches while a step trains (torch "
        "DataLoader; 0: none, batches load in the training thread)",
    )
    timeout: float = _opt(
        "training",
        300.0,
        "seconds without progress (no rank finishing a step) before the run is stopped as "
        "stalled and its engines replaced",
    )
    stop_on_nonfinite: bool = _opt(
        "training",
        False,
        "end the run cleanly, history kept, after the first step whose loss is NaN or infinite "
        "(without it the run goes on, with a warning)",
    )
    # -- memory savers --
    precision: str = _opt(
        "memory",
        "fp32",
        "compute precision: fp32, bf16 (autocast) or fp16 (autocast with a dynamic loss "
        "scaler); parameters and optimizer state stay fp32",
        choices=PRECISIONS,
    )
    activation_checkpointing: bool = _opt(
        "memory",
        False,
        "recompute each repeated block's activations in backward instead of keeping them "
        "(less memory, about a third more compute)",
    )
    delay_init: bool = _opt(
        "memory",
        False,
        "build the model's parameters on the meta device and materialise only each engine's "
        "own stage (a model larger than one engine); initial values as documented",
    )
    reshard_after_forward: bool = _opt(
        "memory",
        True,
        "--strategy sharded: free each block's gathered parameters after its forward and "
        "gather them again for backward (ZeRO-3); --no-reshard-after-forward keeps them "
        "(ZeRO-2: more memory, less communication)",
    )
    # -- checkpoints --
    checkpoint_dir: str | None = _opt(
        "checkpoints",
        None,
        "directory for checkpoints (model, optimizer, scheduler, step, RNG)",
        shown="none",
    )
    checkpoint_every: int = _opt(
        "checkpoints",
        0,
        "write a checkpoint every N steps (0: only at the end, or when interrupted)",
    )
    resume: bool = _opt(
        "checkpoints", False, "continue from the newest checkpoint in --checkpoint-dir"
    )

    def __post_init__(self) -> None:
        strategy = describe(self.strategy)  # a ConfigError names the strategies otherwise
        for name in ("batch_size", "epochs", "grad_accum"):
            _check_int(self, name, minimum=1)
        for name in ("steps", "engines"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1)
        if self.threads is not None:
            _check_int(self, "threads", minimum=1, maximum=MAX_THREADS)
        _check_int(self, "seed", minimum=0, maximum=MAX_SEED)
        _check_int(self, "eval_every", minimum=0)
        _check_int(self, "data_workers", minimum=0)
        _check_positive(self, "lr", allow_zero=True)
        _check_positive(self, "timeout", maximum=MAX_TIMEOUT_S)
        if self.clip_grad_norm is not None:
            _check_positive(self, "clip_grad_norm")
        self._check_checkpoint_dir()
        self._check_pipeline()
        _check_choice(self, "precision", PRECISIONS)
        self._check_own_options(strategy)
        _check_int(self, "checkpoint_every", minimum=0)
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            name = "resume" if self.resume else "checkpoint_every"
            raise ConfigError(name, getattr(self, name), "needs --checkpoint-dir")
        strategy.check(self)
        if self.engines is not None:
            self.check_split(self.engines)

    def for_engines(self) -> EngineConfig:
        """Only the engine sections' options: what is sent to the engines (validated again)."""
        if type(self) is EngineConfig:
            return self
        return EngineConfig(**{f.name: getattr(self, f.name) for f in _fields(EngineConfig)})

    def _check_checkpoint_dir(self) -> None:
        """A directory, or one that can be made: found out now, not when the finished run
        writes its final checkpoint."""
        if not self.checkpoint_dir:
            return
        path = os.path.abspath(os.path.expanduser(self.checkpoint_dir))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(
                "checkpoint_dir", self.checkpoint_dir, "exists and is not a directory"
            )
        parent = path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(
                "checkpoint_dir",
                self.checkpoint_dir,
                f"cannot be written: {parent} is not writable",
            )

    def engines_to_start(self) -> int:
        """Engines a pool needs for this config when none runs: --engines, else what the
        strategy needs (one per partition for model, a tensor-parallel group for tensor ...)."""
        if self.engines is not None:
            return self.engines
        return describe(self.strategy).engines_to_start(self)

    def threads_per_engine(self, engines: int) -> int:
        """--threads, or the machine's cores shared by the engines (at least 1 each), so
        engines on one machine do not oversubscribe its cores."""
        return self.threads or max(1, (os.cpu_count() or 1) // engines)

    @property
    def collective_timeout(self) -> float:
        """The process group's own timeout: a minute past the notebook's watchdog (--timeout),
        so a stalled run is stopped, and reported as stalled, by the notebook."""
        return self.timeout + 60.0

    @property
    def stages(self) -> int:
        """Pipeline stages in all (partitions x virtual stages when interleaved)."""
        return self.partitions * (self.virtual_stages if self.schedule == "interleaved" else 1)

    def replicas(self, engines: int) -> int:
        """Data-parallel replicas on `engines` engines: each a whole pipeline (model, hybrid)
        or a tensor-parallel group (tensor); sharded engines each take their own samples."""
        return int(describe(self.strategy).replicas(self, engines))

    def _check_own_options(self, strategy: Any) -> None:
        """An option that only some strategies use must keep its default under the others
        (--partitions 2 with --strategy data would silently train something else)."""
        for f in _fields(self):
            value = getattr(self, f.name)
            if f.name in strategy.own_options or value == f.default:
                continue
            owners = option_owners(f.name)
            if owners:
                negated = f"{_flag_for(f, value)} " if value is False else ""
                needs = f"{negated}needs --strategy {' or '.join(owners)}"
                raise ConfigError(f.name, value, needs)

    def _check_pipeline(self) -> None:
        """The pipeline options' types and choices, for every strategy; the strategies that
        run pipelines check the rest (engine/strategies/pipeline/strategy.py)."""
        for name in ("partitions", "microbatches", "virtual_stages"):
            _check_int(self, name, minimum=1)
        _check_choice(self, "schedule", SCHEDULES)
        _check_choice(self, "partition_by", PARTITION_METHODS)
        object.__setattr__(self, "cuts", parse_cuts(self.cuts))
        if self.cuts and self.partition_by != "manual":
            raise ConfigError("cuts", self.cuts, "is used only with --partition-by manual")
        if self.memory_budget is not None:
            _check_positive(self, "memory_budget")

    def forward_size(self, engines: int) -> int:
        """Samples in one forward of one engine on `engines` engines: the global batch cut
        into the pieces its strategy splits it into (replicas x grad-accum slices, and each a
        pipeline's microbatches), the one place this is computed."""
        return self.batch_size // describe(self.strategy).split(self, engines)[0]

    def check_split(self, engines: int) -> None:
        """The global batch must split evenly into grad-accum slices across the replicas,
        and (for pipelines) each replica's slice into microbatches."""
        pieces, detail = describe(self.strategy).split(self, engines)
        if self.batch_size % pieces:
            lower = (self.batch_size // pieces) * pieces or pieces
            raise ConfigError(
                "batch_size",
                self.batch_size,
                f"must be divisible by {detail} = {pieces}; try {lower} or {lower + pieces}",
            )

    def with_engines(self: _Config, engines: int) -> _Config:
        """This config with `engines` resolved (validated again)."""
        return dataclasses.replace(self, engines=engines)

    def to_flags(self) -> str:
        """The `%%smp_train` line that gives this config (defaults left out)."""
        parts = [
            _flag_for(f, getattr(self, f.name))
            for f in _fields(self)
            if getattr(self, f.name) != f.default
        ]
        return " ".join(["%%smp_train", *parts])


@dataclass(frozen=True, kw_only=True)
class TrainConfig(EngineConfig):
    """Everything `%%smp_train` and `sagenb.train` accept: the engines' options and those
    only the notebook uses (display, cost, output), which `for_engines()` leaves behind."""

    # -- display --
    dashboard: bool = _opt("display", True, "show the live dashboard under the cell")
    # -- cost --
    instance: str = _opt(
        "cost", "ml.p4d.24xlarge", "instance type whose price the cost estimate uses"
    )
    price_per_hour: float | None = _opt(
        "cost",
        None,
        "your own USD per instance-hour for --instance, instead of the table's",
        shown="table's",
    )
    price_table: str | None = _opt(
        "cost",
        None,
        "a JSON price table of your own (the shape of sagenb/sizing/tables/prices.json)",
        shown="package's",
    )
    hardware_table: str | None = _opt(
        "cost",
        None,
        "a JSON hardware table of your own (peak TFLOPS, accelerator memory, bandwidths: the "
        "shape of sagenb/sizing/tables/hardware.json), for %%%%smp_plan's estimate",
        shown="package's",
    )
    spot_discount: float = _opt(
        "cost",
        0.7,
        "spot price's saving against on-demand, 0 to 0.95 (an assumption: AWS quotes "
        '"up to 90%%")',
    )
    # -- output --
    out: str = _opt(
        "output", "smp_result", "name of the notebook variable that receives the result"
    )
    log_dir: str | None = _opt(
        "output",
        None,
        "also write each step's metrics as TensorBoard event files, one folder per run under "
        "this directory (`tensorboard --logdir DIR`; needs `pip install 'sagenb[tensorboard]'`)",
        shown="none",
    )

    def __post_init__(self) -> None:
        """The engine options' checks, then the notebook's. --instance and --price-table
        are checked where the price table is read (cost.check_price), before any engine
        starts: validation reads no file."""
        super().__post_init__()
        if self.price_per_hour is not None:
            _check_positive(self, "price_per_hour")
        if not (isinstance(self.spot_discount, (int, float)) and 0 <= self.spot_discount <= 0.95):
            raise ConfigError("spot_discount", self.spot_discount, "must be between 0 and 0.95")
        if not isinstance(self.instance, str) or not self.instance:
            raise ConfigError("instance", self.instance, "must be an instance type's name")
        if self.log_dir is not None and (not isinstance(self.log_dir, str) or not self.log_dir):
            raise ConfigError("log_dir", self.log_dir, "must be a directory's path")
        for name in ("price_table", "hardware_table"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "must be a JSON file's path")
        if (
            not isinstance(self.out, str)
            or not self.out.isidentifier()
            or keyword.iskeyword(self.out)
            or hasattr(builtins, self.out)
        ):
            raise ConfigError(
                "out",
                self.out,
                "must be a Python identifier that is neither a keyword nor a builtin's name "
                "(the result would shadow it in the notebook)",
            )


def _fields(config: Any) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(config)


def option_owners(name: str) -> tuple[str, ...]:
    """The strategies that list option `name` in their `own_options` (the others refuse any
    value but its default); none: every strategy accepts it."""
    return tuple(n for n in strategy_names() if name in describe(n).own_options)


# -- flags: one spelling per field, from its type and default ------------------------------


def field_type(f: dataclasses.Field, config: type = TrainConfig) -> Any:
    """The type a flag's text converts to: `int` for `int | None` (`config`: the dataclass
    that declares `f`, for a field TrainConfig lacks)."""
    hint = typing.get_type_hints(config)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def _is_switch(f: dataclasses.Field) -> bool:
    return isinstance(f.default, bool)


def flag_arguments(f: dataclasses.Field) -> tuple[tuple[str, ...], dict[str, Any]]:
    """argparse's option strings and keywords for field `f`: a bool that is off by default is
    a `--x` switch, one that is on is `--x/--no-x` (argparse.BooleanOptionalAction); any
    other field takes a value, converted by its `parse` metadata or its type."""
    help_text = f.metadata["help"]
    if _is_switch(f):
        action: Any = "store_true" if f.default is False else argparse.BooleanOptionalAction
        return (flag_name(f.name),), dict(
            dest=f.name, action=action, default=f.default, help=help_text
        )
    choices = f.metadata.get("choices")
    extra = {"choices": choices() if callable(choices) else choices} if choices else {}
    return (flag_name(f.name),), dict(
        dest=f.name,
        type=f.metadata.get("parse") or field_type(f),
        default=f.default,
        help=help_text,
        metavar=f.name.upper(),
        **extra,
    )


def _flag_for(f: dataclasses.Field, value: Any) -> str:
    """The flag that sets field `f` to `value`: `--resume`, `--no-dashboard`, `--cuts 2,4`."""
    if _is_switch(f):
        return flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:]
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return f"{flag_name(f.name)} {value}"


def notebook_only_flags() -> list[str]:
    """The flags of the notebook-only sections (display, cost, output), spelled as given
    when they change something: what an exported script leaves out."""
    return [
        _flag_for(f, not f.default) if _is_switch(f) else flag_name(f.name)
        for f in _fields(TrainConfig)
        if not SECTIONS[f.metadata["section"]].engines
    ]


# -- the flag reference (docs/flags.md) ----------------------------------------------------


def flag_reference() -> str:
    """Markdown tables of every flag, one per section in SECTIONS order: flag, default and
    meaning, from the fields themselves (docs/flags.md holds this; a test keeps it so)."""
    out = []
    for name, section in SECTIONS.items():
        where = "sent to the engines" if section.engines else "the notebook's own"
        out += [f"## {section.title}", "", f"{section.about} ({where}).", ""]
        out += ["| flag | default | meaning |", "|---|---|---|"]
        for f in _fields(TrainConfig):
            if f.metadata["section"] == name:
                out.append(f"| {_reference_flags(f)} | {_shown(f)} | {_meaning(f)} |")
        out.append("")
    return "\n".join(out)


def _reference_flags(f: dataclasses.Field) -> str:
    if _is_switch(f) and f.default is True:
        return f"`{flag_name(f.name)}`, `--no-{flag_name(f.name)[2:]}`"
    return f"`{flag_name(f.name)}`"


def _shown(f: dataclasses.Field) -> str:
    if "shown" in f.metadata:
        return str(f.metadata["shown"])
    if _is_switch(f):
        return "on" if f.default else "off"
    if isinstance(f.default, str):
        return f"`{f.default}`"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def _meaning(f: dataclasses.Field) -> str:
    text = str(f.metadata["help"]).replace("%%", "%").replace("|", "\\|")
    choices = f.metadata.get("choices")
    values = choices() if callable(choices) else choices or ()
    if values and not all(v in text for v in values):
        text += ": " + ", ".join(f"`{v}`" for v in values)
    return text


def _check_choice(cfg: EngineConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(choices)}")


def _check_int(cfg: EngineConfig, name: str, *, minimum: int, maximum: int | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(name, value, f"must be an integer {bound}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, value, f"must be an integer from {minimum} to {maximum}")


def _check_positive(
    cfg: EngineConfig, name: str, *, allow_zero: bool = False, maximum: float | None = None
) -> None:
    value = getattr(cfg, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    too_big = ok and maximum is not None and value > maximum
    if not ok or value < 0 or (value == 0 and not allow_zero) or too_big:
        bound = ">= 0" if allow_zero else "> 0"
        most = f" and at most {maximum:g}" if maximum is not None else ""
        raise ConfigError(name, value, f"must be a finite number {bound}{most}")
