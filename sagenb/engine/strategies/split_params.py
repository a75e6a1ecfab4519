"""What sharded and tensor parallel share: parameters that are DTensors, forwards that are
collectives.

Both hold every parameter (sharded) or some (tensor) as a DTensor whose local part is 1/N of
the whole, so the global gradient norm sums squares over the shards, and the full state_dict
gathers them. Both also need every rank to run the same forwards, which shapes evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sagenb.engine import dtensors
from sagenb.engine.data import fetch, to_device
from sagenb.engine.strategies.data_parallel import DataParallel

__all__ = ["SplitParameters", "evaluate_everywhere"]


class SplitParameters(DataParallel):
    """Data parallel's sample split and checkpointing, with DTensor-aware norm, state and
    evaluation; subclasses set up `module` and say how forward and backward run."""

    def clip_grad_norm(self, max_norm: float) -> float:
        return dtensors.clip_grad_norm(self.module.parameters(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return dtensors.full_state_dict(self.module, keep=self.rank == 0)

    @torch.no_grad()
    def evaluate(
        self, dataset: Any, loss_fn: Callable[..., torch.Tensor], batch_size: int
    ) -> float:
        return evaluate_everywhere(self.module, dataset, loss_fn, batch_size, self.device)


def evaluate_everywhere(
    module: torch.nn.Module,
    dataset: Any,
    loss_fn: Callable[..., torch.Tensor],
    batch_size: int,
    device: torch.device,
) -> float:
    """Mean loss over the whole dataset, in order, computed by every rank on every batch.

    Sharded and tensor-parallel forwards are collectives, so every rank must run the same
    batches; splitting the eval set would leave a rank with one batch fewer waiting forever."""
    was_training = module.training
    module.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for start in range(0, len(dataset), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(dataset)))
        inputs, targets = to_device(fetch(dataset, idx), device)
        total += loss_fn(module(inputs), targets).double().cpu() * len(idx)
        count += len(idx)
    module.train(was_training)
    return float(total / count)
