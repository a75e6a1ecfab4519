"""The training loop every strategy shares: the contract of docs/contract.md, step by step.

An optimizer step takes one global batch of the fixed sample order, cut into `grad_accum`
slices; each slice's loss is weighted by its share of the targets the global batch counts
(1/grad_accum when every slice counts as many), so the accumulated gradient is that of the
mean over the whole global batch. Then: clip (global norm), optimizer, scheduler, metrics.
With --precision fp16 the loss is also multiplied by the loss scaler's scale, and the
gradients divided by it before clipping; a step whose gradients overflowed is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from sagenb.engine import user_optimizer
from sagenb.engine.checkpoint import distributed as checkpoint
from sagenb.engine.checkpoint import resume
from sagenb.engine.data import agreement
from sagenb.engine.data.loader import batches_of
from sagenb.engine.data.order import Step, plan_steps
from sagenb.engine.data.stream import StreamSource, stream_steps
from sagenb.engine.memory import MemoryMeter
from sagenb.engine.objective import batch_size_of, model_inputs
from sagenb.engine.precision import LossScaler, autocast
from sagenb.engine.strategies import Strategy
from sagenb.engine.workspace import Workspace
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["Segment", "begin", "train_loop", "make_optimizer", "default_optimizer"]


class _Saved(TypedDict):
    """What checkpoint.save writes and checkpoint.load restores, as keyword arguments."""

    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rank: int


def make_optimizer(
    ws: Workspace, strategy: Strategy, lr: float
) -> tuple[torch.optim.Optimizer, list[str]]:
    """The cell's make_optimizer over the strategy's parameters, checked (and mapped onto them
    where it holds the cell's model's: engine/user_optimizer.py), with what to say of it; else
    the default AdamW."""
    params = list(strategy.parameters())
    if ws.make_optimizer is None:
        return default_optimizer(params, lr), []
    known = {i: name for i, (name, _) in ws.cell_parameters.items()}
    known.update({id(p): name for name, p in ws.model.named_parameters()})  # as it is now
    return user_optimizer.checked(ws.make_optimizer(params), strategy.named_parameters(), known)


#: the devices torch 2.13's fused AdamW runs on that an engine trains on
_FUSED_ON = ("cpu", "cuda")


def default_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW at `lr`, for a cell without `make_optimizer`: torch's fused kernel (fused=True)
    where every parameter is on one kind of device it supports, else torch's default.

    Fused, a step is one pass over each parameter and its two moments; torch's default on
    the CPU (foreach only on CUDA) runs each of AdamW's ops over the whole tensor in turn. On
    one thread, a step over a pipeline stage's 4.2M parameters (4 Linear(1024, 1024)) took
    2.4 ms against 13.4 ms, and that step stands between a pipeline's steps, where every
    other stage waits for the first (docs/performance.md). The update is the same up to
    rounding (2.4e-7 apart after 50 steps on a 256 x 256 weight); the state is the same
    tensors (step, exp_avg, exp_avg_sq), so checkpoints load either way.

    DTensors (sharded and tensor-parallel parameters) take it when every parameter is one on
    the same mesh: the fused op runs over all of them at once, and refuses plain tensors
    beside DTensors (expert parallel's experts beside FSDP's shards) or two meshes."""
    kinds = {p.device.type for p in params}
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    plain = any(not isinstance(p, DTensor) for p in params)
    one_mesh = not meshes or (len(meshes) == 1 and not plain)
    fused = len(kinds) == 1 and kinds <= set(_FUSED_ON) and one_mesh
    return torch.optim.AdamW(params, lr=lr, fused=fused or None)


