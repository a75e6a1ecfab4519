"""The error of an option whose value is not allowed, raised on both sides of a run.

The options (options.py) raise it while validating, and the engine side raises it too: a
strategy checking its own options (engine/strategies/), an exported script given a bad config
(engine/launch.py). It imports nothing, so a strategy raises it without importing the options
that import the strategies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "flag_name"]


class ConfigError(ValueError):
    """An option has a value that is not allowed; says which, the value and what is allowed."""

    def __init__(self, name: str, value: Any, allowed: str) -> None:
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"{flag_name(name)} {value!r}: {allowed}")


def flag_name(name: str) -> str:
    """The magic's spelling of a config field: `batch_size` -> `--batch-size`, `continue_`
    (a Python keyword's field) -> `--continue`."""
    return "--" + name.rstrip("_").replace("_", "-")
