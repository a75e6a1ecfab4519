"""What the training loop asks of a strategy; the loop itself stays strategy-independent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from sagenb.engine.objective import Objective

__all__ = ["Strategy"]


class Strategy(Protocol):
    """One engine's part in a step: data parallel, pipeline, sharded and tensor implement it."""

    @property
    def module(self) -> nn.Module:
        """The module whose parameters this engine holds (for the optimizer and memory
        accounting); read-only here, so a strategy may hold a more specific kind."""

    #: the keys of the unsplit model's state_dict, in order
    key_order: list[str]

    def setup(self, ws: Any) -> None:
        """Take the full model the cell built (ws.model) and keep (and wrap) this engine's
        part; ws also gives the dataset and loss for profiling."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this engine's optimizer updates."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The same, in the same order, with their names in the unsplit model."""

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """This engine's part of the model's state_dict, keyed as in the unsplit model."""

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load this engine's part from `state` (keys of the unsplit model)."""

    def local_indices(self, slice_indices: torch.Tensor) -> torch.Tensor:
        """Which samples of one slice of the global batch this engine loads."""

    #: whether the loop may all-reduce the step's target count while the step runs and rescale
    #: the gradients after the last backward (engine/loop.py _GlobalCount): where the reduced
    #: gradients are plain tensors on every rank and the count's collective cannot interleave
    #: with the strategy's own on other groups (data parallel)
    counts_in_flight: bool

    @property
    def collated_parts(self) -> int:
        """The runs each of this engine's batches is cut into, each collated on its own by the
        cell's collate_fn: a pipeline's microbatches; 1 where the batch is one forward."""

    def forward_backward(
        self, batch: Any, objective: Objective, *, scale: float, sync: bool
    ) -> torch.Tensor | None:
        """Run forward and backward on this engine's samples; `sync=False` defers gradient
        communication (all slices but the last of an accumulated step). Returns the detached
        mean loss of this engine's samples, or None on an engine that computes no loss (a
        pipeline stage before the last)."""

    def step_metrics(self) -> dict[str, Any]:
        """Strategy-specific metrics of the step just done (pipeline: busy/idle, timeline)."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to `max_norm` the norm over every parameter of the whole model; return the norm."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """This engine's part of the full state_dict (keys of model.state_dict()), or None;
        the notebook merges the parts of every rank."""

    def evaluate(self, dataset: Any, objective: Objective, batch_size: int) -> float:
        """Mean loss over the whole dataset, in order (every rank returns the same value)."""
