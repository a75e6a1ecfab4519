"""Sharded data parallel: FSDP2 (`fully_shard`), ZeRO-3 style, across every engine.

Each engine takes its share of every global batch, as in data parallel, but holds only 1/N of
every parameter, gradient and optimizer state. Every repeated block (as found for pipeline
splitting) is its own FSDP unit, and the root holds the rest (embeddings, head): before a unit
computes, its parameters are all-gathered; after backward its gradients are reduce-scattered
(averaged), so each engine steps the optimizer on its own shard. With
--no-reshard-after-forward the gathered parameters stay until backward (ZeRO-2: more memory,
one all-gather fewer per block). torch's FSDP2 tutorial and torchtitan apply it the same way.

With --replicas R (hybrid sharding, HSDP) the engines form a 2-D mesh (replicate R, shard N/R):
each group of N/R consecutive engines shards the model among itself, and the R groups hold the
same shards, their gradients all-reduced across the groups after the reduce-scatter within
each. A group of consecutive ranks stays on one host, so the gathers and reduce-scatters that
run every block stay inside it and only the gradient all-reduce crosses hosts. `fully_shard`
does it all when its mesh is 2-D (torch.distributed.fsdp.fully_shard's docs; torchtitan's
`dp_replicate` x `dp_shard`, Accelerate's `dp_replicate_size` x `dp_shard_size`, SageMaker
model parallel v2's `hybrid_shard_degree`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from sagenb.config.errors import ConfigError
from sagenb.config.job import JobError
from sagenb.config.spec import Option
from sagenb.engine.model.blocks import find_blocks
from sagenb.engine.model.delayed import materialize
from sagenb.engine.model.pretrained import Checkpoint, load_local
from sagenb.engine.model.sync_batchnorm import sync_batchnorm
from sagenb.engine.objective import Objective, piece_loss
from sagenb.engine.strategies.attribution import (
    MIB,
    Attribution,
    FakeModel,
    Ranks,
    Trace,
    chunk_sizes,
    grad_bytes,
    module_bytes,
    param_bytes,
    ring,
)
from sagenb.engine.strategies.description import (
    DEFAULT_ENGINES,
    Description,
    plural,
    require_divides,
)
from sagenb.engine.strategies.experts import (
    EXPERT_PARALLEL,
    check_expert_parallel,
    expert_held,
    expert_sends,
    experts_layout,
    watch_experts,
)
from sagenb.engine.strategies.split_params import SplitParameters
from sagenb.engine.workspace import Workspace

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["DESCRIPTIONS", "Sharded"]


class Sharded(SplitParameters):
    """Data parallel whose parameters, gradients and optimizer state are split N ways."""

    counts_in_flight = False  # the global target count is reduced before the step

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        seed: int = 0,
        reshard_after_forward: bool = True,
        replicas: int = 1,
        expert_parallel: int = 1,
    ):
        super().__init__(
            rank=rank,
            world_size=world_size,
            device=device,
            seed=seed,
            expert_parallel=expert_parallel,
        )
        self.reshard_after_forward = reshard_after_forward
        self.groups = replicas  # --replicas (`replicas`, data_parallel.py, counts the batch split)

    def setup(self, ws: Workspace) -> None:
        self.key_order = list(ws.model.state_dict().keys())
        # every engine takes its own samples: BatchNorm over all of them, before FSDP wraps it
        model = sync_batchnorm(ws.model, device=self.device) if self.world_size > 1 else ws.model
        mesh = _mesh(self.device, self.world_size, self.groups)
        delayed = any(p.is_meta for p in model.parameters())
        options = self._options()
        if self.experts is not None:  # spread over their groups, not sharded (experts/)
            self.experts.spread(model)
            self.routing = self.experts.counts
            options["ignored_params"] = set(self.experts.split(model)[1])
        for block in _blocks(model):
            if delayed:  # materialise one block at a time: no engine ever holds the whole
                self._materialize(model, block, ws.checkpoint)
            fully_shard(_to(block, self.device), mesh=mesh, **options)
        if delayed:
            self._materialize(model, model, ws.checkpoint)
        root = fully_shard(_to(model, self.device), mesh=mesh, **options)
        assert isinstance(root, nn.Module)  # fully_shard returns the module it was given
        if delayed and ws.checkpoint is not None:  # each engine reads the rows of its shards
            load_local(root, ws.checkpoint, device=self.device)
        self.module = root

    def _materialize(self, model: nn.Module, part: nn.Module, ckpt: Checkpoint | None) -> None:
        """Seeded values for what no checkpoint holds; the checkpoint's parameters stay on
        the meta device until they are sharded (fully_shard keeps them there), then read."""
        materialize(model, [part], seed=self.seed, device=self.device, checkpoint=ckpt, defer=True)

    def _options(self) -> dict[str, Any]:
        return {"reshard_after_forward": self.reshard_after_forward}

    def forward_backward(
        self, batch: Any, objective: Objective, *, scale: float, sync: bool
    ) -> torch.Tensor:
        root: FSDPModule = self.module  # type: ignore[assignment]
        root.set_requires_gradient_sync(sync)  # accumulate locally until the last slice
        loss = piece_loss(objective, self.module, batch, scale)
        if sync and self.experts is not None:
            self.experts.reduce(self.module, whole=False)
        return loss

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.experts is not None:
            return self.experts.clip(self.module, max_norm)
        return super().clip_grad_norm(max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.experts is not None:  # every engine takes part in gathering
            state = self.experts.full_state(self.module)
            return state if self.rank == 0 else None
        return super().full_state_dict()


def _mesh(device: torch.device, world_size: int, replicas: int) -> DeviceMesh:
    """FSDP's mesh: 1-D over every engine, or 2-D (replicate, shard) for hybrid sharding, rank
    r in replica r // (N/R), holding shard r % (N/R) (init_device_mesh lays ranks out row by
    row)."""
    if replicas == 1:
        return init_device_mesh(device.type, (world_size,))
    shape = (replicas, world_size // replicas)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def _to(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` on `device`; one holding meta parameters is left to fully_shard, which moves
    its real states and keeps the meta ones for deferred initialisation."""
    if any(p.is_meta for p in module.parameters()):
        return module
    return module.to(device)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, each its own FSDP unit; a model without any is sharded whole."""
    try:
        blocks = find_blocks(model)
    except JobError:
        return []
    modules = [model.get_submodule(blocks.qualified(i)) for i in range(len(blocks))]
    return [m for m in modules if any(True for _ in m.parameters())]  # Tanh has nothing to shard


class ShardedDescription(Description):
    name = "sharded"
    summary = "sharded data parallel (FSDP2, ZeRO-3 or ZeRO-2; hybrid with --replicas)"
    menu_order = 30
    syncs_norm = True
    options = (
        EXPERT_PARALLEL,
        Option(
            "replicas",
            "parallelism",
            1,
            "groups of engines that each hold the whole model sharded among their own (hybrid "
            "sharding, HSDP): shards within a group, gradients all-reduced across the groups "
            "(1: every engine shares one sharding)",
        ),
        Option(
            "reshard_after_forward",
            "memory",
            True,
            "free each block's gathered parameters after its forward and gather them again "
            "for backward (ZeRO-3); --no-reshard-after-forward keeps them (ZeRO-2: more "
            "memory, less communication)",
        ),
    )

    def attribution(self) -> Attribution:
        return ShardedAttribution()

    def check(self, config: EngineConfig) -> None:
        replicas = config.option("replicas")
        if replicas < 1:
            raise ConfigError("replicas", replicas, "must be an integer >= 1")
        groups = "the engines form --replicas groups of equal size, each sharding the model"
        require_divides("replicas", replicas, config.engines, f"{groups} among its own engines")
        check_expert_parallel(config, delayed_ok=False)

    def engines_to_start(self, config: EngineConfig) -> int:
        groups = DEFAULT_ENGINES * config.option("replicas")
        degree = config.option("expert_parallel")
        return groups * degree // math.gcd(groups, degree)  # both must divide it

    def inner_collectives(self, config: EngineConfig, engines: int) -> tuple[int, tuple[str, ...]]:
        replicas = config.option("replicas")
        if replicas == 1:
            return engines, ()
        return engines // replicas, ("all_gather", "reduce_scatter")

    def layout(self, config: EngineConfig, engines: int) -> str:
        zero = "ZeRO-3" if config.option("reshard_after_forward") else "ZeRO-2"
        replicas = config.option("replicas")
        if replicas == 1:
            return f"sharded ({zero}) on {plural(engines, 'engine')}{experts_layout(config)}"
        return (
            f"hybrid sharded ({zero}): {engines // replicas}-way shards x "
            f"{plural(replicas, 'replica')}{experts_layout(config)}"
        )

    def build(
        self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device
    ) -> Sharded:
        return Sharded(
            rank=rank,
            world_size=world_size,
            device=device,
            seed=config.seed,
            reshard_after_forward=config.option("reshard_after_forward"),
            replicas=config.option("replicas"),
            expert_parallel=config.option("expert_parallel"),
        )


class ShardedAttribution(Attribution):
    """Each parameter, its gradient and its optimizer state split on dim 0 in torch.chunk's
    pieces, as `fully_shard` splits them; activations as data parallel. all_gather (S-1)/S x
    parameter bytes, twice per slice with reshard-after-forward (ZeRO-3: forward and
    backward), once without (ZeRO-2); reduce_scatter (S-1)/S x gradient bytes once per step:
    together ZeRO's 3 x params against DDP's 2 x. S is the engines that share one sharding: N,
    or N / R with --replicas R, whose groups then all-reduce each rank's gradient shard across
    the R groups (2 (R-1)/R x its bytes). The transiently gathered block is not in the figures
    (the engines' accounting counts the local shards too); its size is in the notes."""

    def prepare(self, m: FakeModel) -> tuple[dict[nn.Module, str], Any]:
        return {}, watch_experts(m)

    def ranks(self, m: FakeModel, trace: Trace, layout: Any) -> Ranks:
        N, cfg = m.world, m.config
        R = cfg.option("replicas")
        S = N // R  # the engines of one group; rank r holds shard r % S
        experts = layout.weights if layout is not None else set()  # --expert-parallel's
        sharded = [p for p in m.params if id(p) not in experts]
        held: list[dict[nn.Parameter, int]] = [{} for _ in range(N)]
        for p in sharded:
            rows = chunk_sizes(p.shape[0], S) if p.dim() else [1] + [0] * (S - 1)
            for r in range(N):
                held[r][p] = rows[r % S] * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
        whole = {p: p.numel() for p in sharded}
        gathers = (2 if cfg.option("reshard_after_forward") else 1) * cfg.grad_accum
        send = {  # frozen parameters are gathered too, only gradients are reduce-scattered
            "all_gather": gathers * ring("all_gather", param_bytes(whole), S),
            "reduce_scatter": ring("reduce_scatter", grad_bytes(whole), S),
        }
        comm = [dict(send) for _ in range(N)]
        if R > 1:  # each group's reduced shards, averaged across the replicas
            for r in range(N):
                comm[r]["all_reduce"] = ring("all_reduce", grad_bytes(held[r]), R)
        if layout is not None:  # the experts as data parallel spreads them (experts/)
            mine, sends = expert_held(m, layout), expert_sends(m, layout)
            for r in range(N):
                held[r].update(mine)
                for kind, nbytes in sends.items():
                    comm[r][kind] = comm[r].get(kind, 0.0) + nbytes
        biggest = max((module_bytes(b) for b in m.blocks), default=0)
        m.notes.append(
            f"sharded: params/grads/optimizer are each rank's shards; while a block computes "
            f"its parameters are gathered whole (up to {biggest / MIB:.1f} MiB more, transient, "
            "not in the figures)"
        )
        act = trace.peak_activations * m.scale
        return Ranks(held, [act] * N, comm)


DESCRIPTIONS = (ShardedDescription(),)
