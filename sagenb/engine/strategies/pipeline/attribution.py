"""The pipeline's answer to the estimate (engine/strategies/attribution.py), for model and
hybrid: the cut points cuts.py chooses for training, the model split by partition.py's
split_model; rank = replica x P + position holds stages position, position + P, ... and the
activations of the microbatches in flight (GPipe: all M; 1F1B: P - position; Narayanan et al.
2021, arXiv:2104.04473, 2.2).

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
from sagenb.engine.strategies.pipeline.partition import split_model
from sagenb.engine.strategies.pipeline.prefetch_schedule import compute_order

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["PipelineAttribution"]


class PipelineAttribution(Attribution):
    def prepare(self, m: FakeModel) -> tuple[dict[nn.Module, str], Any]:
        cfg, model = m.config, m.ws.model
        method = cfg.partition_by
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
        P, S = cfg.partitions, len(starts)
        D = N // P
        per_stage = _stage_bytes(trace, starts)
        held_here = set(m.params)  # every parameter, frozen ones too
        held, acts, comm = [], [], []
        for r in range(N):
            position = r % P
            mine = range(position, S, P)
            params = {p for s in mine for p in stages[s].parameters() if p in held_here}
            held.append({p: p.numel() for p in params})
            flight = _in_flight(cfg, position)
            acts.append(sum(per_stage[s] for s in mine) * flight / len(mine) * m.scale)
            p2p = sum(_boundary(trace, starts, s) for s in mine)
            slices = cfg.microbatches * cfg.grad_accum
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
    """Microbatches whose activations one engine holds at once, per stage it runs.

    GPipe and 1F1B: the most forwards not yet matched by their backward along the compute
    order the engines run (prefetch_schedule.compute_order, torch's own order: GPipe all M,
    1F1B P - position, its warm-up; Narayanan et al. 2021, arXiv:2104.04473, 2.2).
    Interleaved: torch's warm-up of (v - 1) P + 2 (P - 1 - position) + 1 chunk-microbatches
    spread over the v chunks (an approximation, not measured).

    The engines once counted one microbatch more on the first stage, at the first step: the
    shape inference PipelineStage runs there (a forward with grad, then dropped) was kept
    alive by the memory meter's own hooks, a leak engine/memory.py no longer has (issue 31)."""
    M, P = cfg.microbatches, cfg.partitions
    if cfg.schedule == "interleaved":
        v = cfg.stages // P
        return min(M * v, (v - 1) * P + 2 * (P - 1 - position) + 1) / v
    held = most = 0
    for op, _ in compute_order(cfg.schedule, P, M, position):
        held += 1 if op == "F" else -1
        most = max(most, held)
    return float(most)
