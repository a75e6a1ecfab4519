"""One option as a spec: what the config's fields say of themselves, and what a strategy
declares for an option of its own (`Description.options`).

An `Option` carries what a field of the config carries (options.py `_opt`: its section, default
and help, and optionally its choices, how its flag's text is parsed, how the flag reference
words its default, whether the control panel shows it) and its type. From it alone come its
flag, its row of the flag reference and its widget, whether it is a field of the config or an
option a strategy declares in its own module. This module imports only the error of a bad
value, so the engine side (a strategy's module) imports it without importing the options, which
import the strategies.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sagenb.config.errors import ConfigError, flag_name

__all__ = ["Option", "field_type"]

#: what a value of each plain type must be, for the message when it is not
_WORDS = {int: "an integer", float: "a finite number", bool: "True or False", str: "a string"}


@dataclass(frozen=True)
class Option:
    """An option: `name` (the keyword; `--name-with-dashes` is its flag), its `section` (a key
    of options.SECTIONS; a strategy's own is in one sent to the engines), `default` and `help`
    (one line, as argparse takes it: a % written %%). `type` is what the flag's text converts
    to (default: the default's type; give it where the default is None). `choices`: a tuple, or
    a function that returns one; `parse`: the flag's text -> the value, where the type alone
    cannot read it; `shown`: the default as the flag reference words it; `panel=False`: the
    control panel leaves it out and keeps the value it was given. Values must be hashable (a
    tuple, not a list), as the frozen config that holds them is."""

    name: str
    section: str
    default: Any
    help: str
    type: Any = None
    choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None
    parse: Callable[[str], Any] | None = None
    shown: str | None = None
    panel: bool = True

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"option {self.name!r}: its name must be a Python identifier")
        if self.type is None:
            if self.default is None:
                raise ValueError(f"option {self.name!r}: a default of None needs type=...")
            object.__setattr__(self, "type", builtins.type(self.default))

    @property
    def is_switch(self) -> bool:
        """A bool: a `--x` switch (off by default) or `--x/--no-x` (on), taking no value."""
        return isinstance(self.default, bool)

    def flag(self, value: Any) -> str:
        """The flag that sets this option to `value`: `--resume`, `--no-dashboard`,
        `--cuts 2,4` (what `to_flags` and the flags' messages write)."""
        if self.is_switch:
            return flag_name(self.name) if value else "--no-" + flag_name(self.name)[2:]
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        return f"{flag_name(self.name)} {value}"

    def allowed(self) -> tuple[Any, ...] | None:
        """Its choices (asked now, where a function gives them), or None: any value of its
        type."""
        values = self.choices() if callable(self.choices) else self.choices
        return tuple(values) if values is not None else None

    def convert(self, value: Any) -> Any:
        """`value` as this option holds it: text read by `parse`, an int for a float option
        made a float; a ConfigError names the option, the value and what is allowed."""
        if value is None and self.default is None:
            return None
        if self.parse is not None and isinstance(value, str) and self.type is not str:
            value = self.parse(value)
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not self._is_its_type(value):
            unset = " or None" if self.default is None else ""
            word = _WORDS.get(self.type, f"a {getattr(self.type, '__name__', self.type)}")
            raise ConfigError(self.name, value, f"must be {word}{unset}")
        choices = self.allowed()
        if choices is not None and value not in choices:
            raise ConfigError(self.name, value, f"must be one of {', '.join(map(str, choices))}")
        return value

    def _is_its_type(self, value: Any) -> bool:
        if self.type is float:
            return isinstance(value, float) and math.isfinite(value)
        if self.type is int:  # True is an int to Python, not to a flag
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, self.type)


def field_type(f: dataclasses.Field, config: type) -> Any:
    """The type a flag's text converts to: `int` for `int | None` (`config`: the dataclass
    that declares `f`)."""
    hint = typing.get_type_hints(config)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint
