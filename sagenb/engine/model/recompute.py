"""Activation checkpointing (`--activation-checkpointing`): recompute each block in backward.

Each repeated block (the children of an nn.Sequential, or the items of the model's largest
nn.ModuleList, as for pipeline splitting) keeps only its input for backward; its inner
activations are recomputed when backward reaches it (torch.utils.checkpoint, non-reentrant,
with the RNG state restored so dropout draws the same masks). Gradients are unchanged.

The block's `forward` is wrapped on the instance instead of wrapping the module in another
(torch's checkpoint_wrapper), so parameter names, and with them the state_dict's keys and
checkpoints, stay those of the cell's model. Applied before any strategy wraps the model, as
torchtitan does before FSDP.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

from sagenb.config.job import JobError
from sagenb.engine.model.blocks import find_blocks

__all__ = ["checkpoint_blocks"]


def checkpoint_blocks(model: nn.Module) -> int:
    """Make every block of `model` recompute its activations in backward; returns how many."""
    try:
        blocks = find_blocks(model)
    except JobError:
        raise JobError(
            f"--activation-checkpointing: model ({type(model).__name__}) has no repeated blocks "
            "to checkpoint; make it an nn.Sequential or build it around an nn.ModuleList"
        ) from None
    for i in range(len(blocks)):
        block = model.get_submodule(blocks.qualified(i))
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)
