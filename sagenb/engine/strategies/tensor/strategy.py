"""Tensor parallel: single Linear layers split across T engines, data parallel across the rest.

The engines form groups of T (--tensor-parallel): within a group every engine sees the same
samples and holds 1/T of each split layer. The plan (plan.py) is the cell's `tp_plan`, else
the plan a transformers model ships plus one derived from the dataflow of the rest (torch.fx,
and one forward on the first sample, recorded before any split; peft's LoRA layers split with
the layers they wrap); it is checked against the layers' shapes, and after
`parallelize_module` has turned those weights into DTensors and inserted the all-reduces
Megatron-LM needs, by a trial forward on one sample, so a plan that cannot work stops the job
naming the layer before the first step.
With more engines than T, the groups are data-parallel replicas: each takes its share of the
global batch and their gradients are averaged, as DDP would, after the last slice.
Ranks are laid out group-major (rank = replica * T + position), so a group's engines are
neighbours: on a GPU machine the chatty tensor-parallel all-reduces stay within a node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from sagenb.config.errors import ConfigError
from sagenb.config.job import JobError
from sagenb.config.spec import Option
from sagenb.engine.model.delayed import materialize
from sagenb.engine.model.pretrained import load_local
from sagenb.engine.objective import Objective, piece_loss
from sagenb.engine.strategies import dtensors
from sagenb.engine.strategies.description import (
    DEFAULT_ENGINES,
    Description,
    plural,
    require_divides,
)
from sagenb.engine.strategies.split_params import SplitParameters
from sagenb.engine.strategies.tensor.attribution import TensorAttribution
from sagenb.engine.strategies.tensor.check import example, trial_forward
from sagenb.engine.strategies.tensor.plan import plan_for, split_heads
from sagenb.engine.workspace import Workspace

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["DESCRIPTIONS", "TensorParallel"]


class TensorParallel(SplitParameters):
    counts_in_flight = False  # the global target count is reduced before the step

    def __init__(self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device):
        super().__init__(rank=rank, world_size=world_size, device=device, seed=config.seed)
        self.T = config.option("tensor_parallel") or world_size
        self.D = world_size // self.T
        self.replica = rank // self.T

    def setup(self, ws: Workspace) -> None:
        model = ws.model
        self.key_order = list(model.state_dict().keys())
        # --delay-init with a checkpoint: its parameters stay meta until split, then each
        # engine reads its slices (without one, `defer` leaves nothing meta)
        if any(p.is_meta for p in model.parameters()):
            materialize(
                model,
                [model],
                seed=self.seed,
                device=self.device,
                checkpoint=ws.checkpoint,
                defer=True,
            )
        deferred = any(p.is_meta for p in model.parameters())
        mesh = init_device_mesh(self.device.type, (self.D, self.T), mesh_dim_names=("dp", "tp"))
        if not deferred:
            model.to(self.device)
        # meta parameters cannot run the recorded forward: the plan then comes from torch.fx,
        # the layers' names and a shipped plan
        run = None if deferred else example(model, ws.dataset, ws.objective, self.device)
        plan = plan_for(model, self.T, ws.tp_plan, example=run)
        self.notes = plan.notes
        split_heads(model, plan.layers, self.T, skip=plan.shipped_roots)
        try:
            self.module = parallelize_module(model, mesh["tp"], plan.styles)
        except NotImplementedError as exc:  # a torch style on a layer kind it cannot split
            raise JobError(f"--strategy tensor: {plan.source} cannot be applied: {exc}") from exc
        if deferred and ws.checkpoint is not None:
            load_local(self.module, ws.checkpoint, device=self.device)
        trial_forward(self.module, ws.dataset, ws.objective, self.device)
        self._dp_group = mesh["dp"].get_group() if self.D > 1 else None

    def local_indices(self, slice_indices: torch.Tensor) -> torch.Tensor:
        share = len(slice_indices) // self.D
        return slice_indices[self.replica * share : (self.replica + 1) * share]

    @property
    def replicas(self) -> int:
        return self.D

    def forward_backward(
        self, batch: Any, objective: Objective, *, scale: float, sync: bool
    ) -> torch.Tensor | None:
        loss = piece_loss(objective, self.module, batch, scale)
        if sync and self._dp_group is not None:
            self._average_across_replicas()
        # a group's engines all compute the same loss: one of them reports it for the replica
        return loss if self.rank % self.T == 0 else None

    def _average_across_replicas(self) -> None:
        grads = [dtensors.local(p.grad) for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce, not one per tensor
        dist.all_reduce(flat, group=self._dp_group)
        flat.div_(self.D)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class TensorDescription(Description):
    name = "tensor"
    summary = "tensor parallel: Linear layers split across --tensor-parallel engines"
    menu_order = 40
    options = (
        Option(
            "tensor_parallel",
            "parallelism",
            None,
            "engines each Linear layer is split across (default: every engine); data parallel "
            "across the rest",
            type=int,
            shown="all engines",
        ),
    )

    def attribution(self) -> TensorAttribution:
        return TensorAttribution()

    def check(self, config: EngineConfig) -> None:
        tp = config.option("tensor_parallel")
        if tp is None:
            return
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
            raise ConfigError("tensor_parallel", tp, "must be an integer >= 2")
        groups = (
            "the engines form groups of --tensor-parallel, with data parallel across the groups"
        )
        require_divides("tensor_parallel", tp, config.engines, groups)

    def engines_to_start(self, config: EngineConfig) -> int:
        return config.option("tensor_parallel") or DEFAULT_ENGINES

    def replicas(self, config: EngineConfig, engines: int) -> int:
        return engines // (config.option("tensor_parallel") or engines)

    def layout(self, config: EngineConfig, engines: int) -> str:
        replicas = self.replicas(config, engines)
        return f"tensor: {engines // replicas}-way layer splits x {plural(replicas, 'replica')}"

    def build(
        self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device
    ) -> TensorParallel:
        return TensorParallel(config, rank=rank, world_size=world_size, device=device)


DESCRIPTIONS = (TensorDescription(),)
