"""Where the pipeline is cut: one choice for the trainer (strategies/pipeline/strategy.py) and the
planner's engine side (`plan_on_engine`, which builds the cell's model as training would,
profiles its blocks and cuts it every way), so that `%%smp_plan` shows the cut points
`%%smp_train` with the same flags will use (sagenb issue 18).

The choice depends on the options only through `--partition-by`, `--cuts`, `--memory-budget`
and `--delay-init`: with delay-init the parameters are on the meta device, which can be
counted but not run, so `auto` (measured time) becomes `parameters` and the profile is the
parameter bytes alone (balance.py static_profile). balance.py holds the methods
themselves; this module decides which one runs, on what profile, and checks `--cuts` against
the model's blocks before anything is measured.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sagenb.config import cell_module
from sagenb.config.job import Job, JobError
from sagenb.engine import edited_modules
from sagenb.engine.data.order import fetch
from sagenb.engine.data.stream import readable
from sagenb.engine.model.blocks import find_blocks
from sagenb.engine.model.kv_cache import cache_off
from sagenb.engine.objective import Objective
from sagenb.engine.strategies.pipeline.balance import (
    BlockProfile,
    choose_starts,
    profile_blocks,
    static_profile,
)
from sagenb.engine.strategies.pipeline.options import PARTITION_METHODS, PipelineOptions
from sagenb.engine.wire.output import text_output
from sagenb.engine.workspace import build_workspace

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = [
    "MEMORY_FACTOR",
    "check_blocks",
    "partition_method",
    "cut_profile",
    "choose_cuts",
    "plan_on_engine",
]

#: bytes held per parameter byte, for the memory budget: the parameter, its gradient and
#: AdamW's two moments (an upper bound for SGD with momentum, which keeps one)
MEMORY_FACTOR = 4.0

#: methods that read a profile (the others need only the number of blocks)
PROFILED = ("auto", "parameters")


def check_blocks(config: EngineConfig, blocks: int) -> None:
    """The stages and `--cuts` must fit the model's `blocks`: checked on every rank (and by
    the planner) before any profiling, so a bad value costs no measurement."""
    pipe = PipelineOptions.of(config)
    stages = pipe.stages
    if blocks < stages:
        raise JobError(
            f"the model has {blocks} blocks, fewer than the {stages} pipeline stages asked "
            f"for: lower --partitions{' or --virtual-stages' if pipe.chunks > 1 else ''}"
        )
    if pipe.partition_by == "manual" and pipe.cuts[-1] >= blocks:
        raise JobError(
            f"--cuts {','.join(map(str, pipe.cuts))}: the model has only {blocks} blocks "
            f"(0..{blocks - 1}); give {stages - 1} increasing block indices from 1 to "
            f"{blocks - 1}"
        )


def partition_method(config: EngineConfig, method: str | None = None) -> str:
    """The method that runs for `method` (default --partition-by): `auto` times the blocks,
    which meta parameters (--delay-init) cannot do, so it balances parameters instead."""
    method = method or PipelineOptions.of(config).partition_by
    if config.delay_init and method == "auto":
        return "parameters"
    return method


def cut_profile(
    model: nn.Module, config: EngineConfig, example: Any, objective: Objective
) -> BlockProfile:
    """The profile the cut choice reads: parameter bytes only with --delay-init (nothing is
    run, nothing materialised), else each block timed on `example` (balance.profile_blocks)."""
    if config.delay_init:
        return static_profile(model)
    return profile_blocks(model, example, objective)


def choose_cuts(
    model: nn.Module,
    config: EngineConfig,
    example: Any,
    objective: Objective,
    *,
    method: str | None = None,
    profile: BlockProfile | None = None,
) -> list[int]:
    """Stage start blocks (starts[0] == 0) for `method` (default --partition-by).

    `profile` is measured here when the method needs one and none is given (the planner
    passes the one it shows); `example` is one microbatch of the size the schedule runs."""
    blocks = len(find_blocks(model))
    check_blocks(config, blocks)
    method = partition_method(config, method)
    if profile is None and method in PROFILED:
        profile = cut_profile(model, config, example, objective)
    pipe = PipelineOptions.of(config)
    budget = pipe.memory_budget * 2**30 if pipe.memory_budget else None
    try:
        return choose_starts(
            method,
            pipe.stages,
            profile,
            blocks=blocks,
            cuts=pipe.cuts,
            memory_budget_bytes=budget,
            memory_factor=MEMORY_FACTOR,
        )
    except ValueError as exc:
        raise JobError(f"--memory-budget {pipe.memory_budget}: {exc}") from None


def plan_on_engine(job: Job, config: EngineConfig, engines: int, threads: int) -> dict[str, Any]:
    """Cut points of `config` and of every other partition method, with the block profile.

    Profiled with the thread count training will use: with more threads than the engine will
    get, timings swing by several times on a shared machine (measured_in_code.md in
    benchmarks/results/). With --delay-init the
    model is built on the meta device, as training builds it, so nothing is materialised and
    the profile holds parameter bytes only (`measured` False)."""
    torch.set_num_threads(threads)
    with cell_module.scope():  # the cell's module (config/cell_module.py) lasts the plan
        return _plan(job, config, engines)


def _plan(job: Job, config: EngineConfig, engines: int) -> dict[str, Any]:
    edited_modules.drop_edited()  # the files beside the notebook as they are (training's too)
    with text_output():  # the cell's bars as text here too, no widget (engine/wire/output.py)
        ws = build_workspace(job, config.seed, delay_init=config.delay_init, read_pretrained=False)
    edited_modules.note()
    cache_off(ws.model)  # profiled as it trains, without a key/value cache; built for this only
    blocks = find_blocks(ws.model)
    check_blocks(config, len(blocks))  # the trainer's errors, before anything is measured
    mb = config.forward_size(engines)
    example = fetch(ws.dataset, torch.arange(readable(ws.dataset, mb)), ws.collate_fn)
    profile = cut_profile(ws.model, config, example, ws.objective)

    def cuts(method: str) -> list[int]:
        return choose_cuts(ws.model, config, example, ws.objective, method=method, profile=profile)

    alternatives: dict[str, list[int] | str] = {}
    for method in PARTITION_METHODS:
        # manual only as the method asked for; auto is parameters under --delay-init
        if method == "manual" or partition_method(config, method) == partition_method(config):
            continue
        try:
            alternatives[method] = cuts(method)
        except JobError as exc:
            alternatives[method] = str(exc)
    return {
        "blocks": [blocks.qualified(i) for i in range(len(blocks))],
        "profile": asdict(profile),
        "measured": not config.delay_init,
        "method": partition_method(config),
        "starts": cuts(PipelineOptions.of(config).partition_by),
        "alternatives": alternatives,
        "microbatch_size": mb,
    }
