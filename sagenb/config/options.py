"""Training configuration: plain, picklable, keyword-only dataclasses, in sections.

One source of truth for every option. Each field says its section (`SECTIONS`), its help
text and, where a flag needs it, how to parse the flag's text; a strategy declares the options
it owns the same way, as `Option`s of its description (the pipeline's --partitions, --schedule
and cut options, tensor parallel's --tensor-parallel, sharded's --replicas ...), and the config
holds their values in one field, `strategy_options`. The config imports no strategy: it asks
them through its registry (registry.py), which they fill as they load. `every_option` gives
both kinds alike, and from that alone come the magic's argparse flags (`--batch-size` for
`batch_size`), `to_flags`, the export's script, the control panel and the flag reference
(flags.py, docs/flags.md). A script passes them all as keyword arguments (`partitions=2` too:
it goes into `strategy_options`), and `config.option(name)` reads either kind
(`config.partitions` too, as scripts read it when it was a field).

The sections split the config in two. `EngineConfig` holds what the engines need (training,
parallelism, memory savers, checkpoints); `TrainConfig` adds what only the notebook uses (the
dashboard, the cost estimate, the result's name), and `for_engines()` is all that is sent to
an engine, the planner or an exported script. Validation that needs nothing but the values
happens in `__post_init__`, so an impossible config never reaches an engine; checks that read
a file (the price table) happen where the file is used (cost.check_price), still before any
engine starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from sagenb.config.checks import (
    check_checkpoint_dir,
    check_choice,
    check_int,
    check_out,
    check_positive,
    check_writable_dir,
    option_pairs,
)
from sagenb.config.errors import ConfigError, flag_name
from sagenb.config.registry import DEFAULT_ENGINES, declared_options, describe
from sagenb.config.registry import names as strategy_names
from sagenb.config.spec import Option, field_type

#: what a run does when another run holds its pool (--if-busy; sagenb/pool/run_lock.py)
IF_BUSY = ("wait", "fail")

__all__ = [
    "DEFAULT_ENGINES",
    "PRECISIONS",
    "ConfigError",
    "EngineConfig",
    "Option",
    "SECTIONS",
    "Section",
    "TrainConfig",
    "flag_name",
    "describe",
    "every_option",
    "field_type",
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
#: the field that holds the values of the options strategies declare (Description.options)
_HOLDER = "strategy_options"


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
    "segments": Section(
        "Going on", False, "Continuing the last run from the state its engines keep"
    ),
    "display": Section("Display", False, "What the notebook shows while a run trains"),
    "cost": Section("Cost", False, "The cost estimate of the dashboard and the result"),
    "output": Section("Output", False, "Where the notebook puts the result"),
    "pool": Section("Pool", False, "What a run does when another run holds its engines"),
}


def _opt(section: str, default: Any, help: str, **extra: Any) -> Any:
    """A field of `section` (SECTIONS). `extra`: `choices` (a tuple, or a function that
    returns one), `parse` (the flag's text -> the value), `shown` (the default as the flag
    reference words it, where the value alone would not say what it means), `panel` (False:
    the control panel leaves the option out and keeps the value it was given)."""
    assert section in SECTIONS, section
    return field(default=default, metadata={"section": section, "help": help, **extra})


def _strategy_keywords(cls: type[_Config]) -> type[_Config]:
    """Let the dataclass's own __init__ take the options strategies declare as keywords too
    (`mirror_shares=2`): a keyword that names no field goes into `strategy_options`, after the
    pairs given there, and __post_init__ checks it with the rest (an unknown name is a
    ConfigError that says which options there are). `dataclasses.replace(config,
    mirror_shares=2)` calls this __init__ too, with the config's own pairs."""
    generated = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(generated)
    def __init__(self: Any, **options: Any) -> None:
        extra = {name: options.pop(name) for name in list(options) if name not in names}
        if extra:
            options[_HOLDER] = (*option_pairs(_HOLDER, options.get(_HOLDER, ())), *extra.items())
        generated(self, **options)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_strategy_keywords
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
    #: the values of the options strategies declare of their own (Description.options), as
    #: (name, value) pairs sorted by name, those at their default left out: a frozen config's
    #: field must be hashable, and two configs that train alike compare equal. Each is a
    #: keyword and a flag of its own (`mirror_shares=2`, `--mirror-shares 2`); read one with
    #: `config.option(name)`.
    strategy_options: tuple[tuple[str, Any], ...] = field(
        default=(),
        metadata={
            "section": "parallelism",
            "help": "the values of the options strategies declare of their own",
            "panel": False,
        },
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
    lr: float = _opt(
        "training",
        1e-3,
        "learning rate of the default optimizer, AdamW (fused=True on CPU and CUDA)",
    )
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
    offload_activations: bool = _opt(
        "memory",
        False,
        "CUDA engines: keep the activations saved for backward in pinned host memory until "
        "backward needs them (less device memory, more host transfers); refused on CPU engines",
    )
    delay_init: bool = _opt(
        "memory",
        False,
        "build the model's parameters on the meta device and materialise only what each engine "
        "keeps (its stage, shard or slice: a model larger than one engine); initial values as "
        "documented, or the cell's pretrained checkpoint, each engine reading only its part",
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
        "checkpoints",
        False,
        "continue from the newest checkpoint in --checkpoint-dir this run can read (same "
        "--batch-size and --seed)",
    )

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            """An option a strategy declares, read as an attribute (`config.replicas`), as
            notebooks and scripts read those that were fields once; sagenb's own code asks
            `config.option(name)`, or its strategy's typed view of its options."""
            if name.startswith("_") or name not in declared_options():
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return self.option(name)

    def __post_init__(self) -> None:
        strategy = describe(self.strategy)  # a ConfigError names the strategies otherwise
        self._check_strategy_options()
        for name in ("batch_size", "epochs", "grad_accum"):
            check_int(self, name, minimum=1)
        for name in ("steps", "engines"):
            if getattr(self, name) is not None:
                check_int(self, name, minimum=1)
        if self.threads is not None:
            check_int(self, "threads", minimum=1, maximum=MAX_THREADS)
        check_int(self, "seed", minimum=0, maximum=MAX_SEED)
        check_int(self, "eval_every", minimum=0)
        check_int(self, "data_workers", minimum=0)
        check_positive(self, "lr", allow_zero=True)
        check_positive(self, "timeout", maximum=MAX_TIMEOUT_S)
        if self.clip_grad_norm is not None:
            check_positive(self, "clip_grad_norm")
        check_checkpoint_dir(self.checkpoint_dir)
        check_choice(self, "precision", PRECISIONS)
        self._check_owned_options(strategy)
        check_int(self, "checkpoint_every", minimum=0)
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            name = "resume" if self.resume else "checkpoint_every"
            raise ConfigError(name, getattr(self, name), "needs --checkpoint-dir")
        strategy.check(self)
        if self.engines is not None:
            self.check_split(self.engines)

    def option(self, name: str) -> Any:
        """The value of option `name`: a field's, or that of an option a strategy declares (its
        default unless it was given), as the engine side of a strategy reads its own."""
        if name != _HOLDER and name in self.__dataclass_fields__:
            return getattr(self, name)
        held = dict(self.strategy_options)
        if name in held:
            return held[name]
        declared = _declared()
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise KeyError(
                f"{name!r} is no field of {type(self).__name__} and no option a strategy "
                f"declares (declared: {known})"
            )
        return declared[name].default

    def _check_strategy_options(self) -> None:
        """The declared options' values, each converted and checked by its Option, kept as
        sorted pairs without those at their default (see the field)."""
        declared = _declared()
        held: dict[str, Any] = {}
        for name, value in option_pairs(_HOLDER, self.strategy_options):
            if name not in declared:
                raise ConfigError(name, value, _unknown(name, type(self), declared))
            value = declared[name].convert(value)
            held.pop(name, None)
            if value != declared[name].default:
                held[name] = value
        object.__setattr__(self, _HOLDER, tuple(sorted(held.items())))

    def for_engines(self) -> EngineConfig:
        """Only the engine sections' options: what is sent to the engines (validated again)."""
        if type(self) is EngineConfig:
            return self
        return EngineConfig(**{f.name: getattr(self, f.name) for f in _fields(EngineConfig)})

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

    def replicas(self, engines: int) -> int:
        """Data-parallel replicas on `engines` engines: each a whole pipeline (model, hybrid)
        or a tensor-parallel group (tensor); sharded engines each take their own samples."""
        return int(describe(self.strategy).replicas(self, engines))

    def _check_owned_options(self, strategy: Any) -> None:
        """An option that only some strategies use must keep its default under the others
        (--partitions 2 with --strategy data would silently train something else)."""
        for option in every_option(type(self)):
            value = self.option(option.name)
            if value == option.default:
                continue
            owners = option_owners(option.name)
            if owners and strategy.name not in owners:
                negated = f"{option.flag(value)} " if value is False else ""
                needs = f"{negated}needs --strategy {' or '.join(owners)}"
                raise ConfigError(option.name, value, needs)

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
            option.flag(self.option(option.name))
            for option in every_option(type(self))
            if self.option(option.name) != option.default
        ]
        return " ".join(["%%smp_train", *parts])


