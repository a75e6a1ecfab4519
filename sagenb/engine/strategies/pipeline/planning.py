"""The planner's engine side: build the cell's model as training would, profile its blocks and
cut it every way, with the trainer's own choice of cut points (cuts.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from sagenb.config import cell_module
from sagenb.config.job import Job, JobError
from sagenb.engine import edited_modules
from sagenb.engine.data.order import fetch
from sagenb.engine.data.stream import readable
from sagenb.engine.model.kv_cache import cache_off
from sagenb.engine.strategies.pipeline.cuts import (
    check_blocks,
    choose_cuts,
    cut_profile,
    partition_method,
)
from sagenb.engine.strategies.pipeline.options import PARTITION_METHODS, PipelineOptions
from sagenb.engine.strategies.pipeline.partition import find_blocks
from sagenb.engine.wire.output import text_output
from sagenb.engine.workspace import build_workspace

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["plan_on_engine"]


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