@dataclass
class Segment:
    """What the loop holds between its steps, kept after a run for --continue
    (engine/live/kept.py): the optimizer and scheduler over the strategy's parameters,
    fp16's loss scaler, the memory meter, the checkpoints this run wrote, and the last step
    done (the position in the sample order: the plan is a function of it)."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: LossScaler | None
    meter: MemoryMeter
    objects: _Saved
    options: str
    written: list[str]
    last: int

    def go_on(self, config: EngineConfig, previous: EngineConfig) -> None:
        """The next segment's --lr: every group's lr (and a scheduler's base) scaled by the
        new --lr over the previous one, so the default AdamW takes --lr exactly and a cell's
        own groups keep their ratios."""
        if config.lr == previous.lr or not previous.lr:
            return
        factor = config.lr / previous.lr
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]


def begin(
    ws: Workspace, strategy: Strategy, config: EngineConfig, *, device: torch.device, rank: int
) -> tuple[Segment, list[str]]:
    """A run's optimizer, scheduler, scaler and meter, resumed from --checkpoint-dir with
    --resume; and what to say of them with the first step (the optimizer's mapping, the
    resume's notes)."""
    optimizer, mapped = make_optimizer(ws, strategy, config.lr)
    scheduler = ws.make_scheduler(optimizer) if ws.make_scheduler is not None else None
    objects = _Saved(strategy=strategy, optimizer=optimizer, scheduler=scheduler, rank=rank)
    start, notes, written = _resume(config, objects)
    base_lr = None if ws.make_optimizer is not None else _base_lr(optimizer)
    return Segment(
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=LossScaler(device=device) if config.precision == "fp16" else None,
        meter=MemoryMeter(strategy.module, optimizer, device, offload=config.offload_activations),
        objects=objects,
        options=resume.record(config, world_size=_world_size(), lr=base_lr),
        written=written,
        last=start,
    ), mapped + notes


def train_loop(
    ws: Workspace,
    strategy: Strategy,
    config: EngineConfig,
    *,
    device: torch.device,
    publish: Callable[[dict[str, Any]], None],
    rank: int = 0,
    should_stop: Callable[[int], bool] = lambda step: False,
    segment: Segment | None = None,
) -> tuple[int, str | None, Segment]:
    """Train to the end of the plan, publishing one metrics dict per step, or until
    `should_stop(step)` after a step, or until a checkpoint cannot be written. `segment`: the
    state a previous run of the same cell left (--continue), gone on from after its last
    step; else a new one (`begin`). Returns the number of the last step done, why its
    checkpoint could not be written, if it could not (checkpoint.save; the run then fails
    keeping the parameters it trained, run/training_run.py), and the segment."""
    if segment is None:
        segment, notes = begin(ws, strategy, config, device=device, rank=rank)
        if notes and rank == 0:  # with the first step's metrics, into the run's warnings
            publish = _first_step_with_warnings(notes, publish)
    plan = _plan(ws, config, segment.last)
    last, unsaved = segment.last, None
    optimizer, scheduler, meter, scaler = (
        segment.optimizer, segment.scheduler, segment.meter, segment.scaler
    )  # fmt: skip
    with _loading(ws, strategy, config, plan, device, rank) as steps:
        for data in steps:
            metrics = _step(ws, strategy, config, data, optimizer, scheduler, meter, device, scaler)
            last, total = data.step.number, data.step.total
            segment.last = last
            stop = last != total and should_stop(last)  # after the last step, none to skip
            every = config.checkpoint_every
            if config.checkpoint_dir and (stop or last == total or (every and last % every == 0)):
                unsaved = _save(
                    config.checkpoint_dir, last, segment.options, segment.written,
                    segment.objects, metrics,
                )  # fmt: skip
            publish(metrics)
            if stop or unsaved is not None:
                break
    return last, unsaved, segment


def _loading(
    ws: Workspace,
    strategy: Strategy,
    config: EngineConfig,
    plan: Iterator[Step],
    device: torch.device,
    rank: int,
) -> Any:
    """The steps' batches, loaded as the plan says (--data-workers: by worker processes,
    which end with the `with` block that holds this)."""
    return batches_of(
        ws.dataset,
        strategy,
        plan,
        grad_accum=config.grad_accum,
        workers=config.data_workers,
        device=device,
        seed=config.seed,
        rank=rank,
        collate_fn=ws.collate_fn,
        parts=strategy.collated_parts,
    )


def _save(
    directory: str, step: int, options: str, written: list[str], objects: _Saved, metrics: dict
) -> str | None:
    """checkpoint.save of `step`, keeping this run's `written` ones (and adding it to them),
    timed into `metrics` for the step that wrote it: what choosing --checkpoint-every weighs
    (Young's and Daly's intervals, docs/reliability.md)."""
    began = time.perf_counter()
    unsaved = checkpoint.save(directory, step, options=options, kept=written, **objects)
    if unsaved is None:
        metrics[keys.CHECKPOINT_WRITE] = time.perf_counter() - began
        written.append(checkpoint.step_name(step))
    return unsaved


def _plan(ws: Workspace, config: EngineConfig, start: int) -> Iterator[Step]:
    """The run's steps after step `start`: the contract's shuffled order of a map-style dataset,
    or a stream read in order (data/stream.py), its first batches the same on every rank
    (data/agreement.py)."""
    b, epochs, steps = config.batch_size, config.epochs, config.steps
    if isinstance(ws.dataset, StreamSource):
        plan = stream_steps(ws.dataset, batch_size=b, epochs=epochs, steps=steps, start_after=start)
        return agreement.checked(plan, ws.dataset)
    n = len(ws.dataset)
    return plan_steps(
        n, batch_size=b, epochs=epochs, steps=steps, seed=config.seed, start_after=start
    )


def _resume(config: EngineConfig, objects: _Saved) -> tuple[int, list[str], list[str]]:
    """The step to continue after (with --resume, the newest readable checkpoint's; else 0),
    the notes on what resuming skipped or changed (checkpoint/resume.py), and the checkpoints
    that are this run's so far (the one it resumed from): those its pruning keeps. Without
    --resume, checkpoints of another run in --checkpoint-dir are refused before any step."""
    if not config.resume:
        if config.checkpoint_dir:
            checkpoint.check_fresh(
                config.checkpoint_dir, strategy=objects["strategy"], config=config
            )
        return 0, [], []
    assert config.checkpoint_dir, "the config refuses --resume without --checkpoint-dir"
    start, notes, name = checkpoint.load(config.checkpoint_dir, config=config, **objects)
    return start, notes, [name]


def _first_step_with_warnings(
    notes: list[str], publish: Callable[[dict[str, Any]], None]
) -> Callable[[dict[str, Any]], None]:
    pending = list(notes)

    def send(metrics: dict[str, Any]) -> None:
        nonlocal pending
        if pending:
            metrics = {**metrics, keys.WARNINGS: [*metrics.get(keys.WARNINGS, ()), *pending]}
            pending = []
        publish(metrics)

    return send


def _base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr the optimizer was built with (a scheduler keeps it as "initial_lr"); after a
    resume, the checkpoint's, which the restored state goes on with."""
    group = optimizer.param_groups[0]
    return float(group.get("initial_lr", group["lr"]))


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _step(ws, strategy, config, data, optimizer, scheduler, meter, device, scaler) -> dict:
    """One optimizer step; returns its metrics. Its time counts the wait for its batches
    (their loading, without --data-workers), as when the loop loaded them itself."""
    started = time.perf_counter() - data.wait_s
    step = data.step
    total = step.total
    meter.start_step(step.number, total)
    loss_scale = scaler.scale if scaler is not None else 1.0
    with autocast(config.precision, device):
        loss, counted, samples, tokens = _accumulate(
            ws,
            strategy,
            meter,
            data.batches,
            loss_scale,
            exact_first=scaler is not None,
            known=_counted_here(ws, step),
        )
    metrics: dict[str, Any] = {
        keys.STEP: step.number,
        keys.TOTAL_STEPS: total,
        keys.EPOCH: step.epoch,
    }
    if loss is not None:
        metrics[keys.LOSS] = loss  # the mean over this engine's counted targets
        metrics[keys.COUNTED] = counted
    _update(strategy, config, optimizer, scheduler, scaler, metrics)
    metrics.update(meter.snapshot())
    optimizer.zero_grad(set_to_none=True)
    if _eval_due(ws, config, step.number, total):
        metrics[keys.EVAL_LOSS] = strategy.evaluate(
            ws.eval_dataset, ws.objective, config.batch_size
        )
    elapsed = time.perf_counter() - started
    metrics[keys.STEP_TIME] = elapsed
    metrics[keys.DATA_WAIT] = data.wait_s
    metrics[keys.SAMPLES] = samples
    if tokens:
        metrics[keys.TOKENS] = tokens
    metrics[keys.THROUGHPUT] = samples / elapsed
    metrics[keys.TIME] = time.time()  # when the step ended, for rates across steps
    metrics.update(strategy.step_metrics())
    return metrics


def _update(strategy, config, optimizer, scheduler, scaler, metrics: dict[str, Any]) -> None:
    """The optimizer's step on the accumulated gradients (unscaled under fp16, and skipped
    where they are not finite; clipped with --clip-grad-norm), then the scheduler's."""
    finite = True
    if scaler is not None:
        metrics[keys.LOSS_SCALE] = scaler.scale
        finite = scaler.unscale(strategy.parameters())
        metrics[keys.SKIPPED_STEP] = int(not finite)
    if config.clip_grad_norm is not None and finite:
        metrics[keys.GRAD_NORM] = strategy.clip_grad_norm(config.clip_grad_norm)
    metrics[keys.LR] = optimizer.param_groups[0]["lr"]
    if finite:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()


def _counted_here(ws: Workspace, step: Step) -> torch.Tensor | None:
    """The targets the whole global batch counts, counted on this engine without a
    collective, where that costs less than one: a TensorDataset without a collate_fn holds
    every sample's target, and the step's indices name the whole global batch (each of its
    samples loaded by one replica: the config's batch split), so indexing its targets costs
    about what loading this engine's share did. None elsewhere (a dataset whose other samples
    this engine would have to load, a stream, dict samples)."""
    dataset, objective = ws.dataset, ws.objective
    if (
        ws.collate_fn is not None
        or type(dataset) is not TensorDataset
        or len(dataset.tensors) != 2
        or objective.dict_samples
    ):
        return None
    target = dataset.tensors[1]
    if not objective.counts_vary(target):
        return None  # the sample count: every rank knows it
    return objective.count(target[step.indices])


def _accumulate(ws, strategy, meter, batches, loss_scale, *, exact_first=False, known=None):
    """Forward and backward over the grad_accum slices of one global batch (the backward
    runs under the forward's autocast too: pipeline schedules interleave the two, and
    autocast leaves backward's dtypes to those of the forward ops).

    Each slice's loss enters the gradient weighted by the targets it counts over the targets
    the whole global batch counts (objective.py), times the replicas the gradients are
    then averaged over: so the step's gradient is that of the loss one process would compute
    over the global batch, whatever each slice holds. Returns the loss (this engine's share),
    its counted targets, samples and tokens. `exact_first`: the global count is needed before
    the first backward (fp16's loss scale: see _GlobalCount). `known`: the global batch's
    count where this engine counted it itself (_counted_here)."""
    objective = ws.objective
    counts = [objective.count(objective.target(b), b) for b in batches]
    samples = sum(batch_size_of(b) for b in batches)
    total = _GlobalCount(
        torch.stack(counts).sum(),
        strategy,
        varies=objective.counts_vary(objective.target(batches[0])),
        in_flight=strategy.counts_in_flight and not exact_first and dist.is_initialized(),
        samples=samples,
        known=known,
    )
    scale = loss_scale * strategy.replicas / total.assumed
    sums = []
    tokens = 0
    for k, batch in enumerate(batches):
        with meter.track():
            part = strategy.forward_backward(
                batch, objective, scale=scale, sync=k == len(batches) - 1
            )
        if part is not None:
            sums.append(part)
        inputs = model_inputs(batch)
        if torch.is_tensor(inputs) and not inputs.is_floating_point():
            tokens += inputs.numel()  # token ids: count them for tokens/s
    total.settle(strategy.parameters())
    if not sums:
        return None, None, samples, tokens
    # one host sync for the loss per step, not per slice
    return float(torch.stack(sums).sum()) / max(total.local, 1.0), total.local, samples, tokens


class _GlobalCount:
    """The targets the whole global batch counts, which every piece's loss is weighted over.

    Where a piece's count is its sample count every rank knows the total: this engine's count
    times the replicas. Integer targets (which may hold -100) are summed across the ranks,
    each replica's share counted once (every engine of a replica loads the same samples).

    That all-reduce, blocking before the first forward, left data parallel at 0.93x a torchrun
    DDP script on integer class targets (issue 31, 2 cores): a second point per step where
    the ranks wait for each other. With `in_flight` (a strategy's counts_in_flight: DDP, whose
    reduced gradients are whole tensors, every rank loading an equal share) it is started here
    and the step weighs its pieces as if the global batch counted one target a sample
    (`assumed`, the same on every rank: exact for a classifier's labels without -100). After
    the last backward, whose gradient all-reduce has come after the count's, `settle` reads
    the sum and, when it differs, rescales the gradients by assumed / actual: exact up to
    rounding, as every gradient is linear in the loss's weight.

    Where the engine can count the whole global batch's targets itself (`known`: a
    TensorDataset's labels, loop._counted_here), no collective is needed at all: starting the
    in-flight one and settling it took ~1.1 ms of a 20-30 ms step under cProfile, on the
    integer-class job of benchmarks/against_peers.py."""

    def __init__(
        self,
        counted: torch.Tensor,
        strategy: Any,
        *,
        varies: bool,
        in_flight: bool,
        samples: int,
        known: torch.Tensor | None = None,
    ) -> None:
        self.local = float(counted)
        self._replicas, self._work = strategy.replicas, None
        self.assumed = self.local * self._replicas
        if known is not None:
            self.assumed = float(known)
            return
        if not varies:
            return
        self._everywhere = counted.to(torch.int64).clone()
        if in_flight:
            self._work = dist.all_reduce(self._everywhere, async_op=True)
            self.assumed = float(samples * self._replicas)
            return
        dist.all_reduce(self._everywhere)
        self.assumed = self._actual()

    def _actual(self) -> float:
        return float(self._everywhere) * self._replicas / dist.get_world_size()

    def settle(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Rescale the gradients to the actual global count, if the step assumed another."""
        if self._work is None:
            return
        self._work.wait()
        actual = self._actual()
        if actual and actual != self.assumed:  # no target counted at all: every gradient is 0
            factor = self.assumed / actual
            for p in parameters:  # one op a tensor: torch's foreach ops are private names
                if p.grad is not None:
                    p.grad.mul_(factor)


def _eval_due(ws: Workspace, config: EngineConfig, step: int, total: int | None) -> bool:
    if ws.eval_dataset is None:
        return False
    if config.eval_every:
        return step % config.eval_every == 0 or step == total
    return step == total
