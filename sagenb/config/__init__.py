"""What to train and how: every option once (`options`), in sections; the spec of one option,
which a strategy declares its own with (`spec`); the job (`job`); the error of a bad option
(`errors`); a small file a user names, read bounded (`files`).

The options are plain, picklable, keyword-only dataclasses: `EngineConfig` (all that travels to
the engines, the planner and an exported script) and `TrainConfig` (the notebook's own options
besides). This package is their public face, as `sagenb.config.EngineConfig` is what exported
scripts import. sagenb's own modules import the submodules. The names are resolved on first
use, so that importing `sagenb.config.job`, `sagenb.config.errors` or `sagenb.config.spec` (as the
engine side does: `from sagenb.config import Option` in a strategy's module) does not import the
options, which import the strategies.
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
            "PARTITION_METHODS",
            "PRECISIONS",
            "SCHEDULES",
            "SECTIONS",
            "EngineConfig",
            "Section",
            "TrainConfig",
            "describe",
            "every_option",
            "flag_arguments",
            "flag_reference",
            "notebook_only_flags",
            "strategy_names",
        )
    },
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
