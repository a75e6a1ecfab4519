"""What a run costs on a chosen cloud instance, from a small dated price table.

instances = ceil(engines / engines per instance), where an instance hosts one engine per
accelerator (one engine per CPU-only instance); cost = instances x price per hour x hours.
Every figure carries the date of its price.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

__all__ = ["InstancePrice", "CostMeter", "price_table", "instance_price"]


@dataclass(frozen=True)
class InstancePrice:
    name: str
    usd_per_hour: float
    accelerators: int
    accelerator: str
    source: str
    as_of: str

    @property
    def engines_per_instance(self) -> int:
        return max(1, self.accelerators)


@lru_cache(maxsize=1)
def price_table() -> dict[str, InstancePrice]:
    raw = json.loads(resources.files("sagenb").joinpath("data/prices.json").read_text())
    return {
        name: InstancePrice(
            name=name,
            usd_per_hour=row["usd_per_hour"],
            accelerators=row["accelerators"],
            accelerator=row["accelerator"],
            source=raw["source"],
            as_of=raw["as_of"],
        )
        for name, row in raw["instances"].items()
    }


def instance_price(name: str) -> InstancePrice:
    table = price_table()
    if name not in table:
        raise KeyError(f"unknown instance {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


#: Managed spot training's saving assumed when none is given. AWS quotes "up to 90%" against
#: on-demand; 70% is a middle figure, not a promise: pass your own to CostMeter.
SPOT_DISCOUNT = 0.7


@dataclass(frozen=True)
class CostMeter:
    """Cost of `engines` engines on `price`'s instance type, as time passes."""

    price: InstancePrice
    engines: int
    spot_discount: float = SPOT_DISCOUNT

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
