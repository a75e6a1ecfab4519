"""What the estimate attributes to an engine under --expert-parallel E (sizing/footprint.py
asks data parallel's attribution, which asks here): each engine holds 1/E of every MoE layer's
experts (and their gradients and optimizer state) and the whole of every other weight; it
all-reduces the other weights' gradients over every engine and its experts' over the engines
that hold the same ones (N / E); and in each MoE layer it sends its (token, choice) pairs' hidden
states to the other engines of its group and receives their results, in forward and again in
backward: 4 x (E-1)/E of the pairs' bytes, with routing assumed even (the panel of tokens per
expert shows how even it was)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sagenb.engine.strategies.attribution import FakeModel, Ranks, Trace, grad_bytes, ring

from .layers import packed_experts

__all__ = ["ExpertTokens", "expert_held", "expert_ranks", "expert_sends", "watch_experts"]


class ExpertTokens:
    """Counts, while the estimate traces one forward, the bytes of the (token, choice) pairs'
    hidden states that reach the experts: what the dispatch would send."""

    def __init__(self, weights: set[int]) -> None:
        self.weights = weights  # ids of the packed expert parameters
        self.pair_bytes = 0.0

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if isinstance(hidden, torch.Tensor) and isinstance(index, torch.Tensor):
            self.pair_bytes += index.numel() * hidden.shape[-1] * hidden.element_size()


def watch_experts(m: FakeModel) -> ExpertTokens | None:
    """Before the trace: the counter of dispatched bytes, hooked on each MoE layer's experts;
    None without --expert-parallel. The refusals of training (no packed experts, a count that
    does not divide) come from the estimate too."""
    degree = m.config.option("expert_parallel")
    if degree == 1:
        return None
    layers = packed_experts(m.ws.model, degree)
    tokens = ExpertTokens({id(p) for layer in layers for p in layer.module.parameters()})
    for layer in layers:
        layer.module.register_forward_pre_hook(tokens, with_kwargs=True)
    return tokens


def expert_held(m: FakeModel, tokens: ExpertTokens) -> dict[nn.Parameter, int]:
    """Each engine's elements of the experts' weights: 1/E of each."""
    degree = m.config.option("expert_parallel")
    return {p: p.numel() // degree for p in m.params if id(p) in tokens.weights}


def expert_sends(m: FakeModel, tokens: ExpertTokens) -> dict[str, float]:
    """What each engine sends for its experts per step: their gradients all-reduced across
    the N / E groups, and the pairs' hidden states exchanged within its group."""
    degree = m.config.option("expert_parallel")
    pairs = tokens.pair_bytes * m.scale * m.config.grad_accum
    return {
        "all_reduce": ring("all_reduce", grad_bytes(expert_held(m, tokens)), m.world // degree),
        "all_to_all": 4 * (degree - 1) / degree * pairs,
    }


def expert_ranks(m: FakeModel, trace: Trace, tokens: ExpertTokens) -> Ranks:
    """Data parallel's ranks with --expert-parallel (the module's docstring)."""
    degree, world = m.config.option("expert_parallel"), m.world
    whole = {p: p.numel() for p in m.params if id(p) not in tokens.weights}
    send = expert_sends(m, tokens)
    send["all_reduce"] += ring("all_reduce", grad_bytes(whole), world)
    m.notes.append(
        f"expert parallel: each engine holds 1/{degree} of every MoE layer's experts; "
        "all_to_all assumes the router spreads the tokens evenly"
    )
    act = trace.peak_activations * m.scale
    held = {**whole, **expert_held(m, tokens)}
    return Ranks([held] * world, [act] * world, [send] * world)
