"""The planner's engine side: build the cell's model, profile its blocks, cut it every way."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from sagenb.config import TrainConfig
from sagenb.engine.balance import choose_starts, profile_blocks
from sagenb.engine.data import fetch
from sagenb.engine.partition import find_blocks
from sagenb.engine.strategies.pipeline import MEMORY_FACTOR
from sagenb.engine.workspace import build_workspace
from sagenb.job import Job, JobError

__all__ = ["plan_on_engine"]


def plan_on_engine(job: Job, config: TrainConfig, replicas: int, threads: int) -> dict[str, Any]:
    """Cut points of every partition method for `config`, with the measured block profile.

    Profiled with the thread count training will use: with more threads than the engine will
    get, timings swing by 4x on a shared machine (measured on 2 cores)."""
    torch.set_num_threads(threads)
    ws = build_workspace(job, config.seed)
    blocks = find_blocks(ws.model)
    if len(blocks) < config.stages:
        raise JobError(
            f"the model has {len(blocks)} blocks, fewer than the {config.stages} pipeline "
            "stages asked for: lower --partitions"
        )
    mb = config.batch_size // (replicas * config.grad_accum * config.microbatches)
    batch = fetch(ws.dataset, torch.arange(min(mb, len(ws.dataset))))
    profile = profile_blocks(ws.model, batch, ws.objective)
    budget = config.memory_budget * 2**30 if config.memory_budget else None
    methods = {}
    for method in ("auto", "parameters", "uniform", "manual"):
        if method == "manual" and config.partition_by != "manual":
            continue
        try:
            methods[method] = choose_starts(
                method,
                config.stages,
                profile,
                blocks=len(blocks),
                cuts=config.cuts,
                memory_budget_bytes=budget,
                memory_factor=MEMORY_FACTOR,
            )
        except ValueError as exc:
            methods[method] = str(exc)
    return {
        "blocks": [blocks.qualified(i) for i in range(len(blocks))],
        "profile": asdict(profile),
        "starts": methods,
        "microbatch_size": mb,
    }
