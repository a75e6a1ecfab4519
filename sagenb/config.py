"""Training configuration: plain, picklable, keyword-only dataclasses.

One source of truth for every option. The magic builds its argparse flags from these fields
(`--batch-size` for `batch_size`), the control panel will set the same fields, and a script
passes them as keyword arguments. Validation that needs nothing but the values happens in
`__post_init__`, so an impossible config never reaches an engine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STRATEGIES",
    "AVAILABLE_STRATEGIES",
    "ConfigError",
    "TrainConfig",
    "flag_name",
]

#: Every strategy of the contract, and the ones this version can run.
STRATEGIES = ("data", "model", "hybrid", "sharded", "tensor")
AVAILABLE_STRATEGIES = ("data",)


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


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything `%%smp_train` and `sagenb.train` accept; the magic's flags mirror these fields."""

    strategy: str = _opt("data", "parallelism strategy", choices=STRATEGIES)
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
    threads: int | None = _opt(
        None, "torch threads per engine (default: the machine's cores / engines, at least 1)"
    )
    timeout: float = _opt(
        300.0, "seconds a collective may wait for a peer before the run fails (process group)"
    )
    dashboard: bool = _opt(True, "show the live dashboard under the cell", flag="--no-dashboard")
    out: str = _opt("smp_result", "name of the notebook variable that receives the result")

    def __post_init__(self) -> None:
        _check_choice(self, "strategy", STRATEGIES)
        if self.strategy not in AVAILABLE_STRATEGIES:
            raise ConfigError(
                "strategy",
                self.strategy,
                f"not available yet in this version; available: {', '.join(AVAILABLE_STRATEGIES)}",
            )
        for name in ("batch_size", "epochs", "grad_accum"):
            _check_int(self, name, minimum=1)
        for name in ("steps", "engines", "threads"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1)
        _check_int(self, "seed", minimum=0)
        _check_int(self, "eval_every", minimum=0)
        _check_positive(self, "lr", allow_zero=True)
        _check_positive(self, "timeout")
        if self.clip_grad_norm is not None:
            _check_positive(self, "clip_grad_norm")
        from sagenb.cost import price_table  # local: the table is read on first use

        if self.instance not in price_table():
            known = ", ".join(sorted(price_table()))
            raise ConfigError("instance", self.instance, f"must be one of {known}")
        if not self.out.isidentifier():
            raise ConfigError("out", self.out, "must be a valid Python identifier")
        if self.engines is not None:
            self.check_split(self.engines)

    def check_split(self, engines: int) -> None:
        """The global batch must split evenly into grad-accum slices across `engines`."""
        pieces = engines * self.grad_accum
        if self.batch_size % pieces:
            lower = (self.batch_size // pieces) * pieces or pieces
            raise ConfigError(
                "batch_size",
                self.batch_size,
                f"must be divisible by engines x grad-accum = {engines} x {self.grad_accum} "
                f"= {pieces}; try {lower} or {lower + pieces}",
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
            else:
                parts.append(f"{flag_name(f.name)} {value}")
        return " ".join(["%%smp_train", *parts])


def _check_choice(cfg: TrainConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(choices)}")


def _check_int(cfg: TrainConfig, name: str, *, minimum: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"must be an integer >= {minimum}")


def _check_positive(cfg: TrainConfig, name: str, *, allow_zero: bool = False) -> None:
    value = getattr(cfg, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(name, value, f"must be a finite number {bound}")
