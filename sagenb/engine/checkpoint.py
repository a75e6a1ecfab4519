"""Checkpoints every strategy can write and resume from, with torch.distributed.checkpoint.

A checkpoint holds the model (keys of the unsplit model, whatever the split), the optimizer
state (keyed by parameter name, so a pipeline stage's state lands on the same names), the
scheduler, the step reached (the sample order is a function of the seed, so the step is the
sampler's position) and every rank's torch RNG state. Each rank writes its own part; replicated
entries are written once (DCP's de-duplication).

Writes are atomic: all ranks write into `.step-N.tmp`, then rank 0 renames it to `step-N` and
points `latest` at it (write, then rename), so a crash mid-write leaves the last good
checkpoint untouched. The two newest checkpoints are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["save", "load", "latest", "KEEP"]

KEEP = 2
LATEST = "latest"


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path if path.is_dir() else None


def _state(strategy: Any, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = {f"model/{k}": v for k, v in strategy.checkpoint_state().items()}
    names = [name for name, _ in strategy.named_parameters()]
    packed = optimizer.state_dict()
    for index, entries in packed["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                state[f"optim/{names[index]}/{key}"] = value
    state["optim_groups"] = [
        {k: v for k, v in group.items() if k != "params"} for group in packed["param_groups"]
    ]
    state[f"rng/{rank}"] = torch.get_rng_state()
    return state


def save(
    directory: str | os.PathLike,
    step: int,
    *,
    strategy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
) -> str | None:
    """Write the checkpoint of `step` (a collective: every rank calls it). Returns None, or
    why it could not be written: this rank's error, or "" where only another rank failed.
    Every rank learns of a failure at each phase, so all of them stop together and the run
    keeps what it trained (engine/loop.py); none is left waiting in a collective."""
    root = Path(directory)
    name = f"step-{step:08d}"
    tmp = root / f".{name}.tmp"

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)

    def write() -> None:
        state = _state(strategy, optimizer, rank)
        state["step"] = step
        state["key_order"] = list(strategy.key_order)
        state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        dcp.save(state, checkpoint_id=tmp)

    def publish() -> None:
        if rank == 0:
            final = root / name
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer = root / f".{LATEST}.tmp"
            pointer.write_text(name)
            os.replace(pointer, root / LATEST)
            for old in sorted(root.glob("step-*"))[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)

    for phase in (prepare, write, publish):
        error = _agreed(_attempt(phase))
        if error is not None:
            return error
    return None


def _attempt(phase: Any) -> str | None:
    try:
        phase()
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        return f"{type(err).__name__}: {err}"
    return None


def _agreed(error: str | None) -> str | None:
    """`error` where this rank failed, "" where only another did, None where none did."""
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl() else None
    failed = torch.tensor([0 if error is None else 1], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() == 0:
        return None
    return error if error is not None else ""


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def load(
    directory: str | os.PathLike,
    *,
    strategy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
) -> int:
    """Restore the newest checkpoint into this rank's objects; returns its step (collective)."""
    path = latest(directory)
    if path is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {directory}")
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    target = _state(strategy, optimizer, rank)
    params = dict(strategy.named_parameters())
    names = list(params)
    for name, param in params.items():  # optimizer state that does not exist yet (no step taken)
        for key, meta in metadata.items():
            if key.startswith(f"optim/{name}/") and key not in target:
                target[key] = _empty(meta, like=param)
    target.update(step=0, key_order=None, scheduler=None)
    dcp.load(target, checkpoint_id=path)
    strategy.load_checkpoint_state(
        {k.removeprefix("model/"): v for k, v in target.items() if k.startswith("model/")}
    )
    _load_optimizer(optimizer, names, target)
    if scheduler is not None and target["scheduler"] is not None:
        scheduler.load_state_dict(target["scheduler"])
    torch.set_rng_state(target[f"rng/{rank}"])
    return int(target["step"])


def _empty(meta: Any, *, like: torch.Tensor) -> torch.Tensor:
    """Room for one saved optimizer entry: shaped like its parameter (momentum, Adam's
    moments; a DTensor shard when the parameter is sharded), else as saved (Adam's step)."""
    if not isinstance(meta, TensorStorageMetadata):
        raise TypeError(f"expected a tensor in the checkpoint, found {meta}")
    if tuple(meta.size) == tuple(like.shape) and meta.properties.dtype == like.dtype:
        return torch.empty_like(like.detach())
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def _load_optimizer(optimizer: torch.optim.Optimizer, names: list[str], state: dict) -> None:
    packed = optimizer.state_dict()
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(names):
        prefix = f"optim/{name}/"
        found = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if found:
            entries[index] = found
    groups = [
        {**saved, "params": current["params"]}
        for saved, current in zip(state["optim_groups"], packed["param_groups"])
    ]
    optimizer.load_state_dict({"state": entries, "param_groups": groups})
