"""The contract's sample order, and the slice of each global batch that one engine loads.

Epoch e visits the dataset in the order randperm(len(dataset), seed + e), in global batches of
`batch_size` consecutive samples; the incomplete last batch is dropped. Every strategy uses this
one plan, which is why every strategy trains the same model as a single process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate

from sagenb.job import JobError

__all__ = ["Step", "epoch_order", "plan_steps", "total_steps", "fetch"]


@dataclass(frozen=True)
class Step:
    """One optimizer step: its number (1-based, across epochs), epoch and global batch indices."""

    number: int
    epoch: int
    indices: torch.Tensor


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def total_steps(n: int, *, batch_size: int, epochs: int, steps: int | None) -> int:
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise JobError(
            f"dataset has {n} samples, fewer than one global batch (--batch-size {batch_size}): "
            "lower --batch-size or enlarge the dataset"
        )
    return min(per_epoch * epochs, steps) if steps is not None else per_epoch * epochs


def plan_steps(
    n: int, *, batch_size: int, epochs: int, steps: int | None, seed: int, start_after: int = 0
) -> Iterator[Step]:
    """The steps of the run, from step start_after + 1 on (resuming from a checkpoint)."""
    total = total_steps(n, batch_size=batch_size, epochs=epochs, steps=steps)
    per_epoch = n // batch_size
    number = 0
    for epoch in range(epochs):
        order = epoch_order(n, seed, epoch)
        for b in range(per_epoch):
            if number == total:
                return
            number += 1
            if number > start_after:
                yield Step(number, epoch, order[b * batch_size : (b + 1) * batch_size])


def fetch(dataset: Any, indices: torch.Tensor) -> Any:
    """Load and collate the samples at `indices` (TensorDataset is indexed in one go): in the
    training thread, or in a --data-workers process (engine/loader.py)."""
    if isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    return default_collate([dataset[i] for i in indices.tolist()])


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