@_strategy_keywords
@dataclass(frozen=True, kw_only=True)
class TrainConfig(EngineConfig):
    """Everything `%%smp_train` and `sagenb.train` accept: the engines' options and those
    only the notebook uses (display, cost, output), which `for_engines()` leaves behind."""

    # -- going on --
    continue_: bool = _opt(
        "segments",
        False,
        "go on from the state the engines keep of this cell's last run (after its last "
        "step; --steps and --epochs stay the run's total; --lr, --eval-every and the stop "
        "options may change; the options left out are that run's), without disk; refused "
        "when the state was released or the cell or its layout changed",
        panel=False,
    )
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
    # -- pool --
    if_busy: str = _opt(
        "pool",
        "wait",
        "when another run (another notebook on the same ipcluster pool, another thread) holds "
        "the pool, or the run's engines run someone's task started outside sagenb (the px magic, "
        "apply_async): wait for it, saying whose and since when, or fail at once; either way "
        "before the run sends its engines anything (a killed kernel's tasks are ended instead)",
        choices=IF_BUSY,
    )

    def __post_init__(self) -> None:
        """The engine options' checks, then the notebook's. --instance and --price-table
        are checked where the price table is read (cost.check_price), before any engine
        starts: validation reads no file."""
        super().__post_init__()
        if self.price_per_hour is not None:
            check_positive(self, "price_per_hour")
        if not (isinstance(self.spot_discount, (int, float)) and 0 <= self.spot_discount <= 0.95):
            raise ConfigError("spot_discount", self.spot_discount, "must be between 0 and 0.95")
        if not isinstance(self.instance, str) or not self.instance:
            raise ConfigError("instance", self.instance, "must be an instance type's name")
        check_writable_dir("log_dir", self.log_dir)
        for name in ("price_table", "hardware_table"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "must be a JSON file's path")
        check_out(self.out)
        check_choice(self, "if_busy", IF_BUSY)
        if self.continue_ and self.resume:
            raise ConfigError(
                "continue_",
                True,
                "goes on from the engines' memory and --resume from a checkpoint: give one",
            )


