"""What a run costs on a chosen cloud instance, from a small dated price table.

instances = ceil(engines / engines per instance), where an instance hosts one engine per
accelerator (one engine per CPU-only instance); cost = instances x price per hour x hours.
Every figure carries the date of its price.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Protocol, TypeGuard

from sagenb.config.files import read_small

__all__ = [
    "InstancePrice",
    "CostMeter",
    "check_price",
    "price_table",
    "instance_price",
    "meter_for",
    "seconds_span",
    "seconds_text",
]


@dataclass(frozen=True)
class InstancePrice:
    name: str
    usd_per_hour: float
    accelerators: int
    accelerator: str
    accelerator_memory_gib: float
    source: str
    as_of: str

    @property
    def engines_per_instance(self) -> int:
        return max(1, self.accelerators)


#: the largest table read (the package's are a few KiB): --price-table /dev/zero grew the
#: kernel to 22 GB until the OOM killer ended it, and a 2 GB file was read whole to be refused
MAX_TABLE_BYTES = 4 * 2**20


def read_table(packaged: str, path: str | None) -> Any:
    """A JSON table: the file at `path`, else the package's sagenb/sizing/tables/`packaged` (the
    price table here, the hardware table in hardware.py: one shape of loading for both)."""
    if path is None:
        table = resources.files("sagenb.sizing").joinpath(f"tables/{packaged}")
        return json.loads(table.read_text())
    return json.loads(read_small(path, MAX_TABLE_BYTES))


@lru_cache(maxsize=8)
def price_table(path: str | None = None) -> dict[str, InstancePrice]:
    """The package's table, or a JSON file of the same shape (`--price-table FILE`)."""
    raw = read_table("prices.json", path)
    _check_table(raw)
    return {
        name: InstancePrice(
            name=name,
            usd_per_hour=row["usd_per_hour"],
            accelerators=row["accelerators"],
            accelerator=row.get("accelerator", ""),
            accelerator_memory_gib=row.get("accelerator_memory_gib", 0),
            source=raw.get("source", str(path)),
            as_of=raw.get("as_of", "undated"),
        )
        for name, row in raw["instances"].items()
    }


def _check_table(raw: Any) -> None:
    """The table's shape, checked before any engine starts (check_price): a bad row must not
    surface as a TypeError at the first dashboard tick, or after the run, discarding its
    result."""
    instances = raw.get("instances") if isinstance(raw, dict) else None
    if not isinstance(instances, dict) or not instances:
        raise ValueError(
            'must be a JSON object with "instances": {name: {"usd_per_hour": number, '
            '"accelerators": integer}, ...} (the shape of sagenb/sizing/tables/prices.json)'
        )
    for name, row in instances.items():
        price = row.get("usd_per_hour") if isinstance(row, dict) else None
        count = row.get("accelerators") if isinstance(row, dict) else None
        if not _number(price) or price < 0:
            raise ValueError(f"instances[{name!r}].usd_per_hour must be a number >= 0")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"instances[{name!r}].accelerators must be an integer >= 0")


