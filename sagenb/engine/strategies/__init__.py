"""Parallelism strategies: each wraps the model and says how one engine takes part in a step."""

from __future__ import annotations

import torch

from sagenb.config import TrainConfig

from .base import Strategy
from .data_parallel import DataParallel
from .pipeline import Pipeline
from .sharded import Sharded
from .tensor import TensorParallel

__all__ = ["Strategy", "DataParallel", "Pipeline", "Sharded", "TensorParallel", "make_strategy"]


def make_strategy(
    config: TrainConfig, *, rank: int, world_size: int, device: torch.device
) -> Strategy:
    if config.strategy == "data":
        return DataParallel(rank=rank, world_size=world_size, device=device, seed=config.seed)
    if config.strategy in ("model", "hybrid"):
        return Pipeline(config, rank=rank, world_size=world_size, device=device)
    if config.strategy == "sharded":
        return Sharded(
            rank=rank,
            world_size=world_size,
            device=device,
            seed=config.seed,
            reshard_after_forward=config.reshard_after_forward,
        )
    if config.strategy == "tensor":
        return TensorParallel(config, rank=rank, world_size=world_size, device=device)
    raise NotImplementedError(f"strategy {config.strategy!r} has no engine implementation yet")
