"""Choosing cut points: profile each block, then split the blocks into contiguous stages.

`auto` (the default) minimises the slowest stage's forward+backward time while keeping every
stage's memory within the budget, in the spirit of SageMaker's auto_partition; `parameters`
balances parameter counts (DeepSpeed's default); `uniform` gives equal block counts; `manual`
takes the cut points the user gives. A stage is a contiguous run of blocks; the layers before
the first block (embeddings) go with stage 0 and those after the last (norm, head) with the last.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sagenb.engine.model.blocks import find_blocks
from sagenb.engine.objective import Objective
from sagenb.engine.strategies.pipeline.partition import split_model

__all__ = ["BlockProfile", "profile_blocks", "choose_starts", "contiguous_min_max"]


@dataclass(frozen=True)
class BlockProfile:
    """Per block (first and last include the layers before/after the block list)."""

    seconds: tuple[float, ...]  # forward + backward on one microbatch
    param_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]  # saved for backward, one microbatch

    def stage_sums(self, starts: Sequence[int]) -> dict[str, list[float]]:
        bounds = [*starts, len(self.seconds)]
        out: dict[str, list[float]] = {"seconds": [], "param_bytes": [], "activation_bytes": []}
        for a, b in zip(bounds, bounds[1:]):
            for key in out:
                out[key].append(sum(getattr(self, key)[a:b]))
        return out


def profile_blocks(
    model: nn.Module, batch: Any, objective: Objective, *, repeats: int = 5
) -> BlockProfile:
    """Time forward and backward of every block on one microbatch: the median of `repeats`
    passes after one untimed pass (first calls pay for allocation and kernel selection).

    The microbatch's inputs are also the example torch.export traces on when torch.fx cannot
    trace the model (export_split.py): one piece per block either way."""
    n = len(find_blocks(model))
    args, kwargs, targets = objective.split(batch)
    pieces, _ = split_model(model, list(range(n)), (args, kwargs))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=[]):  # dropout's draws are the training's, not ours
        profile = _measure(model, pieces, (args, kwargs), targets, objective, repeats)
    with torch.no_grad():  # BatchNorm's running statistics as the cell left them
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return profile


def _measure(model, pieces, inputs, targets, objective, repeats: int) -> BlockProfile:
    n = len(pieces)
    args, kwargs = inputs
    times = [[0.0] * (n) for _ in range(repeats + 1)]
    saved = [0] * n
    for r in range(repeats + 1):
        value, outs, ins = args, [], []
        for i, piece in enumerate(pieces):
            value = _detached(value)
            ins.append(value)
            counter = _SavedBytes()
            started = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                if i == 0:  # the model's inputs, keyword inputs included
                    value = piece(*value, **kwargs)
                else:
                    value = piece(*value) if isinstance(value, tuple) else piece(value)
            times[r][i] += time.perf_counter() - started
            saved[i] = counter.total
            outs.append(value)
        grad = None
        for i in reversed(range(n)):
            started = time.perf_counter()
            if i == n - 1:
                objective.loss(outs[i], targets).backward()
            else:
                _backward(outs[i], grad)
            times[r][i] += time.perf_counter() - started
            grad = _input_grads(ins[i])
        model.zero_grad(set_to_none=True)
    seconds = tuple(statistics.median(times[r][i] for r in range(1, repeats + 1)) for i in range(n))
    params = tuple(sum(p.numel() * p.element_size() for p in pc.parameters()) for pc in pieces)
    return BlockProfile(seconds, params, tuple(saved))


def static_profile(model: nn.Module, example: tuple[tuple, dict] | None = None) -> BlockProfile:
    """Parameter bytes per block without running anything (meta parameters allowed).
    `example` (one microbatch's positional and keyword inputs) lets torch.export split a
    model torch.fx cannot trace (a transformers model as it comes: export_split.py)."""
    n = len(find_blocks(model))
    pieces, _ = split_model(model, list(range(n)), example)
    params = tuple(sum(p.numel() * p.element_size() for p in pc.parameters()) for pc in pieces)
    return BlockProfile((0.0,) * n, params, (0,) * n)


class _SavedBytes:
    def __init__(self) -> None:
        self.total, self._seen = 0, set[int]()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not isinstance(t, nn.Parameter) and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.total += storage.nbytes()
        return t


def _detached(value):
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if torch.is_tensor(value) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _backward(out, grad) -> None:
    # an exported stage passes on tensors outside autograd too (rotary cos/sin, masks)
    pairs = [
        (o, g)
        for o, g in zip(_as_tuple(out), _as_tuple(grad))
        if g is not None and torch.is_tensor(o) and o.requires_grad
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _input_grads(value):
    grads = tuple(v.grad if torch.is_tensor(v) else None for v in _as_tuple(value))
    return grads if isinstance(value, tuple) else grads[0]


def contiguous_min_max(
    weights: Sequence[float], parts: int, *, fits: Callable[[int, int], bool] | None = None
) -> list[int]:
    """Start indices of `parts` contiguous groups minimising the largest group sum.

    `fits(a, b)` says whether blocks a..b-1 may form one stage (the memory budget). Dynamic
    programming over (groups, prefix length): O(parts x n^2), n being the blocks.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for b in range(k, n + 1):
            for a in range(k - 1, b):
                if best[k - 1][a] == inf or (fits is not None and not fits(a, b)):
                    continue
                value = max(best[k - 1][a], prefix[b] - prefix[a])
                if value < best[k][b]:
                    best[k][b], cut[k][b] = value, a
    if best[parts][n] == inf:
        raise ValueError("no split fits the memory budget")
    starts, b = [], n
    for k in range(parts, 0, -1):
        b = cut[k][b]
        starts.append(b)
    return starts[::-1]


def uniform_starts(blocks: int, parts: int) -> list[int]:
    return [round(s * blocks / parts) for s in range(parts)]


def choose_starts(
    method: str,
    parts: int,
    profile: BlockProfile | None,
    *,
    blocks: int,
    cuts: Sequence[int] = (),
    memory_budget_bytes: float | None = None,
    memory_factor: float = 1.0,
) -> list[int]:
    """Stage start blocks for `method` (auto, parameters, uniform or manual)."""
    if method == "uniform":
        return uniform_starts(blocks, parts)
    if method == "manual":
        return [0, *cuts]
    assert profile is not None
    if method == "parameters":
        return contiguous_min_max(profile.param_bytes, parts)
    fits = None
    if memory_budget_bytes is not None:

        def fits(a: int, b: int) -> bool:
            params = sum(profile.param_bytes[a:b])
            acts = sum(profile.activation_bytes[a:b])
            return params * memory_factor + acts <= memory_budget_bytes

    return contiguous_min_max(profile.seconds, parts, fits=fits)
