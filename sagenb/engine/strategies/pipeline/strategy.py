"""Pipeline model parallel (and hybrid: data parallel across pipeline replicas).

The model is split at block boundaries into `partitions x virtual stages` stages
(partition.py); engine r holds stages r, r + P, ... of its replica (or r and 2P - 1 - r for the
V-shaped schedules, orders.py) and runs them with torch.distributed.pipelining's PipelineStage
and schedules; on gloo, GPipe and 1F1B run with every receive posted at the start of the step
(prefetch_schedule.py).

Why the gradients equal one process's: the schedule's loss for a microbatch is scaled by
1 / (microbatches x grad-accum) and gradient scaling is left off (it would also rescale the
slices already accumulated), so each optimizer step holds the gradient of the mean loss over the
replica's share of the global batch. Replicas then average (equal shares), and a weight tied
across stages gets the sum of the contributions of every stage that uses it.

Ranks are laid out replica-major: rank = replica x P + stage position, so one pipeline's
stages are neighbours (SageMaker's "cluster" placement).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from sagenb.config.job import JobError
from sagenb.engine.data.collation import (
    PROBES,
    require_one_length,
    require_shapes,
    shapes_of,
)
from sagenb.engine.data.order import eval_batches, fetch, to_device
from sagenb.engine.data.stream import readable
from sagenb.engine.model.blocks import find_blocks, tied_groups
from sagenb.engine.model.delayed import materialize, release_others
from sagenb.engine.objective import Objective, weighted
from sagenb.engine.strategies.pipeline.cuts import check_blocks, choose_cuts
from sagenb.engine.strategies.pipeline.metadata_inference import (
    keep_buffers_through_inference,
    zero_indices_through_inference,
)
from sagenb.engine.strategies.pipeline.options import (
    MULTI_STAGE,
    SPLIT_BACKWARD,
    PipelineOptions,
)
from sagenb.engine.strategies.pipeline.orders import engine_of, stages_on
from sagenb.engine.strategies.pipeline.partition import split_model
from sagenb.engine.strategies.pipeline.prefetch_schedule import PrefetchingSchedule
from sagenb.engine.strategies.pipeline.tensor_messages import (
    broadcast_ints_or_error,
    recv_tensors,
    send_tensors,
)
from sagenb.engine.workspace import Workspace
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["Pipeline"]

_MULTI_STAGE_CLASSES = {
    "interleaved": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


class Pipeline:
    counts_in_flight = False  # the global target count is reduced before the step

    def __init__(self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.pipe = pipe = PipelineOptions.of(config)
        P = pipe.partitions
        self.P, self.S, self.D = P, pipe.stages, world_size // P
        self.replica, self.position = divmod(rank, P)
        self.stage_ids = stages_on(pipe.schedule, P, pipe.chunks, self.position)
        self.pp_group, self.dp_group = self._groups()
        self.events: list[tuple[str, int, int, float, float]] = []
        self._step_started = 0.0
        self._scale = 1.0
        self._reported: list[torch.Tensor] = []
        self._cuts_reported = False

    def _groups(self) -> tuple[Any, Any]:
        """Every rank creates every group, in the same order (torch.distributed requires it)."""
        pp = dp = None
        for d in range(self.D):
            group = dist.new_group([d * self.P + s for s in range(self.P)])
            pp = group if d == self.replica else pp
        for s in range(self.P):
            group = dist.new_group([d * self.P + s for d in range(self.D)])
            dp = group if s == self.position else dp
        return pp, dp

    def _global(self, stage: int) -> int:
        return self.replica * self.P + engine_of(self.pipe.schedule, self.P, stage)

    # -- setup -----------------------------------------------------------------------------
    def setup(self, ws: Workspace) -> None:
        model = ws.model
        self.key_order = list(model.state_dict().keys())
        example = self._example(ws)
        _refuse_block_masks(self.config, example)
        self._fix_shapes(ws, example)
        starts = self._choose_starts(ws, example)
        # without a loss_fn the labels are inputs too: the last stage computes the model's loss
        inputs = ws.objective.split(example)[:2]
        stages, self.blocks = split_model(model, starts, inputs)
        self.starts = starts
        self.modules = [stages[i] for i in self.stage_ids]
        if self.config.delay_init:  # only this engine's stages get real parameters
            materialize(
                model,
                self.modules,
                seed=self.config.seed,
                device=self.device,
                checkpoint=ws.checkpoint,
            )
        else:  # free the other stages' parameters, which the cell's namespace still holds
            release_others(model, self.modules)
        self.modules = [m.to(self.device) for m in self.modules]
        for m in self.modules:
            keep_buffers_through_inference(m)
            zero_indices_through_inference(m)
        self.module = nn.ModuleList(self.modules)
        self._setup_tied(model, stages)
        self.schedule = self._schedule(ws.objective)

    def _example(self, ws: Workspace) -> Any:
        """The dataset's first samples, one microbatch of the size the schedule runs: what
        profiling times, and what torch.export traces on when torch.fx cannot trace the model
        (its shapes may be specialised to this size; export_split.py)."""
        cfg = self.config
        mb = cfg.forward_size(self.world_size)
        return fetch(ws.dataset, torch.arange(readable(ws.dataset, mb)), ws.collate_fn)

    def _fix_shapes(self, ws: Workspace, example: Any) -> None:
        """The shapes every batch must have: the first microbatch's. The stages are traced on
        it and PipelineStage sizes its messages at the first step (either front end). A
        collate_fn may pad to each batch's longest sample: a few samples collated alone tell
        before the first step (collation.py), each step's batch is checked too."""
        self._shapes = shapes_of(example)
        if ws.collate_fn is None:
            return
        for name in ("dataset", "eval_dataset"):
            data = getattr(ws, name)
            if data is not None:
                require_one_length(
                    data,
                    ws.collate_fn,
                    self._shapes,
                    strategy=self.config.strategy,
                    name=name,
                    probes=readable(data, PROBES),
                )

    def _choose_starts(self, ws: Workspace, example: Any) -> list[int]:
        """The cut points of cuts.py, the planner's too: checked on every rank, chosen
        (and measured, when the method needs it) on rank 0 only, which all ranks then use."""
        check_blocks(self.config, len(find_blocks(ws.model)))
        chosen: list[int] | Exception | None = None
        if self.rank == 0:
            try:
                chosen = choose_cuts(ws.model, self.config, example, ws.objective)
            except JobError as exc:  # e.g. the model cannot be split: every rank raises it
                chosen = exc
        # ints, or the error's text: tensors on the wire, nothing unpickled (tensor_messages.py)
        starts = broadcast_ints_or_error(chosen, src=0, device=self.device)
        if isinstance(starts, str):
            raise chosen if isinstance(chosen, JobError) else JobError(starts)
        return starts

    def _setup_tied(self, model: nn.Module, stages: list[nn.Module]) -> None:
        """Process groups over the ranks that hold each weight tied across stages.

        A stage holds a tied weight when it names it under any of its tied names (the fx
        front end keeps the model's Parameter; the export one gives each stage its own copy,
        under the name or names that stage uses). An engine may hold two such copies itself
        (a V holds the first and the last stage): their gradients are summed here first."""
        # (this engine's copies, the group of the engines that hold it or None, owner)
        self.tied: list[tuple[list[nn.Parameter], Any, bool]] = []
        held = [{n for n, _ in st.named_parameters(remove_duplicate=False)} for st in stages]
        local = {}
        for st in self.modules:
            for name, p in st.named_parameters(remove_duplicate=False):
                local[name] = p
        for names in tied_groups(model):
            holders = [s for s, have in enumerate(held) if have.intersection(names)]
            for d in range(self.D):
                ranks = sorted(
                    {d * self.P + engine_of(self.pipe.schedule, self.P, s) for s in holders}
                )
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                mine = list({id(local[n]): local[n] for n in names if n in local}.values())
                if d == self.replica and mine and (group is not None or len(mine) > 1):
                    self.tied.append((mine, group, self.rank == ranks[0]))

    def _schedule(self, objective: Objective):
        def runnable(i: int, m: nn.Module) -> nn.Module:
            m = _LaterStage(m) if i > 0 else m
            return _LastStage(m, objective) if i == self.S - 1 else m

        stages = [
            PipelineStage(
                runnable(i, m),
                i,
                self.S,
                self.device,
                group=self.pp_group,
            )
            for i, m in zip(self.stage_ids, self.modules)
        ]
        for st in stages:
            self._time(st)

        def scaled(output, target):
            # each microbatch's mean loss weighted by the targets it counts (engine/objective.py)
            loss = objective.stage_loss(output, target)
            count = objective.count(target)
            self._reported.append(weighted(loss, count))
            return loss * (count * self._scale)

        kind, M = self.pipe.schedule, self.pipe.microbatches
        if kind in MULTI_STAGE:
            cls = _MULTI_STAGE_CLASSES[kind]
            return cls(list(stages), M, loss_fn=scaled, scale_grads=False)
        if dist.get_backend(self.pp_group) == "gloo":  # receives posted ahead (see the module)
            return PrefetchingSchedule(stages[0], M, kind, loss_fn=scaled)
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        return cls(stages[0], M, loss_fn=scaled, scale_grads=False)

    def _time(self, stage: PipelineStage) -> None:
        """Record every microbatch's forward and backward (the schedule timeline)."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def timed_forward(chunk, *args, **kwargs):
            t0 = time.time()
            out = forward(chunk, *args, **kwargs)
            self.events.append(("F", stage.stage_index, chunk, t0, time.time()))
            return out

        def timed_backward(chunk, *args, **kwargs):
            t0 = time.time()
            out = backward(chunk, *args, **kwargs)
            self.events.append(("B", stage.stage_index, chunk, t0, time.time()))
            return out

        def timed_weights(chunk, *args, **kwargs):  # zero-bubble's W, after B's input gradient
            t0 = time.time()
            out = weights(chunk, *args, **kwargs)
            self.events.append(("W", stage.stage_index, chunk, t0, time.time()))
            return out

        weights = stage.backward_weight_one_chunk
        # wrapped per instance, so the timeline records what the schedule runs
        stage.forward_one_chunk = timed_forward  # type: ignore[method-assign,assignment]
        stage.backward_one_chunk = timed_backward  # type: ignore[method-assign,assignment]
        stage.backward_weight_one_chunk = timed_weights  # type: ignore[method-assign,assignment]

    # -- a step ----------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Names in the unsplit model, in the order of parameters() (the optimizer's)."""
        for name, p in self.module.named_parameters():
            yield name.split(".", 1)[1], p  # drop the ModuleList index

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {k: v for m in self.modules for k, v in m.state_dict().items()}

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        for m in self.modules:
            m.load_state_dict({k: state[k] for k in m.state_dict()})

    def local_indices(self, slice_indices: torch.Tensor) -> torch.Tensor:
        share = len(slice_indices) // self.D
        return slice_indices[self.replica * share : (self.replica + 1) * share]

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.S - 1 in self.stage_ids

    @property
    def replicas(self) -> int:
        return self.D

    @property
    def collated_parts(self) -> int:
        # each microbatch collated on its own, as the schedule will cut the batch
        return self.pipe.microbatches

    def forward_backward(
        self, batch: Any, objective: Objective, *, scale: float, sync: bool
    ) -> torch.Tensor | None:
        require_shapes(self._shapes, batch, strategy=self.config.strategy, what="this step's batch")
        args, kwargs, target = objective.split(batch)
        if not self.events:
            self._step_started = time.time()
        self._scale, self._reported = scale, []
        if not self.has_first:
            args, kwargs = (), {}
        if self.has_last:
            kwargs.update(target=target, losses=[])
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if sync:
            self._sync_grads()
        if not self.has_last:
            return None
        # loss x counted targets, microbatches summed; the schedule's first step also runs the
        # loss once on placeholder tensors to infer shapes: only the last M are the microbatches'
        return torch.stack(self._reported[-self.pipe.microbatches :]).sum()

    def _sync_grads(self) -> None:
        for copies, group, _ in self.tied:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in copies]
            for p, g in zip(copies, grads):
                p.grad = g
            for g in grads[1:]:
                grads[0].add_(g)
            if group is not None:
                dist.all_reduce(grads[0], group=group)
            for g in grads[1:]:
                g.copy_(grads[0])
        if self.D > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_group)
                    p.grad.div_(self.D)

    def clip_grad_norm(self, max_norm: float) -> float:
        # A tied weight's summed gradient lives on several ranks: count it once, on its owner.
        shared = {id(p): owner and k == 0 for ps, _, owner in self.tied for k, p in enumerate(ps)}
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        for p in self.module.parameters():
            if p.grad is not None and shared.get(id(p), True):
                squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self.pp_group)
        norm = float(squares.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in grads:
            g.mul_(coef)
        return norm

    def step_metrics(self) -> dict[str, Any]:
        """Busy and idle time of this engine's stages in the last step, and its timeline:
        [F, B or W, stage, microbatch, start, end] in seconds after `timeline_t0(unix s)` (wall
        clock, so the engines' timelines line up in one chart). The first step's also has
        the "cuts" the pipeline uses (the blocks where stages 1, 2, ... begin, as --cuts spells
        them), to compare with the planner's."""
        events, self.events = self.events, []
        first = {} if self._cuts_reported else {keys.CUTS: list(self.starts[1:])}
        self._cuts_reported = True
        if not events:
            return first
        t0 = self._step_started
        busy_f = sum(e[4] - e[3] for e in events if e[0] == "F")
        busy_b = sum(e[4] - e[3] for e in events if e[0] in "BW")  # W: zero-bubble's weights
        span = max(e[4] for e in events) - t0
        return {
            keys.STAGES: self.stage_ids,
            keys.BUSY_FORWARD: busy_f,
            keys.BUSY_BACKWARD: busy_b,
            keys.IDLE: max(0.0, span - busy_f - busy_b),
            keys.TIMELINE: [
                [k, s, c, round(a - t0, 6), round(b - t0, 6)] for k, s, c, a, b in events
            ],
            keys.TIMELINE_T0: t0,
            **first,
        }

    # -- results ---------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """This engine's part of the full state_dict (replica 0 only); the notebook merges."""
        if self.replica != 0:
            return None
        out = {}
        for m in self.modules:
            out.update({k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()})
        return out

    @torch.no_grad()
    def evaluate(self, dataset: Any, objective: Objective, batch_size: int) -> float:
        """Forward only, stage by stage with point-to-point sends, in chunks of the training
        microbatch's size: stages split through torch.export are specialised to it (see
        _eval_chunks for the last chunk)."""
        size = max(1, self.config.forward_size(self.world_size))
        total = torch.zeros(2, dtype=torch.float64)
        for m in self.modules:
            m.eval()
        for idx in eval_batches(len(dataset), size, parts=self.D, part=self.replica):
            for chunk, sign in _eval_chunks(idx, size):
                batch = fetch(dataset, chunk, objective.collate_fn)
                require_shapes(
                    self._shapes, batch, strategy=self.config.strategy, what="an eval_dataset chunk"
                )
                loss, count = self._eval_forward(to_device(batch, self.device), objective)
                total += sign * torch.tensor([loss, count], dtype=torch.float64)
        for m in self.modules:
            m.train()
        dist.all_reduce(total)
        return float(total[0] / total[1])

    def _eval_forward(self, batch: Any, objective: Objective) -> tuple[float, float]:
        """(loss x counted targets, counted targets) of one chunk on the last stage; zeros on
        the other ranks, which send what their stages make."""
        args, kwargs, target = objective.split(batch)
        value = self._forward_stages(args, kwargs)
        if value is None:
            return 0.0, 0.0
        count = objective.count(target)
        return float(weighted(objective.loss(value, target), count)), float(count)

    def _forward_stages(self, args: tuple, kwargs: dict) -> Any:
        """This engine's stages forward, in order, receiving and sending between engines; the
        last stage's output where this engine holds it, else None."""
        value: Any = args
        for i in self.stage_ids:
            if i > 0:  # the model's keyword inputs are the first stage's only
                kwargs = {}
            if i > 0 and i - 1 not in self.stage_ids:  # else the turn of a V, on this engine
                value = recv_tensors(self._global(i - 1), self.device)  # tensors only
            module = self.modules[self.stage_ids.index(i)]
            value = module(*value, **kwargs) if isinstance(value, tuple) else module(value)
            if i == self.S - 1:
                return value
            if i + 1 not in self.stage_ids:
                send_tensors(value, self._global(i + 1), self.device)
        return None

    def next_tokens(self, ids: torch.Tensor, objective: Objective) -> torch.Tensor:
        """Each row's greedy next token, on every rank of this pipeline: the stages run forward
        on `ids` right-padded to the training microbatch's shape, for which they are compiled
        (a causal LM's logits at the last real position do not see the padding), and the last
        stage's arg max is sent to the pipeline's other engines."""
        shapes = list(self._shapes.values())
        if objective.loss_fn is None or objective.dict_samples or len(shapes[0]) != 1:
            raise JobError(
                "generate through a pipeline takes a cell whose dataset holds (token ids, "
                "targets) and whose loss_fn reads the model's logits: here the last stage "
                "computes the model's own loss, not logits. Use smp_result.model() instead"
            )
        rows, length = self.config.forward_size(self.world_size), shapes[0][0]
        if ids.shape[1] > length:
            raise JobError(
                f"generate through a pipeline: {ids.shape[1]} tokens are more than the "
                f"{length} its stages are compiled for (the training samples' length)"
            )
        last = self.S - 1
        engines = sorted({self._global(i) for i in range(self.S)} - {self._global(last)})
        picked = []
        for part in ids.split(rows):
            padded = torch.zeros((rows, length), dtype=ids.dtype, device=self.device)
            padded[: len(part), : ids.shape[1]] = part
            logits = self._forward_stages((padded,), {})
            if logits is not None:
                tokens = logits[: len(part), ids.shape[1] - 1].argmax(-1).contiguous()
                for dst in engines:
                    send_tensors(tokens, dst, self.device)
            else:
                tokens = recv_tensors(self._global(last), self.device)
            picked.append(tokens)
        return torch.cat(picked)


def _eval_chunks(idx: torch.Tensor, size: int) -> list[tuple[torch.Tensor, float]]:
    """The chunks an eval batch of up to `size` indices runs as, each with its sign in the sum.

    A short last batch is filled up with repeats of its last sample, then those repeats are
    taken out again: a chunk of `size` copies of that sample counts its loss x count `size`
    times over, so subtracting (size - real) / size of it leaves the real samples' sum. It is
    exact for any loss that is a mean over counted targets (the contract's), whether computed
    from the logits by a loss_fn or inside the last stage by the model, whose output holds
    no per-sample loss to slice."""
    real = len(idx)
    if real == size:
        return [(idx, 1.0)]
    filled = torch.cat([idx, idx[-1:].expand(size - real)])
    return [(filled, 1.0), (idx[-1:].expand(size), -(size - real) / size)]


class _LaterStage(nn.Module):
    """A stage after the first as the schedule runs it: torch hands the step's keyword inputs
    to every stage of an engine ("kwargs can be passed to all stages", PipelineStage's
    forward_one_chunk), while only the first takes the model's; the others take what the stage
    before them made (the split passes on whatever later stages need, an attention mask too).
    An engine that holds the first stage and others (interleaved, a V) drops them here."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.stage(*args)


class _LastStage(nn.Module):
    """The last stage as the schedule runs it: a stage's output must be tensors, so a
    ModelOutput or dict (a transformers model given as it is) is reduced to its logits for the
    cell's loss_fn, or to the model's own loss (engine/objective.py, stage_output)."""

    def __init__(self, stage: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.stage = stage
        self.objective = objective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.objective.stage_output(self.stage(*args, **kwargs))


def _refuse_block_masks(config: EngineConfig, example: Any) -> None:
    """A JobError before the first step where a zero-bubble schedule would take a FlexAttention
    BlockMask as a stage input: the schedules that split each backward in two compute the
    input's gradient for every tensor a stage takes, and a BlockMask is a bundle of index
    tensors, not an activation; torchtitan refuses the pair too (its pipeline parallel turns
    zero-bubble schedules away for FlexAttention models)."""
    pipe = PipelineOptions.of(config)
    if pipe.schedule not in SPLIT_BACKWARD:
        return
    from torch.nn.attention.flex_attention import BlockMask

    items = example.items() if isinstance(example, dict) else enumerate(_as_tuple(example))
    for key, value in items:
        if isinstance(value, BlockMask):
            where = f"{key!r}" if isinstance(key, str) else f"item {key}"
            raise JobError(
                f"--schedule {pipe.schedule}: the batch's {where} is a FlexAttention "
                "BlockMask (torch.nn.attention.flex_attention.BlockMask), which the "
                "zero-bubble schedules cannot take as a stage input (they split each "
                "backward into the input's gradient and the weights'; torchtitan refuses "
                "the pair too): use a schedule that keeps each backward whole (gpipe, 1f1b, "
                "interleaved, looped-bfs), or build the mask inside the model"
            )


def _as_tuple(example: Any) -> tuple[Any, ...]:
    return tuple(example) if isinstance(example, list | tuple) else (example,)
