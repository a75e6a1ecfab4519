"""The checks an option's value passes, each raising a ConfigError that names the flag, the
value and what is allowed: a whole number in bounds, a finite number, one of some choices, a
notebook variable's name, a directory that can be written. The config's validation calls them
(options.py `__post_init__`); they read the value off any object by the option's name.
"""

from __future__ import annotations

import builtins
import keyword
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from sagenb.config.errors import ConfigError

__all__ = [
    "option_pairs",
    "SHELL_NAMES",
    "check_checkpoint_dir",
    "check_writable_dir",
    "check_choice",
    "check_int",
    "check_out",
    "check_positive",
]


def check_choice(cfg: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, value, f"must be one of {', '.join(choices)}")


def check_int(cfg: object, name: str, *, minimum: int, maximum: int | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(name, value, f"must be an integer {bound}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, value, f"must be an integer from {minimum} to {maximum}")


def check_positive(
    cfg: object, name: str, *, allow_zero: bool = False, maximum: float | None = None
) -> None:
    value = getattr(cfg, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    too_big = ok and maximum is not None and value > maximum
    if not ok or value < 0 or (value == 0 and not allow_zero) or too_big:
        bound = ">= 0" if allow_zero else "> 0"
        most = f" and at most {maximum:g}" if maximum is not None else ""
        raise ConfigError(name, value, f"must be a finite number {bound}{most}")


#: the names IPython's shell keeps in the notebook's namespace (besides those starting with
#: "_": _, __, ___, _i, _ii, _iN, _N, _ih, _oh, _dh): a result stored there replaces them
SHELL_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})


def check_out(out: Any) -> None:
    """--out names a variable of the notebook: one that shadows nothing. A builtin's name
    (`len`) or IPython's own (`Out`, `_oh`) would break later cells, and `__builtins__` every
    later cell: the kernel looks `len` up in it. Every name starting with "_" is refused:
    IPython's history names (`_`, `_i3`, `_12`) and Python's dunders are all of that form."""
    if (
        not isinstance(out, str)
        or not out.isidentifier()
        or keyword.iskeyword(out)
        or out.startswith("_")
        or out in SHELL_NAMES
        or hasattr(builtins, out)
    ):
        raise ConfigError(
            "out",
            out,
            "must be a Python identifier that is neither a keyword nor a builtin's name, "
            f"does not start with '_' and is not one of IPython's {', '.join(sorted(SHELL_NAMES))} "
            "(the result would shadow it in the notebook)",
        )


def check_checkpoint_dir(checkpoint_dir: str | None) -> None:
    """A directory, or one that can be made: found out now, not when the finished run
    writes its final checkpoint."""
    check_writable_dir("checkpoint_dir", checkpoint_dir)


def check_writable_dir(name: str, value: str | None) -> None:
    """Option `name` names a directory, or one that can be made (None: the option is left
    out). "" used to be taken as no folder at all, and a run wrote no checkpoint without a
    word; a file or a device (/dev/null) failed at the run's first write with a raw OSError."""
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(name, value, "must be a directory's path (leave the option out for none)")
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(name, value, "exists and is not a directory: name a folder")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(name, value, f"cannot be written: {parent} is not writable")


def option_pairs(name: str, given: Any) -> Iterable[tuple[str, Any]]:
    """Option `name` (`strategy_options`) as given: a mapping of names to values, or
    (name, value) pairs."""
    if isinstance(given, Mapping):
        return list(given.items())
    if isinstance(given, (tuple, list)) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in given
    ):
        return [(name, value) for name, value in given]
    raise ConfigError(
        name, given, "must be (name, value) pairs, or a mapping of option names to values"
    )
