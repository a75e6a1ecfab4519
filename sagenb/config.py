"""Training configuration: plain, picklable, keyword-only dataclasses.

One source of truth for every option. The magic builds its argparse flags from these fields
(`--batch-size` for `batch_size`), the control panel will set the same fields, and a script
passes them as keyword arguments. Validation that needs nothing but the values happens in
`__post_init__`, so an impossible config never reaches an engine.
"""

from __future__ import annotations

import builtins
import dataclasses
import keyword
import math
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BOOL_FLAGS",
    "ConfigError",
    "TrainConfig",
    "flag_name",
]

PRECISIONS = ("fp32", "bf16", "fp16")
#: engines a pool starts with when nothing says otherwise
DEFAULT_ENGINES = 2
#: options that are off unless their flag is given (`--resume`)
BOOL_FLAGS = ("delay_init", "activation_checkpointing", "resume", "stop_on_nonfinite")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: numpy seeds take 32 bits (the cell's RNGs are all seeded with --seed)
MAX_SEED = 2**32 - 1
#: beyond a week the process groups' own timeout (--timeout + 60 s) overflows gloo's
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: torch threads per engine: more than any machine's cores only makes its thread pool fail
MAX_THREADS = 1024
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


class ConfigError(ValueError):
    """An option has a value that is not allowed; says which, the value and what is allowed."""

    def __init__(self, name: str, value: Any, allowed: str) -> None:
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"{flag_name(name)} {value!r}: {allowed}")


def flag_name(name: str) -> str:
    """The magic's spelling of a config field: `batch_size` -> `--batch-size`."""
    return "--" + name.replace("_", "-")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def strategy_names() -> tuple[str, ...]:
    """Every --strategy value: the strategies describe themselves (engine/strategies/)."""
    from sagenb.engine.strategies import names

    return names()


