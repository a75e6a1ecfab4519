"""Finding a model's mixture-of-experts layers by their structure, as they come.

transformers' MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...) keep each layer's experts
in one module of packed weights: 3-D parameters whose first dimension is the expert
(`gate_up_proj` [experts, 2 x inter, hidden], `down_proj` [experts, hidden, inter]), called by
the layer's router as `experts(hidden_states [tokens, hidden], top_k_index [tokens, k],
top_k_weights [tokens, k])`. A cell's own MoE layer written the same way is found the same way.
Expert parallel (dispatch.py) spreads those weights over engines and moves the tokens to them.

A list of expert modules (`nn.ModuleList`, each called by the layer's own loop) is recognised
too, to be refused by name: the layer's own loop calls each expert where it is, so its tokens
cannot be sent to another engine without rewriting the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sagenb.config.job import JobError

__all__ = ["PackedExperts", "expert_lists", "find_packed", "packed_experts"]


@dataclass(frozen=True)
class PackedExperts:
    """One MoE layer's packed experts: where it is and what it holds."""

    name: str  # its qualified name in the model
    module: nn.Module
    count: int  # experts
    weights: tuple[str, ...]  # its parameters with one slice per expert (dim 0)


def find_packed(model: nn.Module) -> list[PackedExperts]:
    """Every module holding packed experts: a `num_experts` of its own, and parameters of
    its own (at least one 3-D) whose first dimension is that count."""
    found = []
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        own = dict(module.named_parameters(recurse=False))
        if not isinstance(count, int) or count < 1 or not own:
            continue
        sliced = tuple(k for k, p in own.items() if p.dim() >= 2 and p.shape[0] == count)
        if sliced and any(own[k].dim() == 3 for k in sliced) and len(sliced) == len(own):
            found.append(PackedExperts(name, module, count, sliced))
    return found


def expert_lists(model: nn.Module) -> list[str]:
    """The qualified names of lists of expert modules (an `nn.ModuleList` named `experts`)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts"
    ]


def packed_experts(model: nn.Module, degree: int) -> list[PackedExperts]:
    """The model's packed experts for --expert-parallel `degree`; a JobError, before the
    first step, where there are none or their count does not divide by `degree`."""
    found = find_packed(model)
    if not found:
        lists = expert_lists(model)
        why = (
            f"its experts are lists of modules ({', '.join(lists[:2])}"
            f"{', ...' if len(lists) > 2 else ''}), each called by the layer's own loop, "
            "which cannot send its tokens to another engine"
            if lists
            else "no module holds packed experts"
        )
        raise JobError(
            f"--expert-parallel {degree}: the model has no mixture-of-experts layer sagenb can "
            f"spread: {why}. Expert parallel needs each layer's experts in one module of 3-D "
            "weights (one slice per expert, a `num_experts` attribute) called as "
            "experts(hidden_states, top_k_index, top_k_weights), as transformers' MoE models "
            "(Qwen2-MoE, Qwen3-MoE, Mixtral) keep them; or train with --expert-parallel 1"
        )
    for layer in found:
        if layer.count % degree:
            raise JobError(
                f"--expert-parallel {degree}: {layer.name} holds {layer.count} experts, which "
                f"do not split evenly over {degree} engines: must divide {layer.count}"
            )
    return found
