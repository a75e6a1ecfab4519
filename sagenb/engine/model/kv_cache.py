"""Training builds no key/value cache.

A transformers model whose config says `use_cache=True` (the default of its causal LMs) returns
the keys and values of every layer in its output (a `DynamicCache`), kept for generation. A
training step never reads them: they cost memory, and torch.export refuses an output holding
such an object, so a pipeline could not split the model. sagenb turns `use_cache` off on every
config of the model while it trains and puts it back afterwards, as transformers' Trainer does
when gradient checkpointing is on (`use_cache=True` is incompatible with it there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["cache_off"]


def cache_off(model: nn.Module) -> Callable[[], None]:
    """Set `use_cache=False` on the config of every submodule that has one set to True (a
    config shared by several submodules once); returns what puts the values back."""
    changed: dict[int, Any] = {}  # id -> a transformers PretrainedConfig
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and id(config) not in changed:
            changed[id(config)] = config
            config.use_cache = False

    def restore() -> None:
        for config in changed.values():
            config.use_cache = True

    return restore
