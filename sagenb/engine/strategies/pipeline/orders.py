"""What each engine of a pipeline runs in a step, in order, and the bubble that order implies.

`rank_order` gives one engine's ("F" | "B" | "I" | "W", stage, microbatch) in the order torch's
schedule of that kind runs them: GPipe and 1F1B from prefetch_schedule.compute_order (one stage
per engine), interleaved 1F1B and interleaved zero bubble from torch's own per-rank calculation
(torch_private.interleaved_order), looped breadth-first as torch's ScheduleLoopedBFS lays it out
(every microbatch through an engine's first stage, then its next; backwards in reverse), ZB-V
and DualPipeV from torch's own per-rank calculation (torch_private.v_order). B is a whole
backward; the zero-bubble schedules split it into I (the input's gradient) and W (the
weights'), the W run later to fill the bubble (Qi et al. 2024, arXiv:2401.10241).

`stages_on` and `engine_of` say where each stage runs: round the engines in a loop (engine r
holds stages r, r + P, ...), or, for the V-shaped schedules, two stages per engine in a V
(engine r holds stages r and 2P - 1 - r: the first and the last stage share engine 0, and the
model turns round on the last engine, which hands its activations to itself). They are
torch's own placements (the "loop" and "v" styles its schedules take from
torch.distributed.pipelining._utils.generate_stage_to_rank_mapping, a private module), written
here in two lines each; tests/test_schedules.py checks the stages each engine reports.

`ideal_bubble` runs those orders on equal stages (forward 1, input gradient 1, weights'
gradient 1; a whole backward 2, as the papers count) with each op waiting for the ops it needs
(a forward for the previous stage's, a backward for the next stage's and its own forward, a W
for its B): the idle fraction of the step that is left is the schedule's own bubble. For GPipe
and 1F1B it is (p - 1) / (m + p - 1) (Huang et al. 2019), for interleaved (p - 1) / (v m + p - 1)
when m is a multiple of p (Narayanan et al. 2021); tests/test_schedules.py checks both.
"""

from __future__ import annotations

from sagenb.engine.strategies.pipeline.prefetch_schedule import compute_order
from sagenb.engine.torch_private import interleaved_order, v_order

__all__ = ["V_SHAPED", "engine_of", "ideal_bubble", "rank_order", "stages_on"]

#: the schedules that hold two stages per engine in a V: ZB-V (Qi et al. 2024, section 6) and
#: DualPipeV (DeepSeek-V3, arXiv:2412.19437, in the V form torch ships)
V_SHAPED = ("zbv", "dualpipev")

#: the length of each kind of op on equal stages
_COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def stages_on(schedule: str, ranks: int, chunks: int, rank: int) -> list[int]:
    """The stages engine `rank` of a pipeline of `ranks` holds, in increasing order."""
    if schedule in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return list(range(rank, ranks * chunks, ranks))


def engine_of(schedule: str, ranks: int, stage: int) -> int:
    """The position in its pipeline of the engine that holds `stage`."""
    if schedule in V_SHAPED and stage >= ranks:
        return 2 * ranks - 1 - stage
    return stage % ranks


def rank_order(
    schedule: str, ranks: int, chunks: int, microbatches: int, rank: int
) -> list[tuple[str, int, int]]:
    """("F" | "B" | "I" | "W", stage, microbatch) in the order `rank` of `ranks` runs them under
    `schedule`, each rank holding `chunks` stages (rank r: stages r, r + ranks, ...)."""
    M = microbatches
    if schedule in ("gpipe", "1f1b"):
        return [(op, rank, i) for op, i in compute_order(schedule, ranks, M, rank)]
    if schedule in ("interleaved", "zero-bubble"):
        return interleaved_order(ranks, chunks, M, rank, zero_bubble=schedule == "zero-bubble")
    if schedule in V_SHAPED:
        return v_order(schedule, ranks, microbatches, rank)
    if schedule == "looped-bfs":
        stages = stages_on(schedule, ranks, chunks, rank)
        forwards = [("F", s, i) for s in stages for i in range(M)]
        return forwards + [("B", s, i) for s in reversed(stages) for i in reversed(range(M))]
    raise ValueError(f"schedule {schedule!r}: no order known")


def ideal_bubble(schedule: str, ranks: int, chunks: int, microbatches: int) -> float:
    """The idle fraction of a step of `schedule` on equal stages (module docstring)."""
    orders = [rank_order(schedule, ranks, chunks, microbatches, r) for r in range(ranks)]
    last = ranks * chunks - 1
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * ranks
    at = [0] * ranks
    while any(at[r] < len(orders[r]) for r in range(ranks)):
        moved = False
        for r in range(ranks):
            while at[r] < len(orders[r]):
                op, stage, i = orders[r][at[r]]
                needs = _needs(op, stage, i, last)
                if any(n not in done for n in needs):
                    break
                start = max([free[r], *(done[n] for n in needs)])
                free[r] = start + _COST[op]
                done[("B" if op == "I" else op, stage, i)] = free[r]
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule}: the order waits on itself")
    busy = sum(_COST[op] for op, _, _ in orders[0])
    return 1 - busy / max(done.values())


def _needs(op: str, stage: int, i: int, last: int) -> list[tuple[str, int, int]]:
    if op == "F":
        return [("F", stage - 1, i)] if stage else []
    if op == "W":
        return [("B", stage, i)]  # its own input gradient (recorded as B)
    return [("F", stage, i)] + ([("B", stage + 1, i)] if stage < last else [])
