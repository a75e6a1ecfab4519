"""What an instance's accelerators can do: peak dense TFLOPS per precision, memory, and the
bandwidths between them, from a small dated table beside the price table (issue 16).

tables/hardware.json (beside this module) has one row per instance of tables/prices.json, each with
its sources (vendor datasheets, AWS instance pages); `--hardware-table FILE` replaces it with a
file of the same shape. As with the prices, the file is read where it is used
(`check_hardware`, before any engine starts or any estimate is made), never in the config's
validation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sagenb.sizing.cost import read_table

__all__ = ["Hardware", "hardware_table", "check_hardware", "GPU_ONLY_PRECISIONS"]

#: precisions sagenb runs only on accelerators: autocast to bf16/fp16 on a CPU-only instance
#: would be priced at a peak the table does not have
GPU_ONLY_PRECISIONS = ("bf16", "fp16")
_PEAK_KEYS = ("bf16_tflops", "fp16_tflops", "fp32_tflops", "tf32_tflops")


@dataclass(frozen=True)
class Hardware:
    """One instance type's row of the hardware table."""

    name: str
    accelerator: str
    accelerators: int
    #: peak dense TFLOPS per accelerator, by precision (None: the instance has no such mode)
    peak_tflops: dict[str, float | None]
    #: memory of one accelerator (of the instance, for CPU-only instances), GiB
    memory_gib: float
    #: between the accelerators of one instance, per accelerator, one direction (None: one)
    intra_gb_s: float | None
    intra_link: str
    #: between instances, per instance (network or EFA)
    inter_gbit_s: float
    sources: tuple[str, ...]
    note: str
    as_of: str

    @property
    def engines_per_instance(self) -> int:
        """One engine per accelerator, one per CPU-only instance: as cost.InstancePrice."""
        return max(1, self.accelerators)

    def peak(self, precision: str) -> float | None:
        """Peak dense TFLOPS of one accelerator for `precision` (fp32 as PyTorch runs fp32
        matmuls by default: plain FP32, not TF32; see the table's _about)."""
        return self.peak_tflops.get(f"{precision}_tflops")


@lru_cache(maxsize=8)
def hardware_table(path: str | None = None) -> dict[str, Hardware]:
    """The package's table, or a JSON file of the same shape (`--hardware-table FILE`)."""
    raw = read_table("hardware.json", path)
    _check_table(raw)
    return {name: _row(name, row, raw, path) for name, row in raw["instances"].items()}


def _row(name: str, row: dict[str, Any], raw: dict[str, Any], path: str | None) -> Hardware:
    return Hardware(
        name=name,
        accelerator=row.get("accelerator", ""),
        accelerators=row["accelerators"],
        peak_tflops={key: row.get(key) for key in _PEAK_KEYS},
        memory_gib=row["accelerator_memory_gib"],
        intra_gb_s=row.get("intra_instance_gb_s"),
        intra_link=row.get("intra_instance_link", ""),
        inter_gbit_s=row["inter_instance_gbit_s"],
        sources=tuple(row.get("sources", [raw.get("source", str(path))])),
        note=row.get("note", ""),
        as_of=raw.get("as_of", "undated"),
    )


def _check_table(raw: Any) -> None:
    """The table's shape, checked before anything is estimated: a missing peak must not
    surface as a TypeError in the middle of an estimate."""
    instances = raw.get("instances") if isinstance(raw, dict) else None
    if not isinstance(instances, dict) or not instances:
        raise ValueError(
            'must be a JSON object with "instances": {name: {"accelerators": integer, '
            '"accelerator_memory_gib": number, "fp32_tflops": number, ...}, ...} (the shape '
            "of sagenb/sizing/tables/hardware.json)"
        )
    for name, row in instances.items():
        if not isinstance(row, dict):
            raise ValueError(f"instances[{name!r}] must be an object")
        count = row.get("accelerators")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"instances[{name!r}].accelerators must be an integer >= 0")
        for key in ("accelerator_memory_gib", "inter_instance_gbit_s"):
            if not _positive(row.get(key)):
                raise ValueError(f"instances[{name!r}].{key} must be a number > 0")
        for key in (*_PEAK_KEYS, "intra_instance_gb_s"):
            if row.get(key) is not None and not _positive(row[key]):
                raise ValueError(f"instances[{name!r}].{key} must be a number > 0 or null")
        if count > 1 and row.get("intra_instance_gb_s") is None:
            raise ValueError(
                f"instances[{name!r}].intra_instance_gb_s must be given: it has {count} "
                "accelerators"
            )


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def check_hardware(config: Any) -> Hardware:
    """The hardware row of `config.instance` for `config.precision`, or a ConfigError naming
    the option, its value and what to do: an unreadable --hardware-table, an instance it does
    not list, or a precision the instance cannot run (bf16/fp16 on a CPU-only instance)."""
    from sagenb.config.errors import ConfigError

    path = getattr(config, "hardware_table", None)
    try:
        table = hardware_table(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("hardware_table", path, f"cannot be read: {exc}") from None
    if config.instance not in table:
        known = ", ".join(sorted(table))
        raise ConfigError(
            "instance",
            config.instance,
            f"is not in the hardware table; must be one of {known} (or add its row to a "
            "--hardware-table of your own)",
        )
    row = table[config.instance]
    if row.peak(config.precision) is None:
        with_it = [n for n, r in sorted(table.items()) if r.peak(config.precision) is not None]
        raise ConfigError(
            "precision",
            config.precision,
            f"--instance {config.instance} ({row.accelerator}) has no {config.precision} "
            f"peak: {config.precision} is for accelerators; use --precision fp32 there, or an "
            f"instance with accelerators ({', '.join(with_it[:4])}, ...)",
        )
    return row
