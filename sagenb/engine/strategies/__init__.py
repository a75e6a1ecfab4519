"""Parallelism strategies: each module describes one strategy (`Description`) and implements
how one engine takes part in a step (`Strategy`).

`describe(name)` answers for the strategy called `name`; `names()` lists them. Both find the
strategies by importing every module of this package and collecting its `DESCRIPTIONS`, so a
new strategy, its options included, is one new module or folder (docs/architecture.md). The
config asks the same registry through its seam (config/registry.py), which this package fills
as it loads: the config imports nothing of the engine side.
"""

from __future__ import annotations

import copyreg
import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

import torch

from sagenb.config import registry
from sagenb.config.errors import ConfigError

from .base import Strategy
from .description import Description

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["Description", "Strategy", "describe", "make_strategy", "names"]


@functools.cache
def _registry() -> dict[str, Description]:
    found: dict[str, Description] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for description in getattr(module, "DESCRIPTIONS", ()):
            if description.name in found:
                raise RuntimeError(
                    f"strategy {description.name!r} is described twice: in {module.__name__} "
                    f"and {type(found[description.name]).__module__}"
                )
            found[description.name] = description
            # one instance per strategy, also after pickling: a description travels as its name
            copyreg.pickle(type(description), _by_name)
    return dict(sorted(found.items(), key=lambda item: (item[1].menu_order, item[0])))


def _by_name(description: Description) -> tuple[Any, tuple[str]]:
    return describe, (description.name,)


def names() -> tuple[str, ...]:
    """Every --strategy value, the default (data) first."""
    return tuple(_registry())


def describe(name: str) -> Description:
    """The description of strategy `name`; a ConfigError lists the known ones otherwise."""
    try:
        return _registry()[name]
    except (KeyError, TypeError):
        raise ConfigError("strategy", name, f"must be one of {', '.join(names())}") from None


def make_strategy(
    config: EngineConfig, *, rank: int, world_size: int, device: torch.device
) -> Strategy:
    """The engine-side implementation of `config.strategy` for one rank."""
    return describe(config.strategy).build(config, rank=rank, world_size=world_size, device=device)


registry.provide(_registry)
