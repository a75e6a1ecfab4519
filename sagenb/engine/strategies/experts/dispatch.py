"""Expert parallel: each engine of a group of E holds num_experts / E of every MoE layer's
experts, and the tokens travel to them.

In each layer, after the model's own router chose the experts of every token (so routing is
the model's own, and the run equals one process), each engine of the group:

1. sorts its (token, choice) pairs by expert, and tells every engine of the group how many it
   sends it for each of its experts (`all_to_all_single` of the counts);
2. sends each pair's hidden state to the engine holding its expert (`all_to_all_single`, uneven
   splits, with autograd: torch's functional collectives), in expert order, so the counts say
   which expert each is for;
3. computes the pairs it received with its own experts, by the layer's own forward (its own
   kernel: eager, grouped_mm, ...) on its slice of the weights, each pair weighted 1;
4. sends the results back the same way, and adds each, times its routing weight, to its
   token's output in expert order, as the layer's own forward adds them.

Backward runs the two exchanges in reverse: the gradients of the received states go back to
the engines that sent them, and each expert's weight gradient sums the tokens of every engine
in the group. That is the dispatch of GShard (arXiv:2006.16668) and DeepSpeed-MoE, and what
torchtitan's expert parallel does with the same collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sagenb.engine.torch_private import exchange

from .layers import PackedExperts

__all__ = ["RoutingCounts", "spread"]


class RoutingCounts:
    """The (token, choice) pairs routed to each expert while training, summed over every MoE
    layer since the last `take()`: the tokens-per-expert panel's data (imbalance is what MoE
    users watch). Eval forwards are not counted."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.counts = torch.zeros(experts, dtype=torch.int64)

    def add(self, module: nn.Module, top_k_index: torch.Tensor, total: int) -> None:
        if module.training and total == self.experts:
            flat = top_k_index.detach().reshape(-1).to("cpu", torch.int64)
            self.counts += torch.bincount(flat, minlength=self.experts)[: self.experts]

    def take(self) -> list[int]:
        taken, self.counts = self.counts.tolist(), torch.zeros(self.experts, dtype=torch.int64)
        return taken


def count_routing(layers: list[PackedExperts]) -> RoutingCounts | None:
    """A counter fed by a forward pre-hook on each layer's experts (a model whose layers all
    have the same number of experts), for strategies that keep the experts whole."""
    sizes = {layer.count for layer in layers}
    if len(sizes) != 1:
        return None
    counts = RoutingCounts(sizes.pop())

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if isinstance(index, torch.Tensor):
            counts.add(module, index, counts.experts)

    for layer in layers:
        layer.module.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def spread(
    layer: PackedExperts,
    *,
    group: dist.ProcessGroup,
    index: int,
    degree: int,
    counts: RoutingCounts | None,
) -> None:
    """Keep experts [index x n, (index + 1) x n) of `layer` (n = count / degree) on this engine,
    engine `index` of `group`, and make its forward dispatch every token to its expert's
    engine."""
    module, local = layer.module, layer.count // degree
    first = index * local
    for name in layer.weights:
        whole = getattr(module, name)
        kept = nn.Parameter(
            whole.detach()[first : first + local].clone(), requires_grad=whole.requires_grad
        )
        setattr(module, name, kept)
    setattr(module, "num_experts", local)  # noqa: B010 (the layer's own forward reads it)
    own_forward = type(module).forward.__get__(module)
    module.forward = _Dispatch(module, own_forward, group, degree, local, layer.count, counts)


class _Dispatch:
    """The replaced forward of one layer's experts (see the module's docstring)."""

    def __init__(
        self,
        module: nn.Module,
        own_forward: Callable[..., torch.Tensor],
        group: dist.ProcessGroup,
        degree: int,
        local: int,
        total: int,
        counts: RoutingCounts | None,
    ) -> None:
        self.module, self.own_forward, self.group = module, own_forward, group
        self.degree, self.local, self.total, self.counts = degree, local, total, counts

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.counts is not None:
            self.counts.add(self.module, top_k_index, self.total)
        choices = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, then token: the own order
        tokens = order // choices
        # the pairs of each expert, engine j's experts in row j: each engine learns how many
        # pairs of each of its own experts arrive from each sender, in expert order, so the
        # experts' numbers need no exchange of their own
        per_expert = torch.bincount(flat, minlength=self.total)[: self.total]
        mine = torch.empty_like(per_expert)
        dist.all_to_all_single(mine, per_expert, group=self.group)
        send = per_expert.view(self.degree, self.local).sum(1).tolist()
        receive = mine.view(self.degree, self.local).sum(1).tolist()

        arrived = exchange(hidden_states[tokens], receive, send, self.group)
        local = torch.arange(self.local, device=flat.device).repeat(self.degree)
        which = torch.repeat_interleave(local, mine).unsqueeze(-1)  # sender by sender
        ones = torch.ones(len(which), 1, dtype=top_k_weights.dtype, device=which.device)
        done = self.own_forward(arrived, which, ones)
        if torch.is_grad_enabled() and not done.requires_grad:
            # none of this engine's experts computed (nothing arrived): its weights still take
            # part in backward, with zero gradients, so that every engine runs the exchange's
            # backward collective
            own = [p.sum() for p in self.module.parameters(recurse=False) if p.requires_grad]
            done = done + 0 * sum(own, arrived.sum())
        back = exchange(done, send, receive, self.group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, tokens, weighted.to(out.dtype))
