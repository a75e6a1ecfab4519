"""What each rank of a run would hold and compute, found in one process without engines and
without allocating the model (sagenb issue 16).

The cell runs under torch's FakeTensorMode (footprint_trace.py): its model, dataset and
optimizer state are tensors with shapes and no storage, so a 1-billion-parameter GPT costs the
memory of its metadata. One microbatch-shaped example goes through forward and backward,
counted for FLOPs and saved activations as the engines count them; the bytes are then
attributed to ranks by the strategy itself, with the functions its training uses: its
description's `attribution()` (engine/strategies/attribution.py says what it is asked):

- data: every rank holds it all (strategies/data_parallel.py);
- sharded: FSDP2's dim-0 shards, gathered block by block (strategies/sharded.py);
- tensor: the plan training applies, split weights and activations divided by T
  (strategies/tensor/attribution.py);
- model / hybrid: the cuts training chooses, each rank its stages and the microbatches in
  flight (strategies/pipeline/attribution.py).

Each also counts the bytes its ranks send per optimizer step, by collective kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sagenb.config import cell_module
from sagenb.config.errors import ConfigError
from sagenb.config.job import Job, JobError
from sagenb.config.options import EngineConfig
from sagenb.engine.data.order import fetch
from sagenb.engine.data.stream import readable
from sagenb.engine.loop import default_optimizer
from sagenb.engine.model.blocks import find_blocks
from sagenb.engine.model.kv_cache import cache_off
from sagenb.engine.model.recompute import checkpoint_blocks
from sagenb.engine.objective import batch_size_of, model_inputs
from sagenb.engine.precision import autocast
from sagenb.engine.strategies import describe
from sagenb.engine.strategies import names as strategy_names
from sagenb.engine.strategies.attribution import (
    MIB,
    Attribution,
    FakeModel,
    Ranks,
    Trace,
    grad_bytes,
)
from sagenb.engine.torch_private import FakeTensor, FakeTensorMode, unset_fake_temporarily
from sagenb.engine.workspace import build_workspace
from sagenb.metrics import keys
from sagenb.sizing.footprint_trace import GroupedMatmulAnyDtype, optimizer_state, trace_step

__all__ = ["Footprint", "footprint"]


@dataclass(frozen=True)
class Footprint:
    """One run's memory per rank and work per optimizer step, as estimated."""

    world_size: int
    #: one dict per rank, keys sagenb.metrics.keys.MEMORY_PARAMS/GRADS/OPTIMIZER/ACTIVATIONS, MiB
    ranks: list[dict[str, float]]
    #: forward + backward (+ the recompute of --activation-checkpointing) of one optimizer
    #: step over the whole global batch, all ranks together
    flops_per_step: float
    #: per rank: bytes this rank sends per optimizer step, by collective kind
    #: ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    comm_bytes_per_step: list[dict[str, float]]
    #: parameters of the whole model
    params: int
    #: tokens in one global batch, for token-id inputs (else None)
    tokens_per_step: int | None
    #: the assumptions made, in words
    notes: list[str] = field(default_factory=list)
    #: samples in the cell's dataset (the steps of an epoch follow from it), None if unsized
    samples: int | None = None


def _samples(dataset: Any) -> int | None:
    """The dataset's size; None for a stream (engine/data/stream.py): its steps are --steps."""
    try:
        return len(dataset)
    except TypeError:
        return None


def footprint(job: Any, config: EngineConfig, world_size: int) -> Footprint:
    """The footprint of training `job` (a sagenb.config.job.Job or cell source) with `config` on
    `world_size` ranks. Raises ConfigError (naming --engines) for a world size the strategy
    cannot use, JobError for a cell that cannot be built or split."""
    job = Job.of(job)
    config = _at(config.for_engines(), world_size)
    attribute = _attribution(config)
    # real tensors may meet fake ones: the example's indices are real (see _build)
    with (
        cell_module.scope(),  # the cell's module (config/cell_module.py) lasts the estimate
        FakeTensorMode(allow_non_fake_inputs=True),
        GroupedMatmulAnyDtype(),
        _unchanged_conversions_pass(),
        _fake_copies(),
    ):
        m = _build(job, config, world_size)
        split, layout = attribute.prepare(m)
        trace = _trace(m, split)
        ranks = attribute.ranks(m, trace, layout)
    return _assemble(m, trace, ranks)


