"""GPipe and 1F1B with every receive of a step posted ahead (gloo only).

torch's ScheduleGPipe and Schedule1F1B post a microbatch's receive just before they need it.
On gloo a transfer starts only once the receiver has posted its receive and the sender's I/O
thread has answered, so each of a step's 2 x microbatches transfers puts a round trip on the
critical path, a sizeable share of a small stage's compute (the figures:
benchmarks/results/measured_in_code.md).

Here the same compute order runs on torch's own action runtime (PipelineScheduleRuntime, the
one that runs its interleaved schedule), from an action list that posts all of the step's
receives early: the activations' first, the gradients' once the first activation is sent
(posting them first held up the first forward, which every later stage waits for). Every
microbatch has its own receive buffers in a PipelineStage, so this costs no memory; each
transfer then lands while the receiver is still busy with earlier work.

Its sends are posted from a thread of the engine's own, in the schedule's order: a gloo send
writes the tensor into the socket in the calling thread (0.1-0.3 ms for a 512 KB activation),
so on the training thread each send sat between two forwards (first stage) or two backwards
(last stage). Off it, those gaps fell from ~0.5 to ~0.2 ms and the step by ~2% at 8
microbatches on 2 CPU engines (benchmarks/results/pipeline.md); the step still ends once every
send has completed, as torch's runtime does. They are handed to that thread as each forward
or backward returns, not by send actions: the runtime runs every action inside a
`record_function` (torch.profiler), whose cost on the critical path showed in the bubble (with
none at all, measured/replayed fell from 1.07-1.10 to 1.055-1.065 at 8 microbatches over 4
A/B pairs: docs/performance.md).

Only for gloo, whose sends and receives proceed independently. NCCL runs a pair's sends and
receives in order on one stream, where a receive posted early blocks the sends behind it
(a rank would wait for a gradient before sending the activation that produces it); on NCCL
the pipeline keeps torch's schedules.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from sagenb.engine.torch_private import (
    Action,
    ComputationType,
    PipelineScheduleRuntime,
    load_actions,
)

__all__ = ["PrefetchingSchedule", "compute_order", "action_lists"]

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
RECV_F, RECV_B = ComputationType.RECV_F, ComputationType.RECV_B
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
    """Every stage's actions (one stage per rank): its activations' receives, then its compute
    order, the gradients' receives after the first forward, then the gradient reduction. No
    action sends: PrefetchingSchedule hands each forward's and backward's sends over as it
    returns. Typed as torch's _prepare_schedule_with_comms takes them, where None
    is an idle slot; these lists have none."""
    out = {}
    for s in range(stages):
        first, last = s == 0, s == stages - 1
        actions: list[Action | None] = []
        if not first:
            actions += [Action(s, RECV_F, i) for i in range(microbatches)]
        for op, i in compute_order(kind, stages, microbatches, s):
            if op == "F":
                actions.append(Action(s, F, i))
                if not last and i == 0:
                    # the gradients' receives once the first activation is on its way: every
                    # later stage waits for it (~0.3 ms of posting at 8 microbatches), and
                    # no gradient can come back before it
                    actions += [Action(s, RECV_B, j) for j in range(microbatches)]
            else:
                actions.append(Action(s, B, i))
        actions.append(Action(s, REDUCE_GRAD, None))
        out[s] = actions
    return out


class PrefetchingSchedule(PipelineScheduleRuntime):
    """torch's GPipe or 1F1B compute order, receives posted ahead, sends handed to a thread."""

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
        self._posted: list[Future] = []
        # each forward's and backward's sends handed to the sending thread as it returns, not
        # by actions of their own: the runtime runs every action in a record_function
        if not stage.is_last:  # activations to the next stage
            stage.forward_one_chunk = self._then_send(  # type: ignore[method-assign]
                stage.forward_one_chunk, stage.get_fwd_send_ops
            )
        if not stage.is_first:  # gradients to the previous one
            stage.backward_one_chunk = self._then_send(  # type: ignore[method-assign]
                stage.backward_one_chunk, stage.get_bwd_send_ops
            )

    def _then_send(
        self, compute: Callable[..., Any], sends: Callable[[int], list[dist.P2POp]]
    ) -> Callable[..., Any]:
        """`compute` (a stage's forward_one_chunk or backward_one_chunk), then the chunk's
        sends handed to the sending thread."""

        def compute_then_send(chunk: int, *args: Any, **kwargs: Any) -> Any:
            output = compute(chunk, *args, **kwargs)
            self._send(sends(chunk))
            return output

        return compute_then_send

    def _send(self, ops: list[dist.P2POp]) -> None:
        if ops:
            self._posted.append(_post(ops))

    def _step_microbatches(self, *args, **kwargs):
        try:
            super()._step_microbatches(*args, **kwargs)
        except BaseException:
            self._posted = []  # a failed step: nothing to wait for (torch's runtime waits on none)
            raise
        posted, self._posted = self._posted, []
        for done in posted:  # every send of the step complete, as torch's runtime ends a step
            for work in done.result():
                work.wait()


_queue: queue.SimpleQueue[tuple[list[dist.P2POp], Future]] | None = None
_started = threading.Lock()


def _post(ops: list[dist.P2POp]) -> Future:
    """Hand `ops` (sends) to this process's sending thread, started on first use; it posts
    them in the order they were handed over, so a peer receives them in the schedule's order.
    The future holds their Work, or the error posting them raised."""
    global _queue
    with _started:
        if _queue is None:
            _queue = queue.SimpleQueue()
            name = "sagenb-pipeline-sends"
            threading.Thread(target=_send_forever, args=(_queue,), name=name, daemon=True).start()
    done: Future = Future()
    _queue.put((ops, done))
    return done


def _send_forever(handed: queue.SimpleQueue[tuple[list[dist.P2POp], Future]]) -> None:
    while True:
        ops, done = handed.get()
        try:
            done.set_result(
                [p.op(p.tensor, group=p.group, tag=p.tag, group_dst=p.group_peer) for p in ops]
            )
        except BaseException as error:  # noqa: BLE001 -- raised where the step waits for it
            done.set_exception(error)
