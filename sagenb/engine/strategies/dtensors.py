"""What sharded and tensor parallel share: parameters that are DTensors.

FSDP2 (`fully_shard`) and tensor parallel (`parallelize_module`) both turn parameters into
DTensors: each engine holds a local shard, the DTensor knows the whole. Memory accounting,
the global gradient norm and the full state_dict need the local shard or the whole, and these
helpers give each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = [
    "clip_grad_norm",
    "full_state_dict",
    "is_sharded",
    "local",
    "scale_grads",
    "squared_norm",
]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """A DTensor with at least one Shard placement (a TypeGuard: callers then read its
    placements and device_mesh)."""
    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def full_state_dict(module: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """The whole, unsharded state_dict on the CPU (a collective: every rank calls it; only
    the ranks with `keep` hold on to the result)."""
    out = {}
    for key, value in module.state_dict().items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[key] = whole.detach().to("cpu", copy=True)
    return out if keep else None


def squared_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of the whole model's `grads`, as one process
    would compute it (float64, on their device): squares of sharded gradients are summed over
    the ranks holding the shards; replicated ones (identical on every rank) are counted once."""
    grads = list(grads)
    device = local(grads[0]).device if grads else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    squares: dict[dist.ProcessGroup, torch.Tensor] = {}  # the shards' group -> sum of squares
    total = zero.clone()
    for g in grads:
        part = local(g).detach().double().pow(2).sum()
        if is_sharded(g):
            dims = [i for i, p in enumerate(g.placements) if p.is_shard()]
            for dim in dims:  # one in sagenb (hybrid sharding: Replicate, then Shard(0))
                group = g.device_mesh.get_group(dim)
                squares[group] = squares.get(group, zero) + part
        else:
            total += part
    for group, part in squares.items():
        dist.all_reduce(part, group=group)
        total = total + part
    return total


def scale_grads(grads: Iterable[torch.Tensor], total: torch.Tensor, max_norm: float) -> float:
    """Clip `grads` whose whole-model sum of squares is `total` to `max_norm`, with the formula
    of torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6), at most 1);
    returns the norm."""
    norm = float(total.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            local(g).mul_(coef)
    return norm


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to `max_norm` the norm over every gradient of the whole model, as one process
    would compute it (squared_norm); returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return scale_grads(grads, squared_norm(grads), max_norm)
