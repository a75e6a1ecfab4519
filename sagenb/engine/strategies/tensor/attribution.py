"""Tensor parallel's answer to the estimate (engine/strategies/attribution.py): the plan training
applies (plan.py), each split weight divided on its split dim among the T engines of a group,
activations between a column-wise and a row-wise layer divided by T (Megatron-LM,
arXiv:1909.08053), data parallel across the D groups. A row-wise embedding's gradient is whole
on every engine: torch's RowwiseParallel shards nn.Embedding's weight on dim 0, and the
embedding's backward gives that weight a Replicate gradient (measured on torch 2.13: a
512 x 128 weight held as 256 x 128 per engine, its gradient 512 x 128).

Communication: all_reduce 2(T-1)/T x (each row-wise layer's output in forward + each
column-wise layer's input gradient in backward), per slice (torch's styles reduce each
column-wise layer's input gradient on its own); plus 2(D-1)/D x the rank's gradient bytes
across the D replicas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sagenb.engine.strategies.attribution import (
    Attribution,
    FakeModel,
    Ranks,
    Trace,
    chunk_sizes,
    grad_bytes,
    ring,
)
from sagenb.engine.strategies.tensor.check import matches
from sagenb.engine.strategies.tensor.plan import plan_for
from sagenb.engine.strategies.tensor.styles import is_conv1d, splits
from sagenb.engine.torch_private import direct_parameters

__all__ = ["TensorAttribution"]

#: per layer kind and split: {parameter name: dim split}; others stay whole (styles.py)
SPLIT_DIMS: dict[str, dict[str, dict[str, int]]] = {
    "linear": {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1}},
    "conv1d": {"colwise": {"weight": 1, "bias": 0}, "rowwise": {"weight": 0}},
    "embedding": {"colwise": {"weight": 1}, "rowwise": {"weight": 0}},
}


class TensorAttribution(Attribution):
    def prepare(self, m: FakeModel) -> tuple[dict[nn.Module, str], Any]:
        T = m.config.option("tensor_parallel") or m.world
        plan = plan_for(m.ws.model, T, m.ws.tp_plan, example=_example(m))
        split: dict[nn.Module, str] = {}
        for key, style in plan.styles.items():
            kind = splits(style)
            for _path, module in matches(m.ws.model, key):
                if kind is not None:
                    split[module] = kind
        return split, (T, split)

    def ranks(self, m: FakeModel, trace: Trace, layout: Any) -> Ranks:
        (T, split), N = layout, m.world
        D = N // T
        held: list[dict[nn.Parameter, int]] = []
        dims = _split_dims(split)
        for r in range(N):
            held.append({p: _piece(p, dims.get(p), T, r % T) for p in m.params})
        whole = _whole_gradients(split)
        grads = [{p: p.numel() if p in whole else n for p, n in h.items()} for h in held]
        kept = sum(w for w, _ in trace.saved.values())
        part = sum(s for _, s in trace.saved.values())
        share = (kept + part / T) / (kept + part) if kept + part else 1.0
        act = trace.peak_activations * share * m.scale
        reduced = (trace.rowwise_out + trace.colwise_in) * m.scale * m.config.grad_accum
        comm = [
            {"all_reduce": ring("all_reduce", reduced, T) + ring("all_reduce", grad_bytes(g), D)}
            for g in grads
        ]
        return Ranks(held, [act] * N, comm, grads)


def _example(m: FakeModel) -> Any:
    """The traced example's forward, for the plan recorded from one forward (as training
    records it from the dataset's first sample)."""

    def run() -> Any:
        args, kwargs, _ = m.ws.objective.split(m.example)
        with torch.no_grad():
            return m.ws.model(*args, **kwargs)

    return run


def _split_dims(split: dict[nn.Module, str]) -> dict[nn.Parameter, int]:
    """The dim each split parameter is divided on, as styles.py's styles place them."""
    dims: dict[nn.Parameter, int] = {}
    for module, kind in split.items():
        layer = (
            "embedding"
            if isinstance(module, nn.Embedding)
            else "conv1d"
            if is_conv1d(module)
            else "linear"
        )
        for name, dim in SPLIT_DIMS[layer][kind].items():
            p = direct_parameters(module).get(name)
            if p is not None:
                dims[p] = dim
    return dims


def _whole_gradients(split: dict[nn.Module, str]) -> set[torch.Tensor]:
    """Split parameters whose gradient torch leaves whole: row-wise embeddings' weights."""
    return {
        module.weight
        for module, kind in split.items()
        if kind == "rowwise" and isinstance(module, nn.Embedding)
    }


def _piece(p: nn.Parameter, dim: int | None, parts: int, position: int) -> int:
    """Elements of `p` one rank holds when `dim` is split `parts` ways (None: whole)."""
    if dim is None:
        return p.numel()
    return chunk_sizes(p.shape[dim], parts)[position] * (p.numel() // p.shape[dim])
