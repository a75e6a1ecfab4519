"""What the notebook runs against the live run an engine keeps (kept.py), on every rank at
once: the user's function (`call`, smp_result.on_engines), the strategy's evaluation of a
dataset (`evaluate`) and greedy generation (`generate`). Each rank works on the model as its
strategy holds it (a shard, a stage, a slice), in the kept process group; no rank gathers it.
The random states are left as the run ended: a --continue puts them back (kept.take), so
nothing done here changes what the next segment trains.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sagenb.engine.data.stream import as_source
from sagenb.engine.live import kept

__all__ = ["CallFailed", "call", "evaluate", "generate"]


class CallFailed(RuntimeError):
    """A rank's call raised; carries its traceback as text."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _contained(work: Callable[[], Any]) -> Any:
    """`work()`, its error as a CallFailed naming the rank (no live frames or tensors travel)."""
    try:
        return work()
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt too: the notebook asked
        where = f"rank {_rank()} on {socket.gethostname()}, pid {os.getpid()}"
        raise CallFailed(f"{where}:\n{traceback.format_exc()}") from None


def call(lineage: str, fn: Callable[..., Any], args: tuple) -> Any:
    """`fn(model, rank, *args)` with this rank's live model (the strategy's module)."""
    state = kept.held(lineage)
    return _contained(lambda: fn(state.strategy.module, _rank(), *args))


def evaluate(lineage: str, dataset: Any, batch_size: int | None) -> float:
    """The mean loss over `dataset`, by the strategy, as the run's --eval-every computes it."""
    state = kept.held(lineage)
    size = batch_size or state.config.batch_size

    def work() -> float:
        source = as_source("eval_dataset", dataset)
        return float(state.strategy.evaluate(source, state.ws.objective, size))

    return _contained(work)


def generate(lineage: str, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding: `max_new_tokens` times, the model's logits at the last position, its
    arg max appended (every rank the same forward, as its strategy's collectives need). The
    model's mode is put back after; its KV caches stay off, as the run turned them off
    (engine/model/kv_cache.py)."""
    state = kept.held(lineage)
    strategy, device = state.strategy, state.device

    def work() -> torch.Tensor:
        module = strategy.module
        _check_context(module, input_ids.shape[1], max_new_tokens)
        was_training = module.training
        module.eval()
        ids = input_ids.to(device)
        try:
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    ids = torch.cat([ids, _next(strategy, state.ws.objective, ids)], dim=1)
        finally:
            module.train(was_training)
        return ids.cpu()

    return _contained(work)


#: the config fields that fix a model's context: nanoGPT's block_size, GPT-2's n_positions
CONTEXT_FIELDS = ("block_size", "n_positions")


def _check_context(module: torch.nn.Module, length: int, new: int) -> None:
    """Refused, naming the field, when the sequence would outgrow a context of learned
    positions (its embedding would be read past its last row: a bare IndexError)."""
    for path, sub in module.named_modules():
        config = sub.__dict__.get("config")
        for name in CONTEXT_FIELDS:
            limit = getattr(config, name, None)
            if isinstance(limit, int) and length + new > limit:
                where = f"{path}.config" if path else "model.config"
                raise ValueError(
                    f"generate: {length} prompt tokens + max_new_tokens {new} = "
                    f"{length + new} pass the model's context, {where}.{name} = {limit}: "
                    f"give a shorter prompt or fewer new tokens"
                )


def _next(strategy: Any, objective: Any, ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1) greedy next tokens: the strategy's `next_tokens` where it has one (a
    pipeline runs its stages on the sequence padded to the shape they are compiled for), else
    the arg max of the module's logits at the last position."""
    if hasattr(strategy, "next_tokens"):
        return strategy.next_tokens(ids, objective).to(ids.dtype).unsqueeze(1)
    logits = _logits_of(strategy.module(ids))
    if hasattr(logits, "full_tensor"):  # a tensor-parallel DTensor: the whole vocabulary
        logits = logits.full_tensor()
    return logits[:, -1, :].argmax(-1, keepdim=True).to(ids.dtype)


def _logits_of(out: Any) -> torch.Tensor:
    """The logits of a forward's output: transformers' `.logits`, the first of a (logits,
    loss) tuple (nanoGPT's), or the tensor itself."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out
