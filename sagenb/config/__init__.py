"""What to train and how: every option once (`options`), in sections; the options as flags and
their reference (`flags`); the spec of one option, which a strategy declares its own with
(`spec`); the strategies as the config asks them (`registry`); the job (`job`) and the cell's
module (`cell_module`); the error of a bad option (`errors`); a small file a user names, read
bounded (`files`).

The options are plain, picklable, keyword-only dataclasses: `EngineConfig` (all that travels to
the engines, the planner and an exported script) and `TrainConfig` (the notebook's own options
besides). This package is their public face, as `sagenb.config.EngineConfig` is what exported
scripts import. sagenb's own modules import the submodules. The names are resolved on first
use, so that importing `sagenb.config.job`, `sagenb.config.errors` or `sagenb.config.spec` (as the
engine side does: `from sagenb.config import Option` in a strategy's module) does not import the
options. `SCHEDULES` and `PARTITION_METHODS` are the choices of the pipeline's own options, as
its strategies declare them (asked through the registry: this package imports no strategy).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_PUBLIC = {
    "ConfigError": "errors",
    "flag_name": "errors",
    "Job": "job",
    "JobError": "job",
    "Option": "spec",
    **{
        name: "options"
        for name in (
            "DEFAULT_ENGINES",
            "PRECISIONS",
            "SECTIONS",
            "EngineConfig",
            "Section",
            "TrainConfig",
            "describe",
            "every_option",
            "strategy_names",
        )
    },
    **{name: "flags" for name in ("flag_arguments", "flag_reference", "notebook_only_flags")},
}

#: names kept for the choices of options that strategies now declare (they were fields once)
_CHOICES = {"SCHEDULES": "schedule", "PARTITION_METHODS": "partition_by"}

__all__ = sorted([*_PUBLIC, *_CHOICES])


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    if name in _CHOICES:
        from sagenb.config.registry import declared_options

        return declared_options()[_CHOICES[name]][0].allowed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
