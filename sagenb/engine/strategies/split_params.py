"""What sharded and tensor parallel share: parameters that are DTensors, forwards that are
collectives.

Both hold every parameter (sharded) or some (tensor) as a DTensor whose local part is 1/N of
the whole, so the global gradient norm sums squares over the shards, and the full state_dict
gathers them. Both also need every rank to run the same forwards, which shapes evaluation.
"""

from __future__ import annotations

from typing import Any

import torch

from sagenb.engine.data.order import eval_batches
from sagenb.engine.objective import Objective
from sagenb.engine.strategies import dtensors
from sagenb.engine.strategies.data_parallel import DataParallel, eval_sums

__all__ = ["SplitParameters"]


class SplitParameters(DataParallel):
    """Data parallel's sample split and checkpointing, with DTensor-aware norm, state and
    evaluation; subclasses set up `module` and say how forward and backward run."""

    def clip_grad_norm(self, max_norm: float) -> float:
        return dtensors.clip_grad_norm(self.module.parameters(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return dtensors.full_state_dict(self.module, keep=self.rank == 0)

    @torch.no_grad()
    def evaluate(self, dataset: Any, objective: Objective, batch_size: int) -> float:
        """Mean loss over the whole dataset, in order, computed by every rank on every batch.

        Sharded and tensor-parallel forwards are collectives, so every rank must run the same
        batches; splitting the eval set would leave a rank with one batch fewer waiting
        forever."""
        everything = eval_batches(len(dataset), batch_size)
        total = eval_sums(self.module, dataset, objective, everything, self.device)
        return float(total[0] / total[1])
