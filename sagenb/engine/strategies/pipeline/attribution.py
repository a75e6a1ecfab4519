"""The pipeline's answer to the estimate (engine/strategies/attribution.py), for model and
hybrid: the cut points cuts.py chooses for training, the model split by partition.py's
split_model; rank = replica x P + position holds stages position, position + P, ... and the
activations of the microbatches in flight, walked along the compute order the rank runs (GPipe:
all M; 1F1B: P - position; Narayanan et al. 2021, arXiv:2104.04473, 2.2; interleaved: torch's
own ScheduleInterleaved1F1B order over the rank's chunks).

Communication: p2p, each microbatch's activation at a cut forward and its gradient backward (the
same bytes); hybrid adds 2(D-1)/D x the rank's gradient bytes across the D replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from sagenb.engine.strategies.attribution import (
    Attribution,
    FakeModel,
    Ranks,
    Trace,
    grad_bytes,
    ring,
)
from sagenb.engine.strategies.pipeline.balance import static_profile
from sagenb.engine.strategies.pipeline.cuts import choose_cuts
from sagenb.engine.strategies.pipeline.options import PipelineOptions
from sagenb.engine.strategies.pipeline.orders import rank_order, stages_on
from sagenb.engine.strategies.pipeline.partition import split_model

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["PipelineAttribution"]


class PipelineAttribution(Attribution):
    def prepare(self, m: FakeModel) -> tuple[dict[nn.Module, str], Any]:
        cfg, model = m.config, m.ws.model
        method = PipelineOptions.of(cfg).partition_by
        if method == "auto":  # auto times the blocks; fake tensors cannot be timed
            method = "parameters"
            m.notes.append(
                "--partition-by auto balances measured time; estimated by parameter counts"
            )
        inputs = m.ws.objective.split(m.example)[:2]
        profile = static_profile(model, inputs) if method in ("parameters",) else None
        starts = choose_cuts(model, cfg, m.example, m.ws.objective, method=method, profile=profile)
        stages, _ = split_model(model, starts, inputs)
        return {}, (starts, stages)

    def ranks(self, m: FakeModel, trace: Trace, layout: Any) -> Ranks:
        starts, stages = layout
        cfg, N = m.config, m.world
        pipe = PipelineOptions.of(cfg)
        P, S = pipe.partitions, len(starts)
        D = N // P
        per_stage = _stage_bytes(trace, starts)
        held_here = set(m.params)  # every parameter, frozen ones too
        # a stage names its parameters as the model does; torch.export's split (a model fx
        # cannot trace) deep-copies a weight tied across stages into each: the copy counts
        # as the model's own parameter of that name, held by every stage that has a copy
        by_name = dict(m.ws.model.named_parameters(remove_duplicate=False))
        held, acts, comm = [], [], []
        for r in range(N):
            position = r % P
            mine = stages_on(pipe.schedule, P, S // P, position)
            params = {
                by_name.get(name, p) for s in mine for name, p in stages[s].named_parameters()
            }
            params &= held_here
            held.append({p: p.numel() for p in params})
            acts.append(_held(cfg, position, per_stage) * m.scale)
            p2p = sum(_boundary(trace, starts, s) for s in mine)
            slices = pipe.microbatches * cfg.grad_accum
            comm.append(
                {
                    "p2p": p2p * slices * m.scale,
                    "all_reduce": ring("all_reduce", grad_bytes(held[-1]), D),
                }
            )
        return Ranks(held, acts, comm)


def _stage_bytes(trace: Trace, starts: list[int]) -> list[float]:
    """Bytes saved for backward by one microbatch on each stage: what runs before the first
    block is stage 0's, after the last block the last stage's."""
    out = [0.0] * len(starts)

    def stage_of(position: int) -> int:
        return max(s for s, b in enumerate(starts) if b <= position or s == 0)

    for position, (whole, part) in trace.saved.items():
        out[stage_of(position)] += whole + part
    # saved on both sides of a cut: the receiving stage saves its own copy
    seen: set[tuple[int, int]] = set()
    for key, first, later, nbytes in trace.resaved:
        if stage_of(first) != stage_of(later) and (key, stage_of(later)) not in seen:
            seen.add((key, stage_of(later)))
            out[stage_of(later)] += nbytes
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


def _held(cfg: EngineConfig, position: int, per_stage: list[float]) -> float:
    """The most activation bytes one engine holds at once: each forward along the compute order
    the engine runs adds its stage's bytes for one microbatch, its backward frees them.

    GPipe and 1F1B: prefetch_schedule.compute_order, torch's own order on the one stage
    (GPipe all M, 1F1B P - position in its warm-up; Narayanan et al. 2021, arXiv:2104.04473,
    2.2). Interleaved: torch's ScheduleInterleaved1F1B order over the engine's chunks
    (torch_private.interleaved_order), whose warm-up holds (v - 1) P + 2 (P - 1 - position) + 1
    chunk-microbatches at most; each counts its own chunk's bytes. Looped BFS: all M of every
    chunk. Zero bubble: a microbatch's bytes are freed at its W, not at the input's gradient
    before it (an upper bound: the input's gradient frees what only it needed). All from
    orders.rank_order.

    The engines once counted one microbatch more on the first stage, at the first step: the
    shape inference PipelineStage runs there (a forward with grad, then dropped) was kept
    alive by the memory meter's own hooks, a leak engine/memory.py no longer has (issue 31)."""
    pipe = PipelineOptions.of(cfg)
    M, P = pipe.microbatches, pipe.partitions
    held = most = 0.0
    for op, stage, _ in rank_order(pipe.schedule, P, pipe.chunks, M, position):
        if op == "F":
            held += per_stage[stage]
        elif op in "BW":  # zero bubble's I keeps what its W needs: all of it, here
            held -= per_stage[stage]
        most = max(most, held)
    return most