def describe(name: str) -> Any:
    """The description of strategy `name` (engine/strategies/description.py); imported here
    on first use, as the strategy modules import this one."""
    from sagenb.engine.strategies import describe as _describe

    return _describe(name)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything `%%smp_train` and `sagenb.train` accept; the magic's flags mirror these fields."""

    strategy: str = _opt("data", "parallelism strategy", choices=strategy_names)
    engines: int | None = _opt(
        None, "engines to train on (default: every engine of the running pool, or 2 when none runs)"
    )
    batch_size: int = _opt(32, "global batch size per optimizer step, split evenly across engines")
    epochs: int = _opt(1, "passes over the dataset")
    steps: int | None = _opt(
        None, "stop after this many optimizer steps in total (default: run every epoch)"
    )
    lr: float = _opt(1e-3, "learning rate of the default AdamW optimizer")
    seed: int = _opt(0, "seed of torch's RNG before the cell runs, and of the sample order")
    grad_accum: int = _opt(1, "slices of the global batch accumulated per optimizer step")
    clip_grad_norm: float | None = _opt(
        None, "clip the global gradient norm (over every engine) to this value"
    )
    eval_every: int = _opt(
        0, "evaluate eval_dataset every N optimizer steps (0: once, after training)"
    )
    instance: str = _opt("ml.p4d.24xlarge", "instance type whose price the cost estimate uses")
    price_per_hour: float | None = _opt(
        None, "your own USD per instance-hour for --instance, instead of the table's"
    )
    price_table: str | None = _opt(
        None, "a JSON price table of your own (the shape of sagenb/data/prices.json)"
    )
    spot_discount: float = _opt(0.7, "spot price's saving against on-demand, 0 to 0.95")
    threads: int | None = _opt(
        None, "torch threads per engine (default: the machine's cores / engines, at least 1)"
    )
    data_workers: int = _opt(
        0, "processes per engine that load the next batches while a step trains (0: none)"
    )
    timeout: float = _opt(
        300.0,
        "seconds without progress (no rank finishing a step) before the run is stopped as "
        "stalled and its engines replaced",
    )
    partitions: int = _opt(1, "pipeline stages the model is split into (model, hybrid)")
    microbatches: int = _opt(4, "microbatches each pipeline splits a batch slice into")
    schedule: str = _opt(
        "1f1b",
        "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (backwards as early "
        "as possible), interleaved (1F1B over --virtual-stages chunks per engine)",
        choices=SCHEDULES,
    )
    virtual_stages: int = _opt(2, "model chunks per engine with --schedule interleaved")
    partition_by: str = _opt(
        "auto",
        "how cut points are chosen: auto (balance measured time within --memory-budget), "
        "parameters (balance parameter counts), uniform (equal block counts), manual (--cuts)",
        choices=PARTITION_METHODS,
    )
    cuts: tuple[int, ...] = _opt(
        (),
        "blocks where stages 2, 3, ... begin, e.g. 2,4 (with --partition-by manual)",
        parse=parse_cuts,
    )
    memory_budget: float | None = _opt(
        None, "GiB one engine may hold (auto partitioning keeps every stage within it)"
    )
    delay_init: bool = _opt(
        False,
        "build the model's parameters on the meta device and materialise only each engine's "
        "own stage (a model larger than one engine); initial values as documented",
    )
    tensor_parallel: int | None = _opt(
        None,
        "engines each Linear layer is split across (--strategy tensor; default: every engine); "
        "data parallel across the rest",
    )
    reshard_after_forward: bool = _opt(
        True,
        "--strategy sharded: free each block's gathered parameters after its forward and "
        "gather them again for backward (ZeRO-3); --no-reshard-after-forward keeps them "
        "(ZeRO-2: more memory, less communication)",
    )
    activation_checkpointing: bool = _opt(
        False,
        "recompute each repeated block's activations in backward instead of keeping them "
        "(less memory, about a third more compute)",
    )
    precision: str = _opt(
        "fp32",
        "compute precision: fp32, bf16 (autocast) or fp16 (autocast with a dynamic loss "
        "scaler); parameters and optimizer state stay fp32",
        choices=PRECISIONS,
    )
    checkpoint_dir: str | None = _opt(
        None, "directory for checkpoints (model, optimizer, scheduler, step, RNG)"
    )
    checkpoint_every: int = _opt(
        0, "write a checkpoint every N steps (0: only at the end, or when interrupted)"
    )
    resume: bool = _opt(False, "continue from the newest checkpoint in --checkpoint-dir")
    stop_on_nonfinite: bool = _opt(
        False,
        "end the run cleanly, history kept, after the first step whose loss is NaN or infinite "
        "(without it the run goes on, with a warning)",
    )
    dashboard: bool = _opt(True, "show the live dashboard under the cell", flag="--no-dashboard")
    out: str = _opt("smp_result", "name of the notebook variable that receives the result")

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
        from sagenb.cost import price_table  # local: the table is read on first use

        try:
            table = price_table(self.price_table)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError("price_table", self.price_table, f"cannot be read: {exc}") from None
        if self.instance not in table:
            known = ", ".join(sorted(table))
            raise ConfigError("instance", self.instance, f"must be one of {known}")
        if self.price_per_hour is not None:
            _check_positive(self, "price_per_hour")
        if not (isinstance(self.spot_discount, (int, float)) and 0 <= self.spot_discount <= 0.95):
            raise ConfigError("spot_discount", self.spot_discount, "must be between 0 and 0.95")
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
        return describe(self.strategy).replicas(self, engines)

    def _check_own_options(self, strategy: Any) -> None:
        """An option that only some strategies use must keep its default under the others
        (--partitions 2 with --strategy data would silently train something else)."""
        from sagenb.engine.strategies import names

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in strategy.own_options or value == f.default:
                continue
            owners = [n for n in names() if f.name in describe(n).own_options]
            if owners:
                negated = f"--no-{f.name.replace('_', '-')} " if value is False else ""
                needs = f"{negated}needs --strategy {' or '.join(owners)}"
                raise ConfigError(f.name, value, needs)

    def _check_pipeline(self) -> None:
        """The pipeline options' types and choices, for every strategy; the strategies that
        run pipelines check the rest (engine/strategies/pipeline.py)."""
        for name in ("partitions", "microbatches", "virtual_stages"):
            _check_int(self, name, minimum=1)
        _check_choice(self, "schedule", SCHEDULES)
        _check_choice(self, "partition_by", PARTITION_METHODS)
        object.__setattr__(self, "cuts", parse_cuts(self.cuts))
        if self.cuts and self.partition_by != "manual":
            raise ConfigError("cuts", self.cuts, "is used only with --partition-by manual")
        if self.memory_budget is not None:
            _check_positive(self, "memory_budget")

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

    def with_engines(self, engines: int) -> TrainConfig:
        """This config with `engines` resolved (validated again)."""
        return dataclasses.replace(self, engines=engines)

    def to_flags(self) -> str:
        """The `%%smp_train` line that gives this config (defaults left out)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name == "dashboard":
                parts.append("--no-dashboard")
            elif f.name == "reshard_after_forward":
                parts.append("--no-reshard-after-forward")
            elif f.name in BOOL_FLAGS:
                parts.append(flag_name(f.name))
            elif f.name == "cuts":
                parts.append(f"--cuts {','.join(map(str, value))}")
            else:
                parts.append(f"{flag_name(f.name)} {value}")
        return " ".join(["%%smp_train", *parts])


def _check_choice(cfg: TrainConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(choices)}")


def _check_int(cfg: TrainConfig, name: str, *, minimum: int, maximum: int | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(name, value, f"must be an integer {bound}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, value, f"must be an integer from {minimum} to {maximum}")


def _check_positive(
    cfg: TrainConfig, name: str, *, allow_zero: bool = False, maximum: float | None = None
) -> None:
    value = getattr(cfg, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    too_big = ok and maximum is not None and value > maximum
    if not ok or value < 0 or (value == 0 and not allow_zero) or too_big:
        bound = ">= 0" if allow_zero else "> 0"
        most = f" and at most {maximum:g}" if maximum is not None else ""
        raise ConfigError(name, value, f"must be a finite number {bound}{most}")