def _at(config: EngineConfig, world: int) -> EngineConfig:
    """`config` on `world` ranks, validated as a run on that many engines would be."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError("engines", world, "must be a whole number of engines, at least 1")
    try:
        return config.with_engines(world)
    except ConfigError as exc:
        if exc.args and "--engines" in str(exc):
            raise
        raise ConfigError(
            "engines", world, f"cannot run --strategy {config.strategy} here: {exc}"
        ) from None


@contextmanager
def _unchanged_conversions_pass() -> Iterator[None]:
    """`Module.to(...)` that changes no tensor returns the module, as it does outside fake mode.

    Under FakeTensorMode, torch 2.13's `Module._apply` swaps every fake parameter for its
    converted copy (torch.utils.swap_tensors), and the swap fails on the weakrefs the mode keeps
    of its tensors: "_apply(): Couldn't swap Linear.weight", even when the conversion is a
    no-op. peft calls `.to(device_of_base, dtype=...)` on each adapter it adds, so every cell
    with a LoRA model failed to estimate. A conversion that does change a tensor still raises."""
    original = nn.Module.to

    def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        try:
            return original(module, *args, **kwargs)
        except RuntimeError as exc:
            if "swap" in str(exc) and all(
                _unchanged(t, args, kwargs) for t in [*module.parameters(), *module.buffers()]
            ):
                return module
            raise

    nn.Module.to = to  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextmanager
def _fake_copies() -> Iterator[None]:
    """`copy.deepcopy` of a fake tensor clones it, as Tensor.__deepcopy__ does for a tensor
    without storage.

    torch 2.13's Tensor.__deepcopy__ takes a tensor subclass for one without storage only when
    its data_ptr() is 0; a FakeTensor's is not, so its fake storage was copied byte by byte: heap
    corruption. torch.distributed.pipelining's Pipe deep-copies a weight tied across stages
    (a tied Llama split by torch.export), after which the process aborted ("corrupted
    double-linked list") or segfaulted in the garbage collector, in 2 runs of 5 of a tiny tied
    Llama's estimate and in every run of benchmarks/estimate_accuracy.py that estimated one."""
    original = torch.Tensor.__deepcopy__

    def deepcopy(t: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        if not isinstance(t, FakeTensor):
            return original(t, memo)
        if id(t) not in memo:
            with torch.no_grad():
                copied = t.clone()
            if isinstance(t, nn.Parameter):
                memo[id(t)] = nn.Parameter(copied, t.requires_grad)
            else:
                memo[id(t)] = copied.requires_grad_(t.requires_grad)
        return memo[id(t)]

    torch.Tensor.__deepcopy__ = deepcopy  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__ = original  # type: ignore[method-assign]


def _unchanged(t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether Module.to(*args, **kwargs) leaves `t` as it is: a floating tensor converted to
    itself; any other only moved, to its own device (Module.to casts only floating ones)."""
    if t.is_floating_point() or t.is_complex():
        return t.to(*args, **kwargs) is t
    return torch.empty((), device=t.device).to(*args, **kwargs).device == t.device


def _build(job: Job, config: EngineConfig, world: int) -> FakeModel:
    """The cell's objects, fake, as an engine builds them (engine/entry.py)."""
    ws = build_workspace(job, config.seed, read_pretrained=False)
    cache_off(ws.model)  # as training runs it, without a key/value cache; built for this only
    if config.activation_checkpointing:
        checkpoint_blocks(ws.model)  # before any split, as training does
    params = [p for p in ws.model.parameters() if p.requires_grad]

    def make(ps: list[nn.Parameter]) -> torch.optim.Optimizer:  # engine/loop.py's choice
        return ws.make_optimizer(ps) if ws.make_optimizer else default_optimizer(ps, config.lr)

    notes: list[str] = []
    if config.offload_activations:
        notes.append(
            "activations are counted on the device: --offload-activations holds them in host "
            "memory until backward, so the device figure is an upper bound"
        )
    try:
        state = optimizer_state(params, make)
    except Exception as exc:  # noqa: BLE001 - a cell's optimizer may need real values
        state = {p: [(2 * p.numel() * p.element_size(), True)] for p in params}
        notes.append(f"optimizer state taken as AdamW's two moments (stepping it failed: {exc})")
    slice_size = config.forward_size(world)
    n = readable(ws.dataset, slice_size)  # a stream's first items read
    with unset_fake_temporarily():  # real values: a map-style dataset's __getitem__ reads them
        indices = torch.arange(n)
    example = fetch(ws.dataset, indices, ws.collate_fn)
    try:
        blocks = find_blocks(ws.model)
        block_modules = [ws.model.get_submodule(blocks.qualified(i)) for i in range(len(blocks))]
    except JobError:
        block_modules = []
    scale = slice_size / n
    # every parameter, frozen ones too (a LoRA model's base): each strategy holds them as it
    # holds the trained ones (FSDP2 shards them, tensor parallel splits them, a stage keeps
    # its own), with no gradient and no optimizer state (attribution.grad_bytes skips them)
    everything = list(ws.model.parameters())
    return FakeModel(ws, config, world, everything, state, example, scale, block_modules, notes)


def _trace(m: FakeModel, split: dict[nn.Module, str]) -> Trace:
    objective, model = m.ws.objective, m.ws.model

    def run() -> torch.Tensor:
        args, kwargs, target = objective.split(m.example)
        return objective.loss(model(*args, **kwargs), target)

    return trace_step(model, m.blocks, split, run, autocast(m.config.precision, _device()))


def _device() -> torch.device:
    """Autocast's device type: the estimate is for accelerators; on a machine without one the
    CPU's autocast casts the same matmuls (torch's autocast op lists)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _assemble(m: FakeModel, trace: Trace, ranks: Ranks) -> Footprint:
    rows = []
    for held, grad, act in zip(ranks.held, ranks.grads or ranks.held, ranks.activations):
        grads = grad_bytes(grad)
        opt = sum(
            nbytes * n / p.numel() if shaped else nbytes
            for p, n in held.items()  # an empty shard still has its step count
            for nbytes, shaped in m.state.get(p, [])  # a frozen parameter has none
        )
        params = sum(p.element_size() * n for p, n in held.items())
        rows.append(
            {
                keys.MEMORY_PARAMS: params / MIB,
                keys.MEMORY_GRADS: grads / MIB,
                keys.MEMORY_OPTIMIZER: opt / MIB,
                keys.MEMORY_ACTIVATIONS: act / MIB,
            }
        )
    n = batch_size_of(m.example)
    inputs = model_inputs(m.example)
    tokens = None
    if torch.is_tensor(inputs) and not inputs.is_floating_point():
        tokens = inputs.numel() // n * m.config.batch_size
    return Footprint(
        world_size=m.world,
        ranks=rows,
        flops_per_step=trace.flops / n * m.config.batch_size,
        comm_bytes_per_step=ranks.comm,
        params=sum(p.numel() for p in m.ws.model.parameters()),
        tokens_per_step=tokens,
        samples=_samples(m.ws.dataset),
        notes=m.notes,
    )


def _attribution(config: EngineConfig) -> Attribution:
    """How `config`'s strategy attributes a traced step to ranks: its description answers (a
    strategy that answers None has no estimate)."""
    strategy = describe(config.strategy)
    attribution = strategy.attribution()
    if attribution is None:
        with_rule = [n for n in strategy_names() if describe(n).attribution() is not None]
        raise ConfigError(
            "strategy", strategy.name, f"has no estimate; one of {', '.join(with_rule)} has"
        )
    return attribution
