"""--expert-parallel as the strategies that offer it declare it (data parallel, sharded): one
Option, one check and one layout phrase, shared."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sagenb.config.errors import ConfigError
from sagenb.config.spec import Option

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["EXPERT_PARALLEL", "check_expert_parallel", "experts_layout"]

EXPERT_PARALLEL = Option(
    "expert_parallel",
    "parallelism",
    1,
    "engines in each group that spreads every mixture-of-experts layer's experts among its "
    "own, tokens sent to their experts by all_to_all (expert parallel); data parallel across "
    "the groups (1: every engine holds every expert)",
)


def check_expert_parallel(config: EngineConfig, *, delayed_ok: bool = True) -> int:
    """The degree, refused (ConfigError) where it cannot run; `delayed_ok`: whether the
    strategy builds the whole model before spreading the experts (with --delay-init)."""
    degree = int(config.option("expert_parallel"))
    if degree < 1:
        raise ConfigError("expert_parallel", degree, "must be an integer >= 1")
    if config.engines is not None and config.engines % degree:
        raise ConfigError(
            "expert_parallel",
            degree,
            f"must divide --engines ({config.engines}): the engines form groups of "
            "--expert-parallel engines, each spreading the experts",
        )
    if degree > 1 and config.delay_init and not delayed_ok:
        raise ConfigError(
            "expert_parallel",
            degree,
            f"cannot be combined with --delay-init under --strategy {config.strategy}, "
            "which would materialise each engine's experts before they are spread: must be 1, "
            "or train without --delay-init (or with --strategy data)",
        )
    return degree


def experts_layout(config: EngineConfig) -> str:
    """', experts spread over groups of E (expert parallel)', or ''."""
    degree = config.option("expert_parallel")
    return f", experts spread over groups of {degree} (expert parallel)" if degree > 1 else ""
