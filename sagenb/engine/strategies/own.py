"""Your own data parallelism: the cell's `DDP` class synchronises the gradients (issue 55).

`--strategy own` trains as data parallel does (every engine holds the whole model and an equal
share of each global batch, in the order one process would visit it), with the cell's own
gradient synchronisation in place of torch's DistributedDataParallel. The cell defines

    class DDP(nn.Module):
        def __init__(self, module): ...  # e.g. broadcast rank 0's parameters, register hooks
        def forward(self, *args, **kwargs): ...  # the module's forward
        def finish_gradient_synchronization(self): ...  # wait for what backward started

the interface of the DDP assignment in Stanford's CS336 (2025, assignment 2), over
torch.distributed's default process group, which sagenb has set up (gloo on CPU, nccl on
CUDA): `dist.get_rank()`, `dist.get_world_size()`, `dist.all_reduce(..., async_op=True)` and
the tensors' `register_post_accumulate_grad_hook` are all it needs. Each step is forward and
backward through the cell's DDP, `finish_gradient_synchronization()`, then the optimizer: the
cell's `make_optimizer`, which may shard its state over the ranks (ZeRO-1) as it likes.

What sagenb does around it: the same sample order, loss weighting and parameters as one
process, so a run is checked against one like any strategy's; the run's collectives are
counted by the flight recorder (sizing/traffic.py) as for DDP, and each step's own in each
rank's metrics (`all_reduces`, `all_reduced(B)`, and `overlapped`: the share of those bytes
whose all-reduce began before backward ended, 0 for a DDP that reduces after backward); and
after every step the ranks
compare a fingerprint of their parameters, so a synchronisation that leaves the replicas apart
fails the run with the step and the parameter, instead of training on silently. A collective
one rank never joins ends at the run's --collective-timeout, as any strategy's would.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sagenb.config.errors import ConfigError
from sagenb.config.job import JobError
from sagenb.engine.objective import Objective, piece_loss
from sagenb.engine.strategies.data_parallel import DataParallel, ReplicatedAttribution
from sagenb.engine.strategies.description import Description, plural
from sagenb.engine.strategies.experts import count_routing, find_packed
from sagenb.engine.wire.traffic import collectives_since
from sagenb.engine.workspace import Workspace
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["DESCRIPTIONS", "OwnDataParallel", "reduced", "replicas_apart"]

#: the relative difference of two ranks' parameter fingerprints that counts as apart: a
#: synchronisation that reduces the same bytes gives every rank the same update, bit for bit
#: (gloo's and nccl's all-reduce return one result to all), so any real difference is a bug
APART = 1e-6


class OwnDataParallel(DataParallel):
    """Data parallel whose gradients the cell's `DDP` wrapper synchronises."""

    #: the step's target count is reduced before the first forward, never while the cell's
    #: own collectives may be in flight on the same group
    counts_in_flight = False

    def setup(self, ws: Workspace) -> None:
        if ws.own_ddp is None:
            raise JobError(
                "--strategy own trains with the cell's own class DDP(module), which it does not "
                "define: see sagenb/engine/strategies/own.py for what it must have"
            )
        model = self.setup_replica(ws)
        self.routing = count_routing(find_packed(model))
        self.module = model.to(self.device)
        try:
            self.wrapper = ws.own_ddp(self.module)
        except Exception as exc:
            raise JobError(f"the cell's DDP(model) raised {type(exc).__name__}: {exc}") from exc
        finish = getattr(self.wrapper, "finish_gradient_synchronization", None)
        if not isinstance(self.wrapper, nn.Module) or not callable(finish):
            raise JobError(
                f"the cell's DDP(model) gave a {type(self.wrapper).__module__}."
                f"{type(self.wrapper).__qualname__}: it must be a torch.nn.Module with a "
                "finish_gradient_synchronization() method"
            )
        self._finish = finish
        self._step = 0

    def forward_backward(
        self, batch: Any, objective: Objective, *, scale: float, sync: bool
    ) -> torch.Tensor | None:
        started = time.time_ns()
        loss = piece_loss(objective, self.wrapper, batch, scale)
        backward_end = time.time_ns()
        self._finish()
        self._window = (started, backward_end, time.time_ns())
        return loss

    def step_metrics(self) -> dict[str, Any]:
        self._step += 1
        apart = replicas_apart(self.module, self.world_size)
        if apart is not None:
            name, diff = apart
            raise JobError(
                f"after step {self._step} the replicas' parameters differ (by {diff:.3g} in "
                f"{name}): the cell's DDP must leave every rank the same averaged gradients "
                "once finish_gradient_synchronization() returns: does it wait for every "
                "all-reduce it started, on every rank?"
            )
        return {**super().step_metrics(), **reduced(*self._window)}


def reduced(started_ns: int, backward_end_ns: int, finished_ns: int) -> dict[str, Any]:
    """What the cell's DDP all-reduced in one step, from the flight recorder
    (engine/wire/traffic.py): how many all-reduces began from the forward's start until
    finish_gradient_synchronization() returned, their bytes, and the share of those bytes
    whose all-reduce began before backward ended. Nothing where this torch build has no
    recorder."""
    found = collectives_since(started_ns)
    if found is None:
        return {}
    mine = [c for c in found if c["kind"] == "all_reduce" and c["time_ns"] < finished_ns]
    total = sum(c["input_bytes"] for c in mine)
    early = sum(c["input_bytes"] for c in mine if c["time_ns"] < backward_end_ns)
    return {
        keys.ALL_REDUCES: len(mine),
        keys.ALL_REDUCED: total,
        keys.OVERLAPPED: early / total if total else 0.0,
    }


def replicas_apart(module: nn.Module, world_size: int) -> tuple[str, float] | None:
    """The first parameter whose fingerprint (its sum and its sum of squares, in float64)
    differs between ranks, and by how much relative to its size; None where all agree.
    One all-gather of two numbers a parameter."""
    if world_size == 1:
        return None
    named = list(module.named_parameters())
    mine = torch.stack(
        [
            torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
            for _, p in named
        ]
    )
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    every = torch.stack(gathered)  # rank x parameter x (sum, sum of squares)
    spread = (every.amax(0) - every.amin(0)) / every.abs().amax(0).clamp_min(1e-30)
    worst = spread.amax(1)
    index = int(worst.argmax())
    return (named[index][0], float(worst[index])) if float(worst[index]) > APART else None


class OwnDescription(Description):
    name = "own"
    summary = "your own data parallel: the cell's DDP class synchronises the gradients"
    menu_order = 90
    syncs_norm = True
    whole_model_per_rank = True

    def check(self, config: EngineConfig) -> None:
        if config.grad_accum != 1:
            raise ConfigError(
                "grad_accum",
                config.grad_accum,
                "must be 1 with --strategy own: the cell's DDP synchronises after every "
                "backward, where accumulation needs it to wait for the last",
            )

    def layout(self, config: EngineConfig, engines: int) -> str:
        return f"your own data parallel on {plural(engines, 'engine')}"

    def attribution(self) -> ReplicatedAttribution:
        return ReplicatedAttribution()  # what a ring all-reduce of the gradients sends

    def build(
        self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device
    ) -> OwnDataParallel:
        return OwnDataParallel(
            rank=rank,
            world_size=world_size,
            device=device,
            seed=config.seed,
            timeout_s=config.collective_timeout,
        )


DESCRIPTIONS = (OwnDescription(),)
