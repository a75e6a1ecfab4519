"""The job's objects on one engine: the cell run after seeding, and its names checked."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sagenb.config.job import Job, JobError
from sagenb.engine.data.collation import Collate, example_batch
from sagenb.engine.data.stream import as_source, readable
from sagenb.engine.model.delayed import meta_parameters
from sagenb.engine.model.pretrained import Checkpoint, check_matches, find_checkpoint, load_whole
from sagenb.engine.objective import Objective
from sagenb.engine.user_optimizer import cell_parameters

__all__ = ["Workspace", "build_workspace", "seed_everything"]


@dataclass
class Workspace:
    """What the cell defined; the optional hooks are None when the cell left them out."""

    model: nn.Module
    dataset: Any
    #: the cell's loss_fn, or None: the model's own loss (dict samples with labels)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    make_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    eval_dataset: Any = None
    tp_plan: dict[str, Any] | None = None
    #: the cell's collate_fn(samples) -> batch, or None: torch's default_collate
    collate_fn: Collate | None = None
    #: the cell's own gradient synchronisation, class DDP(module) (--strategy own), or None
    own_ddp: Callable[[nn.Module], nn.Module] | None = None
    #: the pretrained weights the cell names (its `pretrained` variable, or what its
    #: from_pretrained loaded under --delay-init), which each strategy reads only its part of
    checkpoint: Checkpoint | None = None
    #: the cell's model's parameters as the cell built them, by id (engine/user_optimizer.py:
    #: a make_optimizer over them is mapped onto the strategy's by name)
    cell_parameters: dict[int, tuple[str, nn.Parameter]] = field(default_factory=dict)
    #: whether collate_fn drew random numbers making its first batch (set by build_workspace)
    collate_draws: bool = field(init=False, default=False)
    #: how batches reach the model and become a loss: set by build_workspace, the one place
    #: a Workspace is made, once the cell's names are checked (not an __init__ argument)
    objective: Objective = field(init=False)


def seed_everything(seed: int) -> None:
    """torch's RNG is the contract; Python's and numpy's are seeded too for cells that use them."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional for the engine side
        pass


def build_workspace(
    job: Job, seed: int, *, delay_init: bool = False, read_pretrained: bool = True
) -> Workspace:
    """Run the job after seeding; with delay_init its parameters are left on the meta device.

    Without delay_init, the `pretrained` checkpoint a cell names is read into the model here,
    unless `read_pretrained` is False (the estimate and the planner need shapes, not values)."""
    seed_everything(seed)
    with meta_parameters() if delay_init else nullcontext() as loaded:
        ns = job.namespace()
    missing = [n for n in ("model", "dataset") if n not in ns]
    if missing:
        raise JobError(f"the job defines no {', '.join(missing)}")
    ws = Workspace(
        model=ns["model"],
        dataset=ns["dataset"],
        loss_fn=ns.get("loss_fn"),
        make_optimizer=ns.get("make_optimizer"),
        make_scheduler=ns.get("make_scheduler"),
        eval_dataset=ns.get("eval_dataset"),
        tp_plan=ns.get("tp_plan"),
        collate_fn=ns.get("collate_fn"),
        own_ddp=ns.get("DDP"),
    )
    _check(ws)
    ws.cell_parameters = cell_parameters(ws.model)
    ws.checkpoint = find_checkpoint(ns, ws.model, loaded)
    if ws.checkpoint is not None:
        check_matches(ws.model, ws.checkpoint)
        if not delay_init and read_pretrained:  # the whole checkpoint: no split to read by
            load_whole(ws.model, ws.checkpoint)
    if readable(ws.dataset, 1) == 0:
        raise JobError("dataset is empty")
    # what the model will be given is checked: with a collate_fn, a batch it made (labels it
    # builds count), else a sample (default_collate keeps its keys)
    if ws.collate_fn is None:
        first = ws.dataset[0]
    else:
        first, ws.collate_draws = example_batch(ws.dataset, ws.collate_fn, readable(ws.dataset, 2))
    ws.objective = Objective.build(ws.model, ws.loss_fn, first, ws.collate_fn)
    return ws


def _check(ws: Workspace) -> None:
    if not isinstance(ws.model, nn.Module):
        raise JobError(f"model must be a torch.nn.Module, got {type(ws.model).__name__}")
    ws.dataset = as_source("dataset", ws.dataset)
    if ws.eval_dataset is not None:
        ws.eval_dataset = as_source("eval_dataset", ws.eval_dataset)
    for name in ("loss_fn", "make_optimizer", "make_scheduler", "collate_fn"):
        value = getattr(ws, name)
        if value is not None and not callable(value):
            raise JobError(f"{name} must be callable, got {type(value).__name__}")
    if ws.tp_plan is not None and not isinstance(ws.tp_plan, dict):
        raise JobError(f"tp_plan must be a dict of module path -> style, got {ws.tp_plan!r}")
    if not any(p.requires_grad for p in ws.model.parameters()):
        raise JobError("model has no trainable parameters")