def _fields(config: Any) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(config)


def option_owners(name: str) -> tuple[str, ...]:
    """The strategies that declare option `name` (their `options`): the others refuse any
    value but its default; none (a field of the config): every strategy accepts it."""
    declared = declared_options()
    return declared[name][1] if name in declared else ()


# -- every option: the config's fields and the options the strategies declare --------------


def every_option(config: type = TrainConfig) -> tuple[Option, ...]:
    """Every option `config` takes, as Options, section by section (SECTIONS order): the
    section's fields in their order, then the options the registered strategies declare in it
    (in --strategy's order). The flags, to_flags, the flag reference, the export and the
    control panel all read this."""
    options = (*_field_options(config), *_declared().values())
    return tuple(option for section in SECTIONS for option in options if option.section == section)


@functools.cache
def _field_options(config: type) -> tuple[Option, ...]:
    """The fields of `config` as Options (but `strategy_options`, which holds others), once
    per class: reading the type hints of every field costs a few milliseconds."""
    return tuple(_field_option(f, config) for f in dataclasses.fields(config) if f.name != _HOLDER)


def _field_option(f: dataclasses.Field, config: type) -> Option:
    meta = f.metadata
    return Option(
        f.name,
        meta["section"],
        f.default,
        meta["help"],
        type=field_type(f, config),
        choices=meta.get("choices"),
        parse=meta.get("parse"),
        shown=meta.get("shown"),
        panel=meta.get("panel", True),
    )


def _declared() -> dict[str, Option]:
    """The options the registered strategies declare, by name, refusing one that cannot be an
    option like the others: a name a field has, or a section that stays in the notebook (the
    values travel to the engines, in EngineConfig)."""
    declared = declared_options()
    for name, (option, owners_of) in declared.items():
        owners = " and ".join(owners_of)
        if name in TrainConfig.__dataclass_fields__:
            raise RuntimeError(
                f"strategy {owners} declares option {name!r}, which is a field of the config "
                "already: give it a name of its own (its strategy's name first, say)"
            )
        if option.section not in SECTIONS or not SECTIONS[option.section].engines:
            engine_sections = ", ".join(n for n, s in SECTIONS.items() if s.engines)
            raise RuntimeError(
                f"strategy {owners} declares option {name!r} in section {option.section!r}: "
                f"it must be one of the sections sent to the engines ({engine_sections})"
            )
    return {name: option for name, (option, _) in declared.items()}


def _unknown(name: str, config: type, declared: Mapping[str, Option]) -> str:
    """What is allowed instead of option `name`, which neither `config` nor a strategy has."""
    if name in TrainConfig.__dataclass_fields__:  # given to EngineConfig
        return (
            f"is the notebook's own option (TrainConfig's): {config.__name__} holds those sent "
            "to the engines"
        )
    if declared:
        flags = ", ".join(
            f"{flag_name(n)} (--strategy {' or '.join(option_owners(n))})" for n in declared
        )
        theirs = f"the strategies declare {flags}"
    else:
        theirs = "no strategy declares options of its own"
    candidates = [o.name for o in every_option(config)]
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f"did you mean {flag_name(close[0])}? " if close else ""
    return (
        f"is no option: {hint}{config.__name__}'s options are listed in docs/flags.md, and {theirs}"
    )
