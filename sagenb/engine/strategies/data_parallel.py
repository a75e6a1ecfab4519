"""Data parallel: every engine holds the whole model and a slice of each global batch.

DistributedDataParallel averages gradients across engines after each backward (through shared
memory when every engine is on one host's CPU: engine/wire/shared_memory.py). Each engine
takes an equal, contiguous share of every slice of the global batch, so the averaged gradient
of equal-sized means is exactly the gradient of the mean over the whole batch.

With --expert-parallel E, every engine still takes its own share of the batch, but each group
of E engines spreads the experts of every mixture-of-experts layer among its own and sends
each token to its experts' engine (experts/): the gradients are then averaged by
experts/groups.py instead of DDP, which would average the different experts of a group.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sagenb.config.job import JobError
from sagenb.engine.data.order import eval_batches, fetch, to_device
from sagenb.engine.model.delayed import materialize
from sagenb.engine.model.sync_batchnorm import sync_batchnorm
from sagenb.engine.objective import Objective, piece_loss, weighted
from sagenb.engine.strategies.attribution import (
    Attribution,
    FakeModel,
    Ranks,
    Trace,
    grad_bytes,
    ring,
)
from sagenb.engine.strategies.description import (
    DEFAULT_ENGINES,
    Description,
    plural,
)
from sagenb.engine.strategies.experts import (
    EXPERT_PARALLEL,
    ExpertGroups,
    RoutingCounts,
    check_expert_parallel,
    count_routing,
    expert_ranks,
    experts_layout,
    find_packed,
    watch_experts,
)
from sagenb.engine.wire import shared_memory
from sagenb.engine.workspace import Workspace
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["DESCRIPTIONS", "DataParallel", "eval_sums"]


class DataParallel:
    #: DDP's reduced gradients are whole tensors on every rank (engine/loop.py _GlobalCount)
    counts_in_flight = True

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        seed: int = 0,
        expert_parallel: int = 1,
        timeout_s: float = 1800.0,
    ):
        self.rank, self.world_size, self.device, self.seed = rank, world_size, device, seed
        self.timeout_s = timeout_s  # the run's collective timeout (shared-memory reductions)
        self.module: nn.Module
        self._ddp: DistributedDataParallel | None = None
        self.experts: ExpertGroups | None = None
        self.routing: RoutingCounts | None = None
        if expert_parallel > 1:  # its all-reduces and exchanges run on groups of their own
            self.counts_in_flight = False
            self.experts = ExpertGroups(
                rank=rank, world_size=world_size, degree=expert_parallel, device=device
            )

    def setup_replica(self, ws: Workspace) -> nn.Module:
        """The whole model for this engine: materialised (--delay-init: every engine needs
        all of it), its BatchNorm over the global batch where there is more than one replica,
        as one process would see it."""
        self.key_order = list(ws.model.state_dict().keys())
        if any(p.is_meta for p in ws.model.parameters()):
            materialize(
                ws.model, [ws.model], seed=self.seed, device=self.device, checkpoint=ws.checkpoint
            )
        return sync_batchnorm(ws.model, device=self.device) if self.world_size > 1 else ws.model

    def setup(self, ws: Workspace) -> None:
        model = self.setup_replica(ws)
        if self.experts is not None:
            self.experts.spread(model)
            self.routing = self.experts.counts
            self.module = model.to(self.device)
            return
        self.routing = count_routing(find_packed(model))
        self.module = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: each gradient is a view into the bucket DDP all-reduces,
        # so the reduced bucket is not copied back into separate gradients after every
        # backward (torch's DDP docs; 1.04x steps/s on benchmarks/against_peers.py's
        # integer-class job, median of 5 A/B pairs, issue 31)
        self._ddp = DistributedDataParallel(
            self.module, device_ids=device_ids, gradient_as_bucket_view=True
        )
        # engines of one host on its CPU: the gradients' all-reduce through shared memory,
        # not gloo's loopback sockets (engine/wire/shared_memory.py)
        reducer = shared_memory.attach(
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            timeout_s=self.timeout_s,
        )
        if reducer is not None:
            self._ddp.register_comm_hook(None, reducer.hook)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def local_indices(self, slice_indices: torch.Tensor) -> torch.Tensor:
        share = len(slice_indices) // self.world_size
        return slice_indices[self.rank * share : (self.rank + 1) * share]

    @property
    def replicas(self) -> int:
        return self.world_size

    @property
    def collated_parts(self) -> int:
        return 1  # each batch is one forward: collated whole

    def forward_backward(
        self, batch: Any, objective: Objective, *, scale: float, sync: bool
    ) -> torch.Tensor | None:
        if self._ddp is None:  # expert parallel: reduced here after the last backward
            loss = piece_loss(objective, self.module, batch, scale)
            if sync and self.experts is not None:
                self.experts.reduce(self.module)
            return loss
        try:
            with nullcontext() if sync else self._ddp.no_sync():
                return piece_loss(objective, self._ddp, batch, scale)
        except RuntimeError as err:
            raise _unused(err, self.module) from None

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.experts is not None:
            return self.experts.clip(self.module, max_norm)
        # After DDP's all-reduce every engine holds the same full gradient, so the local norm
        # is the global norm one process would compute.
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))

    def step_metrics(self) -> dict[str, Any]:
        return {keys.EXPERT_TOKENS: self.routing.take()} if self.routing is not None else {}

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        if self.experts is not None:
            return self.experts.checkpoint_state(self.module)
        return self.module.state_dict()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.experts is not None:  # this engine's experts: the rows of their views
            mine = self.experts.keys(self.module)
            state = {
                k: v.to_local() if k in mine and isinstance(v, DTensor) else v
                for k, v in state.items()
            }
        self.module.load_state_dict(state)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.experts is not None:  # every engine takes part in gathering the experts
            state = self.experts.full_state(self.module)
            return state if self.rank == 0 else None
        if self.rank != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def evaluate(self, dataset: Any, objective: Objective, batch_size: int) -> float:
        mine = eval_batches(len(dataset), batch_size, parts=self.world_size, part=self.rank)
        uncounted: list[torch.Tensor] = []
        if self.experts is not None:  # every engine of a group in each of its exchanges
            count = -(-len(range(self.rank, len(dataset), self.world_size)) // batch_size)
            filler = torch.arange(min(batch_size, len(dataset)))
            uncounted = [filler] * (self.experts.most(count) - count)
        total = eval_sums(self.module, dataset, objective, mine, self.device, uncounted)
        dist.all_reduce(total)
        return float(total[0] / total[1])


def eval_sums(
    module: nn.Module,
    dataset: Any,
    objective: Objective,
    batches: Iterable[torch.Tensor],
    device: torch.device,
    uncounted: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """[sum of loss x counted targets, counted targets] over the dataset's samples at
    `batches` (tensors of indices, from data.eval_batches; each batch collated on its own, by
    the cell's collate_fn when it has one), in eval mode: the eval loss is their ratio, the mean
    over every counted target. The `uncounted` batches are run after them and not counted: an
    engine with fewer batches than its expert-parallel group still takes part in each of the
    group's token exchanges."""
    was_training = module.training
    module.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for indices in batches:
        batch = to_device(fetch(dataset, indices, objective.collate_fn), device)
        args, kwargs, target = objective.split(batch)
        count = objective.count(target, batch)
        total[0] += weighted(objective.loss(module(*args, **kwargs), target), count).double()
        total[1] += count
    for indices in uncounted:
        args, kwargs, _ = objective.split(
            to_device(fetch(dataset, indices, objective.collate_fn), device)
        )
        module(*args, **kwargs)
    module.train(was_training)
    return total


def _unused(err: RuntimeError, module: nn.Module) -> Exception:
    """DDP's error for parameters that received no gradient (it reads the indices of its
    trainable parameters), said with their names and what to do; any other error as it is."""
    text = str(err)
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    if "Expected to have finished reduction" not in text or found is None:
        return err
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    names = [trainable[int(i)] for i in found.group(1).split() if int(i) < len(trainable)]
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    return JobError(
        f"the model's forward used none of {len(names)} of its trainable parameters "
        f"({shown}) for the loss, and data parallel (DDP) waits for a gradient of every "
        f"trainable parameter each step: set requires_grad=False on those it does not use "
        f"(or remove them from the model)"
    )


class DataParallelDescription(Description):
    name = "data"
    summary = "data parallel (DDP): the whole model on every engine"
    menu_order = 0
    syncs_norm = True
    whole_model_per_rank = True
    options = (EXPERT_PARALLEL,)

    def check(self, config: EngineConfig) -> None:
        check_expert_parallel(config)

    def engines_to_start(self, config: EngineConfig) -> int:
        return max(DEFAULT_ENGINES, config.option("expert_parallel"))

    def layout(self, config: EngineConfig, engines: int) -> str:
        return f"data parallel on {plural(engines, 'engine')}{experts_layout(config)}"

    def inner_collectives(self, config: EngineConfig, engines: int) -> tuple[int, tuple[str, ...]]:
        degree = config.option("expert_parallel")
        return (engines, ()) if degree == 1 else (degree, ("all_to_all",))

    def attribution(self) -> Attribution:
        return ReplicatedAttribution()

    def build(
        self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device
    ) -> DataParallel:
        return DataParallel(
            rank=rank,
            world_size=world_size,
            device=device,
            seed=config.seed,
            expert_parallel=config.option("expert_parallel"),
            timeout_s=config.collective_timeout,
        )


class ReplicatedAttribution(Attribution):
    """Every rank holds every parameter, gradient and optimizer state, and the activations of
    its share of the batch; DDP all-reduces the gradients once per step (grad-accum's
    no_sync): 2(N-1)/N x gradient bytes. With --expert-parallel, experts/attribution.py."""

    def prepare(self, m: FakeModel) -> tuple[dict[nn.Module, str], Any]:
        return {}, watch_experts(m)

    def ranks(self, m: FakeModel, trace: Trace, layout: Any) -> Ranks:
        if layout is not None:
            return expert_ranks(m, trace, layout)
        held = {p: p.numel() for p in m.params}
        act = trace.peak_activations * m.scale
        send = {"all_reduce": ring("all_reduce", grad_bytes(held), m.world)}
        return Ranks([held] * m.world, [act] * m.world, [send] * m.world)


DESCRIPTIONS = (DataParallelDescription(),)
