"""What each rank of a run would hold and compute, found in one process without engines and
without allocating the model (sagenb issue 16).

The cell runs under torch's FakeTensorMode (footprint_trace.py): its model, dataset and
optimizer state are tensors with shapes and no storage, so a 1-billion-parameter GPT costs the
memory of its metadata. One microbatch-shaped example goes through forward and backward,
counted for FLOPs and saved activations as the engines count them; the bytes are then
attributed to ranks by the strategy's own layout, computed with the functions training uses:

- data: every rank holds every parameter, gradient and optimizer state, and the activations
  of its share of the batch;
- sharded (FSDP2): each parameter, its gradient and its optimizer state are split on dim 0 in
  torch.chunk's pieces, as `fully_shard` splits them (strategies/sharded.py); activations as
  data parallel. ZeRO-3's transiently gathered block is not in the figures (the engines'
  accounting counts the local shards too); its size is in the notes;
- tensor: the plan of engine/strategies/tensor/plan.py (the one training applies), each split
  weight divided on its split dim among the T engines of a group; activations between a
  column-wise and a row-wise layer divided by T (Megatron-LM, arXiv:1909.08053), data parallel
  across groups;
- model / hybrid: the cut points of engine/strategies/pipeline/cuts.py, the model split by
  split_model (pipeline/partition.py), each rank holding its stages' parameters; activations of
  the microbatches in flight (GPipe: all M; 1F1B: P - position; Narayanan et al. 2021,
  arXiv:2104.04473, 2.2).

Communication, bytes each rank sends per optimizer step (ring collectives, where each rank
sends (N-1)/N of the buffer per all-gather or reduce-scatter and twice that per all-reduce:
Patarasuk and Yuan 2009; Rajbhandari et al., ZeRO, arXiv:1910.02054, section 7):
- data: all_reduce 2(N-1)/N x gradient bytes (DDP, once per step with grad-accum's no_sync);
- sharded: all_gather (N-1)/N x parameter bytes, twice per slice with reshard-after-forward
  (ZeRO-3: forward and backward), once without (ZeRO-2); reduce_scatter (N-1)/N x gradient
  bytes once per step; together ZeRO's 3 x params against DDP's 2 x;
- tensor: all_reduce 2(T-1)/T x (each row-wise layer's output in forward + each column-wise
  layer's input gradient in backward), per slice (torch's styles reduce each column-wise
  layer's input gradient on its own); plus 2(D-1)/D x the rank's gradient bytes across the D
  replicas;
- model / hybrid: p2p, each microbatch's activation at a cut forward and its gradient backward
  (the same bytes); hybrid adds 2(D-1)/D x the rank's gradient bytes across replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sagenb.config.errors import ConfigError
from sagenb.config.job import Job, JobError
from sagenb.config.options import EngineConfig, describe, strategy_names
from sagenb.engine.data import fetch
from sagenb.engine.model.blocks import find_blocks
from sagenb.engine.model.recompute import checkpoint_blocks
from sagenb.engine.objective import batch_size_of, model_inputs
from sagenb.engine.precision import autocast
from sagenb.engine.strategies.pipeline import choose_cuts, split_model, static_profile
from sagenb.engine.strategies.tensor import is_conv1d, matches, plan_for, splits
from sagenb.engine.torch_private import FakeTensorMode, direct_parameters
from sagenb.engine.workspace import Workspace, build_workspace
from sagenb.metrics import keys
from sagenb.sizing.footprint_trace import Trace, optimizer_state, trace_step

__all__ = ["Footprint", "footprint", "chunk_sizes"]

MIB = 2**20


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
    try:
        return len(dataset)
    except TypeError:
        return None


def chunk_sizes(size: int, parts: int) -> list[int]:
    """The sizes of torch.chunk(size, parts) along one dim, padded with zeros to `parts`:
    how FSDP2 and DTensor's Shard split a dim (the last pieces may be smaller or empty)."""
    step = -(-size // parts) if size else 0
    return [max(0, min(step, size - i * step)) for i in range(parts)]


@dataclass
class _Model:
    """The fake model and what every attribution reads."""

    ws: Workspace
    config: EngineConfig
    world: int
    params: list[nn.Parameter]
    #: per parameter: (bytes of each optimizer state tensor, shaped like the parameter)
    state: dict[nn.Parameter, list[tuple[int, bool]]]
    example: Any
    #: samples in one slice (microbatch) of the run / samples in `example`
    scale: float
    blocks: list[nn.Module]
    notes: list[str]


@dataclass
class _Ranks:
    """One strategy's answer: per rank, elements held of each parameter, activation bytes
    and bytes sent."""

    held: list[dict[nn.Parameter, int]]
    activations: list[float]
    comm: list[dict[str, float]]


def footprint(job: Any, config: EngineConfig, world_size: int) -> Footprint:
    """The footprint of training `job` (a sagenb.config.job.Job or cell source) with `config` on
    `world_size` ranks. Raises ConfigError (naming --engines) for a world size the strategy
    cannot use, JobError for a cell that cannot be built or split."""
    job = Job.from_cell(job) if isinstance(job, str) else job
    config = _at(config.for_engines(), world_size)
    attribute = _attribution(config)
    with FakeTensorMode():
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


def _build(job: Job, config: EngineConfig, world: int) -> _Model:
    """The cell's objects, fake, as an engine builds them (engine/entry.py)."""
    ws = build_workspace(job, config.seed)
    if config.activation_checkpointing:
        checkpoint_blocks(ws.model)  # before any split, as training does
    params = [p for p in ws.model.parameters() if p.requires_grad]

    def make(ps: list[nn.Parameter]) -> torch.optim.Optimizer:  # engine/loop.py's choice
        return ws.make_optimizer(ps) if ws.make_optimizer else torch.optim.AdamW(ps, lr=config.lr)

    notes: list[str] = []
    try:
        state = optimizer_state(params, make)
    except Exception as exc:  # noqa: BLE001 - a cell's optimizer may need real values
        state = {p: [(2 * p.numel() * p.element_size(), True)] for p in params}
        notes.append(f"optimizer state taken as AdamW's two moments (stepping it failed: {exc})")
    pipelined = describe(config.strategy).pipelined
    pieces = config.replicas(world) * config.grad_accum * (config.microbatches if pipelined else 1)
    slice_size = config.batch_size // pieces
    n = min(slice_size, len(ws.dataset))
    example = fetch(ws.dataset, torch.arange(n))
    try:
        blocks = find_blocks(ws.model)
        block_modules = [ws.model.get_submodule(blocks.qualified(i)) for i in range(len(blocks))]
    except JobError:
        block_modules = []
    return _Model(ws, config, world, params, state, example, slice_size / n, block_modules, notes)


def _trace(m: _Model, split: dict[nn.Module, str]) -> Trace:
    objective, model = m.ws.objective, m.ws.model

    def run() -> torch.Tensor:
        args, kwargs, target = objective.split(m.example)
        return objective.loss(model(*args, **kwargs), target)

    return trace_step(model, m.blocks, split, run, autocast(m.config.precision, _device()))


def _device() -> torch.device:
    """Autocast's device type: the estimate is for accelerators; on a machine without one the
    CPU's autocast casts the same matmuls (torch's autocast op lists)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _assemble(m: _Model, trace: Trace, ranks: _Ranks) -> Footprint:
    rows = []
    for held, act in zip(ranks.held, ranks.activations):
        grads = sum(p.element_size() * n for p, n in held.items())
        opt = sum(
            nbytes * n / p.numel() if shaped else nbytes
            for p, n in held.items()  # an empty shard still has its step count
            for nbytes, shaped in m.state[p]
        )
        params = sum(p.element_size() * n for p, n in held.items())
        params += _frozen_bytes(m)
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


def _frozen_bytes(m: _Model) -> int:
    """Parameters that do not train are held whole by every rank (an estimate: sharded and
    split strategies may split them too)."""
    trained = set(m.params)
    return sum(p.numel() * p.element_size() for p in m.ws.model.parameters() if p not in trained)


def _grad_bytes(held: dict[nn.Parameter, int]) -> float:
    return float(sum(p.element_size() * n for p, n in held.items()))


def _ring(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective over `n` ranks of an `nbytes` buffer."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes


class _Attribution:
    """One strategy's rule: what to mark before the trace, and the ranks after it."""

    def prepare(self, m: _Model) -> tuple[dict[nn.Module, str], Any]:
        return {}, None

    def ranks(self, m: _Model, trace: Trace, layout: Any) -> _Ranks:
        raise NotImplementedError


class _Data(_Attribution):
    def ranks(self, m: _Model, trace: Trace, layout: Any) -> _Ranks:
        held = {p: p.numel() for p in m.params}
        act = trace.peak_activations * m.scale
        send = {"all_reduce": _ring("all_reduce", _grad_bytes(held), m.world)}
        return _Ranks([held] * m.world, [act] * m.world, [send] * m.world)


class _Sharded(_Attribution):
    def ranks(self, m: _Model, trace: Trace, layout: Any) -> _Ranks:
        N, cfg = m.world, m.config
        held: list[dict[nn.Parameter, int]] = [{} for _ in range(N)]
        for p in m.params:
            rows = chunk_sizes(p.shape[0], N) if p.dim() else [1] + [0] * (N - 1)
            for r in range(N):
                held[r][p] = rows[r] * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
        whole = _grad_bytes({p: p.numel() for p in m.params})
        gathers = (2 if cfg.reshard_after_forward else 1) * cfg.grad_accum
        send = {
            "all_gather": gathers * _ring("all_gather", whole, N),
            "reduce_scatter": _ring("reduce_scatter", whole, N),
        }
        biggest = max((_module_bytes(b) for b in m.blocks), default=0)
        m.notes.append(
            f"sharded: params/grads/optimizer are each rank's shards; while a block computes "
            f"its parameters are gathered whole (up to {biggest / MIB:.1f} MiB more, transient, "
            "not in the figures)"
        )
        act = trace.peak_activations * m.scale
        return _Ranks(held, [act] * N, [dict(send) for _ in range(N)])


def _module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


#: per layer kind and split: {parameter name: dim split}; others stay whole (tp_styles.py)
_SPLIT_DIMS: dict[str, dict[str, dict[str, int]]] = {
    "linear": {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1}},
    "conv1d": {"colwise": {"weight": 1, "bias": 0}, "rowwise": {"weight": 0}},
    "embedding": {"colwise": {"weight": 1}, "rowwise": {"weight": 0}},
}


