"""Expert parallel with data parallel across the groups: what one engine does besides the
dispatch (dispatch.py).

N engines form N / E groups of E consecutive ranks (a 2-D mesh, replicate x expert, laid out
row by row as init_device_mesh does). Within a group, every MoE layer's experts are spread,
E-th by E-th; every other weight is whole on every engine. After the last backward of a step:

- a weight that every engine holds is averaged over all N engines, as DDP would;
- an expert's weight already holds, from the exchange's backward, the gradient of the tokens
  every engine of its group sent it: it is summed across the N / E groups (the engines that
  hold the same experts) and divided by N, the same average.

So each engine updates its own experts with the gradient of the whole global batch, as one
process would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from sagenb.engine.strategies.dtensors import scale_grads, squared_norm

from .dispatch import RoutingCounts, spread
from .layers import PackedExperts, packed_experts

__all__ = ["ExpertGroups"]


class ExpertGroups:
    """The expert-parallel part of one engine of `world_size`, in groups of `degree`."""

    def __init__(self, *, rank: int, world_size: int, degree: int, device: torch.device) -> None:
        self.rank, self.world_size, self.degree = rank, world_size, degree
        shape = (world_size // degree, degree)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "expert"))
        self.mesh = mesh
        self.group = mesh.get_group("expert")
        self.across = mesh.get_group("replicate") if shape[0] > 1 else None
        self.layers: list[PackedExperts] = []
        self.counts: RoutingCounts | None = None

    def spread(self, model: nn.Module) -> None:
        """Keep this engine's experts of every MoE layer of `model` and make them dispatch."""
        self.layers = packed_experts(model, self.degree)
        sizes = {layer.count for layer in self.layers}
        self.counts = RoutingCounts(sizes.pop()) if len(sizes) == 1 else None
        for layer in self.layers:
            spread(
                layer,
                group=self.group,
                index=self.rank % self.degree,
                degree=self.degree,
                counts=self.counts,
            )
        self._experts = {id(p) for layer in self.layers for p in _own(layer.module)}

    def split(self, module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The trained parameters of `module`: those every engine holds, this engine's experts."""
        trained = [p for p in module.parameters() if p.requires_grad]
        return (
            [p for p in trained if id(p) not in self._experts],
            [p for p in trained if id(p) in self._experts],
        )

    def reduce(self, module: nn.Module, *, whole: bool = True) -> None:
        """Average the step's gradients over the global batch (the module's docstring);
        `whole=False`: the experts' alone (FSDP reduces the other weights' itself)."""
        shared, experts = self.split(module)
        if whole:
            _sum(shared, None)
        if self.across is not None:
            _sum(experts, self.across)
        for p in (*shared, *experts) if whole else experts:
            p.grad.div_(self.world_size)  # type: ignore[union-attr]

    def clip(self, module: nn.Module, max_norm: float) -> float:
        """Clip to `max_norm` the norm over every gradient of the whole model, as
        torch.nn.utils.clip_grad_norm_ on one process: the other weights' (replicated, or
        FSDP's shards) and each group's experts (summed over the group)."""
        shared, experts = self.split(module)
        grads = [p.grad for p in (*shared, *experts) if p.grad is not None]
        total = squared_norm([p.grad for p in shared if p.grad is not None])
        mine = torch.zeros((), dtype=torch.float64, device=total.device)
        for p in experts:
            if p.grad is not None:
                mine += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(mine, group=self.group)
        return scale_grads(grads, total + mine, max_norm)

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The unsplit model's state_dict (every engine takes part): each layer's experts
        gathered from the engines of this engine's group, in expert order; FSDP's shards
        gathered whole."""
        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
            for k, v in module.state_dict().items()
        }
        names = self.names(module)
        for layer in self.layers:
            for weight in layer.weights:
                local = getattr(layer.module, weight).detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(self.degree)]
                dist.all_gather(parts, local, group=self.group)
                key = names.get(id(getattr(layer.module, weight)))
                if key is not None:
                    state[key] = torch.cat(parts).to("cpu")
        return state

    def names(self, module: nn.Module) -> dict[int, str]:
        """The state_dict key of each parameter of `module`, by the parameter's id."""
        return {id(p): n for n, p in module.named_parameters()}

    def keys(self, module: nn.Module) -> set[str]:
        """The state_dict keys of this engine's experts."""
        names = self.names(module)
        return {names[id(p)] for p in module.parameters() if id(p) in self._experts}

    def checkpoint_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state_dict with each layer's experts as a DTensor view of the whole
        (sharded by expert over the group, replicated across the groups), sharing this engine's
        storage: DCP writes each group's rows once, loads them in place, and reads them back
        on another --expert-parallel (or none) as it reshards FSDP's."""
        state = module.state_dict()
        names = self.names(module)
        for layer in self.layers:
            for weight in layer.weights:
                param = getattr(layer.module, weight)
                key = names.get(id(param))
                if key is None:
                    continue
                rows = param.detach()
                shape = torch.Size((layer.count, *rows.shape[1:]))
                state[key] = DTensor.from_local(
                    rows, self.mesh, (Replicate(), Shard(0)), run_check=False, shape=shape,
                    stride=torch.empty(shape, device="meta").stride(),
                )  # fmt: skip
        return state

    def most(self, batches: int) -> int:
        """The most eval batches any engine of this engine's group has (all take part in each
        batch's exchanges: an engine with fewer runs extra, uncounted ones)."""
        count = torch.tensor([batches])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count)


def _own(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def _sum(params: list[nn.Parameter], group: Any) -> None:
    """All-reduce (sum) the gradients of `params` as one flat tensor; a parameter no token
    reached this step counts as a zero gradient, as DDP counts it."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n
