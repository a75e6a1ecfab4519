"""The strategies as the config and the notebook side know them: a seam the strategies fill.

The config validates a run against its strategy (its options, its checks, how it splits a
batch), but the strategies live on the engine side (engine/strategies/), which imports the
config: were the config to import them, the ground floor would stand on an upper one. So the
config asks this module, and the strategies' package, when it loads, hands it the registry it
builds (`provide`). What makes sure the strategies are loaded before the config asks is the
package's face: `sagenb/__init__.py` gives `loads_with` the import of the strategies, which runs
the first time a question comes here, in the notebook, in an exported script and on an engine
that unpickles a config alike (unpickling imports `sagenb` first).

`Described` is what is asked of a strategy on this side; the strategies' `Description`
(engine/strategies/description.py) answers it, and adds what only the engines ask (the
implementation that trains, the estimate's attribution).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sagenb.config.errors import ConfigError
from sagenb.config.spec import Option

__all__ = [
    "DEFAULT_ENGINES",
    "Described",
    "declared_options",
    "describe",
    "loads_with",
    "names",
    "provide",
]

#: engines a pool starts with when nothing says otherwise
DEFAULT_ENGINES = 2

_provider: Callable[[], Mapping[str, Described]] | None = None
_loader: Callable[[], None] | None = None


class Described(Protocol):
    """One strategy, as the config and the notebook ask it (each answer documented where the
    strategies answer it, engine/strategies/description.py)."""

    @property
    def name(self) -> str: ...
    @property
    def summary(self) -> str: ...
    @property
    def pipelined(self) -> bool: ...
    @property
    def syncs_norm(self) -> bool: ...
    @property
    def whole_model_per_rank(self) -> bool: ...
    @property
    def options(self) -> tuple[Option, ...]: ...

    def check(self, config: Any) -> None: ...
    def engines_to_start(self, config: Any) -> int: ...
    def engines_for(self, config: Any, available: int) -> int: ...
    def replicas(self, config: Any, engines: int) -> int: ...
    def split(self, config: Any, engines: int) -> tuple[int, str]: ...
    def layout(self, config: Any, engines: int) -> str: ...
    def bubble(self, config: Any) -> float: ...
    def splits_backward(self, config: Any) -> bool: ...
    def inner_collectives(self, config: Any, engines: int) -> tuple[int, tuple[str, ...]]: ...


def provide(provider: Callable[[], Mapping[str, Described]]) -> None:
    """Called by the strategies' package as it loads: `provider` gives every strategy by name,
    in --strategy's order (asked each time, so the package may find more later)."""
    global _provider
    _provider = provider


def loads_with(loader: Callable[[], None]) -> None:
    """How to load the strategies when a question comes before they are: the package's face
    gives it (sagenb/__init__.py)."""
    global _loader
    _loader = loader


def _described() -> Mapping[str, Described]:
    if _provider is None and _loader is not None:
        _loader()
    if _provider is None:
        raise RuntimeError(
            "no strategy is registered: import sagenb.engine.strategies before asking the "
            "config (importing sagenb does it on the first question)"
        )
    return _provider()


def names() -> tuple[str, ...]:
    """Every --strategy value, the default (data) first."""
    return tuple(_described())


def describe(name: str) -> Described:
    """The strategy called `name`; a ConfigError lists the known ones otherwise."""
    try:
        return _described()[name]
    except (KeyError, TypeError):
        raise ConfigError("strategy", name, f"must be one of {', '.join(names())}") from None


def declared_options() -> dict[str, tuple[Option, tuple[str, ...]]]:
    """The options strategies declare of their own, by name, each with the strategies that
    declare it (in --strategy's order). Strategies may share an option (as model and hybrid
    share --partitions) by declaring the same Option; two different ones of a name would make
    its flag mean two things, and are refused."""
    found: dict[str, tuple[Option, tuple[str, ...]]] = {}
    for name, description in _described().items():
        for option in description.options:
            known, owners = found.get(option.name, (option, ()))
            if known != option:
                raise RuntimeError(
                    f"strategies {owners[0]!r} and {name!r} declare different options named "
                    f"{option.name!r}: share one Option, or give each its own name"
                )
            found[option.name] = (option, (*owners, name))
    return found