class _Tensor(_Attribution):
    def prepare(self, m: _Model) -> tuple[dict[nn.Module, str], Any]:
        T = m.config.tensor_parallel or m.world
        plan = plan_for(m.ws.model, T, m.ws.tp_plan)
        split: dict[nn.Module, str] = {}
        for key, style in plan.styles.items():
            kind = splits(style)
            for _path, module in matches(m.ws.model, key):
                if kind is not None:
                    split[module] = kind
        return split, (T, split)

    def ranks(self, m: _Model, trace: Trace, layout: Any) -> _Ranks:
        (T, split), N = layout, m.world
        D = N // T
        held: list[dict[nn.Parameter, int]] = []
        dims = _split_dims(split)
        for r in range(N):
            held.append({p: _piece(p, dims.get(p), T, r % T) for p in m.params})
        whole = sum(w for w, _ in trace.saved.values())
        part = sum(s for _, s in trace.saved.values())
        share = (whole + part / T) / (whole + part) if whole + part else 1.0
        act = trace.peak_activations * share * m.scale
        reduced = (trace.rowwise_out + trace.colwise_in) * m.scale * m.config.grad_accum
        comm = [
            {"all_reduce": _ring("all_reduce", reduced, T) + _ring("all_reduce", _grad_bytes(h), D)}
            for h in held
        ]
        return _Ranks(held, [act] * N, comm)