def _number(value: Any) -> TypeGuard[float]:
    """A finite int or float, not a bool (a TypeGuard, so that `price < 0` after it checks)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def instance_price(
    name: str, *, table: str | None = None, usd_per_hour: float | None = None
) -> InstancePrice:
    """The instance's row; `usd_per_hour` replaces its price (the user's own, dated today)."""
    prices = price_table(table)
    if name not in prices:
        raise KeyError(f"unknown instance {name!r}; known: {', '.join(sorted(prices))}")
    row = prices[name]
    if usd_per_hour is None:
        return row
    today = datetime.date.today().isoformat()
    return dataclasses.replace(
        row, usd_per_hour=usd_per_hour, source="--price-per-hour", as_of=today
    )


#: "projected on I: ..." when no estimate of the run was made
NO_ESTIMATE = "no estimate (%%smp_plan with the same flags)"


class Projected(Protocol):
    """Seconds per step on the instance, (low, high), once known, and why not when not
    (sagenb.sizing.projection.Projection)."""

    step_time_s: tuple[float, float] | None
    why: str


#: Managed spot training's saving assumed when none is given. AWS quotes "up to 90%" against
#: on-demand; 70% is a middle figure, not a promise: pass your own to CostMeter.
SPOT_DISCOUNT = 0.7


@dataclass(frozen=True)
class CostMeter:
    """Cost of `engines` engines on `price`'s instance type, as time passes."""

    price: InstancePrice
    engines: int
    spot_discount: float = SPOT_DISCOUNT
    #: what the engines run on: "cpu" or the GPU's name (None: not known). The measured time
    #: is billed at the instance's price only when that is the instance's kind of hardware.
    runs_on: str | None = None
    #: seconds per step on the instance from an estimate of this job with these options
    #: (sagenb.estimate / %%smp_plan, or the run's own, made in the background); None: none
    projection: Projected | None = None

    @property
    def billed_here(self) -> bool:
        """Whether the engines run on the instance's kind of hardware (a CPU for a CPU-only
        instance; a GPU whose name has the instance's accelerator model, e.g. A100)."""
        if self.runs_on is None:
            return False
        if self.price.accelerators == 0:
            return self.runs_on == "cpu"
        model = self.price.accelerator.split(" ")[0]
        return self.runs_on != "cpu" and bool(model) and model.lower() in self.runs_on.lower()

    def this_run(self, elapsed_s: float) -> str:
        """'this run': the measured time, priced only on the instance's kind of hardware."""
        if self.billed_here:
            return f"this run: {self.label(elapsed_s)}"
        where = self.runs_on or "engines of unknown hardware"
        return (
            f"this run: {elapsed_s:.1f} s on {where} (not a {self.price.name}: not priced as one)"
        )

    def projected_on(self, steps_total: int, steps_done: int = 0) -> str:
        """'projected on I': the estimate's step time x this run's steps, with the measured
        progress (steps done of steps_total)."""
        name = f"{self.instances} x {self.price.name}"
        step_time_s = self.projection.step_time_s if self.projection is not None else None
        if step_time_s is None or steps_total <= 0:
            why = self.projection.why if self.projection is not None else NO_ESTIMATE
            return f"projected on {name}: {why}"
        low, high = (steps_total * s for s in step_time_s)
        done = f", {steps_done}/{steps_total} steps done" if steps_done else ""
        return (
            f"projected on {name}: {seconds_span(low, high)}, "
            f"{_usd_range(self.cost(low), self.cost(high))} (estimate{done})"
        )

    def spot(self, on_demand_usd: float) -> float:
        """The same work at spot prices (spot_discount off on-demand)."""
        return on_demand_usd * (1 - self.spot_discount)

    @property
    def instances(self) -> int:
        return math.ceil(self.engines / self.price.engines_per_instance)

    def cost(self, elapsed_s: float) -> float:
        return self.instances * self.price.usd_per_hour * elapsed_s / 3600.0

    def projected(self, elapsed_s: float, steps_done: int, steps_total: int) -> float:
        """Cost at completion if the remaining steps run at the pace measured so far."""
        if steps_done <= 0:
            return 0.0
        return self.cost(elapsed_s * steps_total / steps_done)

    def label(self, elapsed_s: float) -> str:
        return (
            f"${self.cost(elapsed_s):.4f} on {self.instances} x {self.price.name} "
            f"(${self.price.usd_per_hour:.3f}/h, price as of {self.price.as_of})"
        )


#: (below this many seconds, unit, seconds per unit) for a time, by its value or a range's top
_UNITS = (
    (1e-6, "ns", 1e-9),
    (1e-3, "µs", 1e-6),
    (0.1, "ms", 1e-3),
    (600, "s", 1.0),
    (36000, "min", 60.0),
)


def _unit(seconds: float) -> tuple[str, float]:
    return next(((u, n) for below, u, n in _UNITS if seconds < below), ("h", 3600.0))


def seconds_span(low: float, high: float) -> str:
    """A range of seconds in one unit that reads without an exponent, chosen by its upper
    end: a toy model on a large instance is "21.7-51.5 µs", not "2.17e-05-5.15e-05 s", and a
    long run "11.1-22.2 h", not "4e+04-8e+04 s"."""
    unit, size = _unit(high)
    return f"{low / size:.3g}-{high / size:.3g} {unit}"


def seconds_text(seconds: float) -> str:
    """One time, as seconds_span gives a range ("0 s" for none)."""
    if not seconds:
        return "0 s"
    unit, size = _unit(seconds)
    return f"{seconds / size:.3g} {unit}"


def _usd_range(low: float, high: float) -> str:
    """Dollars to the cent's hundredth; a range below that (a toy model's projection on a
    large instance) as "under $0.0001", not as $0.0000 nor as "$2e-07-$4e-07", and one that
    starts below it as "up to $0.0005", not "$0.0000-$0.0005"."""
    if high < 1e-4:
        return "under $0.0001"
    if low < 1e-4:
        return f"up to ${high:.4f}"
    return f"${low:.4f}-${high:.4f}"


def check_price(config: Any) -> InstancePrice:
    """The price of `config.instance` (--price-table's row, or --price-per-hour), or a
    ConfigError naming the option, its value and what is allowed. This reads the table, so
    it is not part of the config's validation (which reads no file): `sagenb.train`,
    `sagenb.plan`, the export and the control panel call it before any engine starts."""
    from sagenb.config.errors import ConfigError

    try:
        table = price_table(config.price_table)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("price_table", config.price_table, f"cannot be read: {exc}") from None
    if config.instance not in table:
        known = ", ".join(sorted(table))
        raise ConfigError("instance", config.instance, f"must be one of {known}")
    return instance_price(
        config.instance, table=config.price_table, usd_per_hour=config.price_per_hour
    )


def meter_for(
    config: Any,
    engines: int,
    *,
    runs_on: str | None = None,
    projection: Projected | None = None,
) -> CostMeter:
    """The cost meter a run with `config` on `engines` engines uses (ConfigError for an
    instance or price table it cannot use, as check_price)."""
    return CostMeter(
        check_price(config),
        engines,
        spot_discount=config.spot_discount,
        runs_on=runs_on,
        projection=projection,
    )
