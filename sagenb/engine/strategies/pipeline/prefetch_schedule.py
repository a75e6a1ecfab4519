"""GPipe and 1F1B with every receive of a step posted at its start (gloo only).

torch's ScheduleGPipe and Schedule1F1B post a microbatch's receive just before they need it.
On gloo a transfer starts only once the receiver has posted its receive and the sender's I/O
thread has answered, so each of a step's 2 x microbatches transfers puts a round trip on the
critical path, a sizeable share of a small stage's compute (the figures:
benchmarks/results/measured_in_code.md).

Here the same compute order runs on torch's own action runtime (PipelineScheduleRuntime, the
one that runs its interleaved schedule), from an action list that posts all of the step's
receives first. Every microbatch has its own receive buffers in a PipelineStage, so this costs
no memory; each transfer then lands while the receiver is still busy with earlier work.

Only for gloo, whose sends and receives proceed independently. NCCL runs a pair's sends and
receives in order on one stream, where a receive posted early blocks the sends behind it
(a rank would wait for a gradient before sending the activation that produces it); on NCCL
the pipeline keeps torch's schedules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage

from sagenb.engine.torch_private import (
    Action,
    ComputationType,
    PipelineScheduleRuntime,
    load_actions,
)

__all__ = ["PrefetchingSchedule", "compute_order", "action_lists"]

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
SEND_F, RECV_F = ComputationType.SEND_F, ComputationType.RECV_F
SEND_B, RECV_B = ComputationType.SEND_B, ComputationType.RECV_B
REDUCE_GRAD = ComputationType.REDUCE_GRAD


def compute_order(kind: str, stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """("F" | "B", microbatch) in the order torch's schedule of that kind runs them on `stage`.

    gpipe: every forward, then every backward. 1f1b (torch's Schedule1F1B): min(m, p - stage)
    forwards, then one backward and one forward in turn, then the remaining backwards."""
    m = microbatches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"schedule {kind!r}: only gpipe and 1f1b post their receives ahead")
    warmup = min(m, stages - stage)
    order = [("F", i) for i in range(warmup)]
    forward = warmup
    for backward in range(m):
        order.append(("B", backward))
        if forward < m:
            order.append(("F", forward))
            forward += 1
    return order


def action_lists(kind: str, stages: int, microbatches: int) -> dict[int, list[Action | None]]:
    """Every stage's actions (one stage per rank): its receives, then its compute order with a
    send after each forward (not on the last stage) and each backward (not on the first), then
    the gradient reduction. Typed as torch's _prepare_schedule_with_comms takes them, where None
    is an idle slot; these lists have none."""
    out = {}
    for s in range(stages):
        first, last = s == 0, s == stages - 1
        actions: list[Action | None] = []
        if not first:
            actions += [Action(s, RECV_F, i) for i in range(microbatches)]
        if not last:
            actions += [Action(s, RECV_B, i) for i in range(microbatches)]
        for op, i in compute_order(kind, stages, microbatches, s):
            if op == "F":
                actions.append(Action(s, F, i))
                if not last:
                    actions.append(Action(s, SEND_F, i))
            else:
                actions.append(Action(s, B, i))
                if not first:
                    actions.append(Action(s, SEND_B, i))
        actions.append(Action(s, REDUCE_GRAD, None))
        out[s] = actions
    return out


class PrefetchingSchedule(PipelineScheduleRuntime):
    """torch's GPipe or 1F1B compute order, receives posted at the start of each step."""

    def __init__(
        self,
        stage: PipelineStage,
        microbatches: int,
        kind: str,
        loss_fn: Callable[..., torch.Tensor],
    ):
        super().__init__([stage], microbatches, loss_fn=loss_fn, scale_grads=False)
        lists = action_lists(kind, stage.num_stages, microbatches)
        load_actions(self, lists)