def _split_dims(split: dict[nn.Module, str]) -> dict[nn.Parameter, int]:
    """The dim each split parameter is divided on, as tp_styles.py's styles place them."""
    dims: dict[nn.Parameter, int] = {}
    for module, kind in split.items():
        layer = (
            "embedding"
            if isinstance(module, nn.Embedding)
            else "conv1d"
            if is_conv1d(module)
            else "linear"
        )
        for name, dim in _SPLIT_DIMS[layer][kind].items():
            p = direct_parameters(module).get(name)
            if p is not None:
                dims[p] = dim
    return dims


def _piece(p: nn.Parameter, dim: int | None, parts: int, position: int) -> int:
    """Elements of `p` one rank holds when `dim` is split `parts` ways (None: whole)."""
    if dim is None:
        return p.numel()
    return chunk_sizes(p.shape[dim], parts)[position] * (p.numel() // p.shape[dim])


class _Pipeline(_Attribution):
    """model and hybrid: rank = replica x P + position holds stages position, position + P ..."""

    def prepare(self, m: _Model) -> tuple[dict[nn.Module, str], Any]:
        cfg, model = m.config, m.ws.model
        method = cfg.partition_by
        if method == "auto":  # auto times the blocks; fake tensors cannot be timed
            method = "parameters"
            m.notes.append(
                "--partition-by auto balances measured time; estimated by parameter counts"
            )
        profile = static_profile(model) if method in ("parameters",) else None
        starts = choose_cuts(model, cfg, m.example, m.ws.objective, method=method, profile=profile)
        inputs = m.ws.objective.split(m.example, labels_in=False)[:2]
        stages, _ = split_model(model, starts, inputs)
        return {}, (starts, stages)

    def ranks(self, m: _Model, trace: Trace, layout: Any) -> _Ranks:
        starts, stages = layout
        cfg, N = m.config, m.world
        P, S = cfg.partitions, len(starts)
        D = N // P
        per_stage = _stage_bytes(trace, starts)
        trained = set(m.params)
        held, acts, comm = [], [], []
        for r in range(N):
            position = r % P
            mine = range(position, S, P)
            params = {p for s in mine for p in stages[s].parameters() if p in trained}
            held.append({p: p.numel() for p in params})
            flight = _in_flight(cfg, position)
            acts.append(sum(per_stage[s] for s in mine) * flight / len(mine) * m.scale)
            p2p = sum(_boundary(trace, starts, s) for s in mine)
            slices = cfg.microbatches * cfg.grad_accum
            comm.append(
                {
                    "p2p": p2p * slices * m.scale,
                    "all_reduce": _ring("all_reduce", _grad_bytes(held[-1]), D),
                }
            )
        return _Ranks(held, acts, comm)


def _stage_bytes(trace: Trace, starts: list[int]) -> list[float]:
    """Bytes saved for backward by one microbatch on each stage: what runs before the first
    block is stage 0's, after the last block the last stage's."""
    out = [0.0] * len(starts)
    for position, (whole, part) in trace.saved.items():
        stage = max(s for s, b in enumerate(starts) if b <= position or s == 0)
        out[stage] += whole + part
    return out


def _boundary(trace: Trace, starts: list[int], s: int) -> float:
    """Bytes stage `s` sends per microbatch: its output forward, its input's gradient back."""
    bounds = [*starts, None]
    sent = 0.0
    if bounds[s + 1] is not None:
        sent += trace.block_out.get(bounds[s + 1] - 1, 0.0)  # type: ignore[operator]
    if s > 0:
        sent += trace.block_out.get(starts[s] - 1, 0.0)
    return sent


def _in_flight(cfg: EngineConfig, position: int) -> float:
    """Microbatches whose activations one engine holds at once, per stage it runs: GPipe
    all M; 1F1B P - position (its warm-up, Narayanan et al. 2021, arXiv:2104.04473, 2.2),
    plus one on the first stage (measured, below); interleaved, torch's warm-up of
    (v - 1) P + 2 (P - 1 - position) + 1 chunk-microbatches spread over the v chunks (an
    approximation, not measured)."""
    M, P = cfg.microbatches, cfg.partitions
    if cfg.schedule == "gpipe":
        return float(M)
    if cfg.schedule == "interleaved":
        v = cfg.stages // P
        return min(M * v, (v - 1) * P + 2 * (P - 1 - position) + 1) / v
    # the engines count one microbatch more on the first stage than its warm-up holds, even
    # beyond M (measured, benchmarks/results/estimate_accuracy.md: 3 for P = 2, M = 4; 5 for
    # P = 4, M = 4; the later stages hold exactly P - position). Not explained yet: saved
    # tensors of finished microbatches the hooks never see unpacked, most likely
    return float(min(M, P - position) + (position == 0))


#: how the bytes of a layout are attributed to ranks; a strategy names its layout in its
#: description (`Description.layout_kind`)
_RULES: dict[str, Callable[[], _Attribution]] = {
    "replicated": _Data,
    "sharded": _Sharded,
    "tensor": _Tensor,
    "pipeline": _Pipeline,
}


def _attribution(config: EngineConfig) -> _Attribution:
    """The rule for the layout `config`'s strategy describes (a strategy that names none
    has no estimate)."""
    strategy = describe(config.strategy)
    rule = _RULES.get(strategy.layout_kind or "")
    if rule is None:
        with_rule = [n for n in strategy_names() if describe(n).layout_kind in _RULES]
        raise ConfigError(
            "strategy", strategy.name, f"has no estimate; one of {', '.join(with_rule)} has"
        )
    return rule()
