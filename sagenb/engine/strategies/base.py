"""What the training loop asks of a strategy; the loop itself stays strategy-independent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Strategy"]


class Strategy(Protocol):
    """One engine's part in a step. Data parallel implements it; pipeline and sharded follow."""

    #: the module whose parameters this engine holds (for the optimizer and memory accounting)
    module: nn.Module

    def setup(self, model: nn.Module) -> None:
        """Take the full model built by the cell and keep (and wrap) this engine's part."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this engine's optimizer updates."""

    def local_indices(self, slice_indices: torch.Tensor) -> torch.Tensor:
        """Which samples of one slice of the global batch this engine loads."""

    def forward_backward(
        self, batch: Any, loss_fn: Callable[..., torch.Tensor], *, scale: float, sync: bool
    ) -> torch.Tensor:
        """Run forward and backward on this engine's samples; `sync=False` defers gradient
        communication (all slices but the last of an accumulated step). Returns the detached
        mean loss of this engine's samples."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to `max_norm` the norm over every parameter of the whole model; return the norm."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict on rank 0 (keys of model.state_dict()), None elsewhere."""

    def evaluate(
        self, dataset: Any, loss_fn: Callable[..., torch.Tensor], batch_size: int
    ) -> float:
        """Mean loss over the whole dataset, in order (every rank returns the same value)."""
