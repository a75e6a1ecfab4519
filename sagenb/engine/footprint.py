"""What each rank of a run would hold and compute, found in one process without engines and
without allocating the model (sagenb issue 16).

The cell runs under torch's FakeTensorMode: its model, dataset sample and optimizer state are
fake tensors that carry shapes and dtypes and no storage, so a 1-billion-parameter GPT costs
the memory of its metadata. One microbatch-shaped example goes through forward and backward
under `torch.utils.flop_counter.FlopCounterMode` (FLOPs) and saved-tensor hooks (activations,
counted as engine/memory.py counts them on the engines); the bytes of parameters, gradients
and optimizer state are then attributed to ranks by the strategy's rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sagenb.config import EngineConfig

__all__ = ["Footprint", "footprint"]


@dataclass(frozen=True)
class Footprint:
    """One run's memory per rank and work per optimizer step, as estimated."""

    world_size: int
    #: one dict per rank, keys sagenb.metric_keys.MEMORY_PARAMS/GRADS/OPTIMIZER/ACTIVATIONS, MiB
    ranks: list[dict[str, float]]
    #: forward + backward (+ the recompute of --activation-checkpointing) of one optimizer
    #: step over the whole global batch, all ranks together
    flops_per_step: float
    #: per rank: bytes this rank sends per optimizer step, by collective kind
    #: ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    comm_bytes_per_step: list[dict[str, float]]
    #: parameters of the whole model
    params: int
    #: tokens in one global batch, for token-id inputs (else None)
    tokens_per_step: int | None
    #: the assumptions made, in words
    notes: list[str] = field(default_factory=list)


def footprint(job: Any, config: EngineConfig, world_size: int) -> Footprint:
    """The footprint of training `job` (a sagenb.job.Job or cell source) with `config` on
    `world_size` ranks. Raises ConfigError (naming --engines) for a world size the strategy
    cannot use."""
    raise NotImplementedError("footprint: being written (issue 16)")
