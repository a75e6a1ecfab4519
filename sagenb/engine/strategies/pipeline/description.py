"""What the rest of sagenb knows of the pipeline strategies without running one: `model` (one
pipeline) and `hybrid` (data parallel across pipelines) described for the registry
(strategies/description.py): their options, checks, batch split, engines, layout line, the
idle fraction of a step (its bubble) and what builds the engine side (strategy.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sagenb.config.errors import ConfigError
from sagenb.engine.strategies.base import Strategy
from sagenb.engine.strategies.description import Description, plural
from sagenb.engine.strategies.pipeline.attribution import PipelineAttribution
from sagenb.engine.strategies.pipeline.options import (
    OPTIONS,
    SPLIT_BACKWARD,
    PipelineOptions,
    check_options,
)
from sagenb.engine.strategies.pipeline.orders import ideal_bubble
from sagenb.engine.strategies.pipeline.strategy import Pipeline

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["DESCRIPTIONS", "bubble_fraction", "schedule_bubble"]


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a GPipe/1F1B step, (p - 1) / (m + p - 1) for p stages and m
    microbatches (Huang et al. 2019, GPipe, section 2.2); interleaving v chunks per engine
    shrinks it to (p - 1) / (v m + p - 1) (Narayanan et al. 2021, section 2.2)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def schedule_bubble(schedule: str, partitions: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a step of `schedule` on equal stages: the closed form where there
    is one (bubble_fraction), else the schedule's own order run on equal stages
    (orders.ideal_bubble: looped BFS and the zero-bubble ones)."""
    if schedule in ("gpipe", "1f1b", "interleaved"):
        return bubble_fraction(partitions, microbatches, virtual)
    return ideal_bubble(schedule, partitions, virtual, microbatches)


class PipelineDescription(Description):
    """Pipelines: `model` (one pipeline) and `hybrid` (data parallel across pipelines)."""

    pipelined = True
    #: every pipeline option (options.py): under another strategy a value other than its
    #: default would silently change nothing, so it is refused (and greyed out in the panel)
    options = OPTIONS

    def attribution(self) -> PipelineAttribution:
        return PipelineAttribution()

    def bubble(self, config: EngineConfig) -> float:
        pipe = PipelineOptions.of(config)
        return schedule_bubble(pipe.schedule, pipe.partitions, pipe.microbatches, pipe.chunks)

    def splits_backward(self, config: EngineConfig) -> bool:
        return PipelineOptions.of(config).schedule in SPLIT_BACKWARD

    def check(self, config: EngineConfig) -> None:
        P = PipelineOptions.of(config).partitions
        if P < 2:
            raise ConfigError("partitions", P, f"--strategy {self.name} needs at least 2")
        check_options(config)
        self.check_engines(config)

    def check_engines(self, config: EngineConfig) -> None:
        """--engines, when given, must be whole pipelines."""
        P = PipelineOptions.of(config).partitions
        if config.engines is not None and config.engines % P:
            raise ConfigError(
                "engines",
                config.engines,
                f"must be a multiple of --partitions ({P}): each replica is a whole pipeline",
            )

    def replicas(self, config: EngineConfig, engines: int) -> int:
        return engines // PipelineOptions.of(config).partitions

    def split(self, config: EngineConfig, engines: int) -> tuple[int, str]:
        pipe = PipelineOptions.of(config)
        replicas = self.replicas(config, engines)
        pieces = replicas * config.grad_accum * pipe.microbatches
        product = f"{replicas} x {config.grad_accum} x {pipe.microbatches}"
        return pieces, f"replicas x grad-accum x microbatches = {product}"

    def layout(self, config: EngineConfig, engines: int) -> str:
        pipe = PipelineOptions.of(config)
        chunked = f" x {pipe.chunks} chunks" if pipe.chunks > 1 else ""
        replicas = plural(self.replicas(config, engines), "replica")
        return (
            f"{self.name}: {pipe.partitions} partitions{chunked} x {replicas}, "
            f"{pipe.schedule}, {pipe.microbatches} microbatches"
        )

    def build(
        self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device
    ) -> Strategy:
        return Pipeline(config, rank=rank, world_size=world_size, device=device)


class ModelParallelDescription(PipelineDescription):
    name = "model"
    summary = "pipeline model parallel: one pipeline, an engine per partition"
    menu_order = 10

    def check_engines(self, config: EngineConfig) -> None:
        pipe = PipelineOptions.of(config)
        if config.engines not in (None, pipe.partitions):
            raise ConfigError(
                "engines",
                config.engines,
                f"--strategy model uses one engine per partition: must equal --partitions "
                f"({pipe.partitions}); for data parallel across pipelines use --strategy "
                f"hybrid",
            )
        if config.engines is None:
            config.check_split(pipe.partitions)

    def engines_to_start(self, config: EngineConfig) -> int:
        return PipelineOptions.of(config).partitions

    def engines_for(self, config: EngineConfig, available: int) -> int:
        return PipelineOptions.of(config).partitions


class HybridDescription(PipelineDescription):
    name = "hybrid"
    summary = "data parallel across pipeline replicas"
    menu_order = 20

    def engines_to_start(self, config: EngineConfig) -> int:
        return 2 * PipelineOptions.of(config).partitions


DESCRIPTIONS = (ModelParallelDescription(), HybridDescription())
