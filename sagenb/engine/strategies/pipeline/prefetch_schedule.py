"""GPipe and 1F1B with every receive of a step posted ahead (gloo only).

torch's ScheduleGPipe and Schedule1F1B post a microbatch's receive just before they need it.
On gloo a transfer starts only once the receiver has posted its receive and the sender's I/O
thread has answered, so each of a step's 2 x microbatches transfers puts a round trip on the
critical path, a sizeable share of a small stage's compute (the figures:
benchmarks/results/measured_in_code.md).

Here the same compute order runs from an action list that posts all of the step's receives
early: the activations' first, the gradients' once the first activation is sent (posting them
first held up the first forward, which every later stage waits for). Every microbatch has its
own receive buffers in a PipelineStage, so this costs no memory; each transfer then lands
while the receiver is still busy with earlier work.

Its sends are posted from a thread of the engine's own, in the schedule's order: a gloo send
writes the tensor into the socket in the calling thread (0.1-0.3 ms for a 512 KB activation),
so on the training thread each send sat between two forwards (first stage) or two backwards
(last stage). Off it, those gaps fell from ~0.5 to ~0.2 ms and the step by ~2% at 8
microbatches on 2 CPU engines (benchmarks/results/pipeline.md); the step still ends once every
send has completed, as torch's schedules end theirs.

The actions run in a loop of this module's own, a subclass of torch's PipelineScheduleSingle
as ScheduleGPipe is, with the calls ScheduleGPipe makes around each forward and backward
(torch_private.begin_step, compute_loss, loss_of, end_step). It ran on torch's action runtime
(the _PipelineScheduleRuntime behind ScheduleInterleaved1F1B) before, which enters a
torch.profiler `record_function` and a dispatch for every action; over 4 A/B pairs of 20-step
GPipe runs at 8 microbatches, measured/replayed (the bubble over the ideal of each step's own
microbatch times, benchmarks/pipeline.py) read 1.059-1.076 with this loop against 1.090-1.171
with the runtime (docs/performance.md).

Only for gloo, whose sends and receives proceed independently. NCCL runs a pair's sends and
receives in order on one stream, where a receive posted early blocks the sends behind it
(a rank would wait for a gradient before sending the activation that produces it); on NCCL
the pipeline keeps torch's schedules.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from sagenb.engine.torch_private import begin_step, compute_loss, end_step, loss_of

__all__ = ["PrefetchingSchedule", "compute_order", "action_lists"]

#: the actions: a receive of a microbatch's activations or gradients posted, a forward, a
#: backward (each waiting for its receive, then handing its sends to the sending thread)
RECV_F, F, RECV_B, B = "RECV_F", "F", "RECV_B", "B"


def compute_order(kind: str, stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """("F" | "B", microbatch) in the order torch's schedule of that kind runs them on `stage`.

    gpipe: every forward, then every backward. 1f1b (torch's Schedule1F1B): min(m, p - stage)
    forwards, then one backward and one forward in turn, then the remaining backwards."""
    m = microbatches
    if kind == "gpipe":
        return [(F, i) for i in range(m)] + [(B, i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"schedule {kind!r}: only gpipe and 1f1b post their receives ahead")
    warmup = min(m, stages - stage)
    order = [(F, i) for i in range(warmup)]
    forward = warmup
    for backward in range(m):
        order.append((B, backward))
        if forward < m:
            order.append((F, forward))
            forward += 1
    return order


def action_lists(kind: str, stages: int, microbatches: int) -> dict[int, list[tuple[str, int]]]:
    """Every stage's actions (one stage per rank), (RECV_F | F | RECV_B | B, microbatch): its
    activations' receives, then its compute order, the gradients' receives after the first
    forward. No action sends: each forward and backward hands its sends over as it returns."""
    out = {}
    for s in range(stages):
        first, last = s == 0, s == stages - 1
        actions = [] if first else [(RECV_F, i) for i in range(microbatches)]
        for op, i in compute_order(kind, stages, microbatches, s):
            actions.append((op, i))
            if op == F and i == 0 and not last:
                # the gradients' receives once the first activation is on its way: every
                # later stage waits for it (~0.3 ms of posting at 8 microbatches), and
                # no gradient can come back before it
                actions += [(RECV_B, j) for j in range(microbatches)]
        out[s] = actions
    return out


class PrefetchingSchedule(PipelineScheduleSingle):
    """torch's GPipe or 1F1B compute order, receives posted ahead, sends handed to a thread."""

    def __init__(
        self,
        stage: PipelineStage,
        microbatches: int,
        kind: str,
        loss_fn: Callable[..., torch.Tensor],
    ):
        super().__init__(stage, microbatches, loss_fn=loss_fn, scale_grads=False)
        self.stage, self.microbatches = stage, microbatches
        self.actions = action_lists(kind, stage.num_stages, microbatches)[stage.stage_index]
        self._posted: list[Future] = []

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """One step's actions in order (what ScheduleGPipe's method of that name does, with
        the receives posted ahead and the sends on the sending thread)."""
        args, kwargs = begin_step(self, arg_mbs, kwarg_mbs, target_mbs, losses, loss_kwargs)
        stage = self.stage
        received: dict[tuple[str, int], list[dist.Work]] = {}
        backwards = 0
        try:
            for op, i in self.actions:
                if op == RECV_F:
                    received[F, i] = _receive(stage.get_fwd_recv_ops(i))
                elif op == RECV_B:
                    received[B, i] = _receive(stage.get_bwd_recv_ops(i))
                elif op == F:
                    _wait_all(received.pop((F, i), ()))
                    output = stage.forward_one_chunk(
                        i, args[i], kwargs[i], save_forward_output=return_outputs
                    )
                    if not stage.is_last:
                        self._posted.append(_post(stage.get_fwd_send_ops(i)))
                    compute_loss(self, stage, output, target_mbs, i, loss_kwargs)
                else:
                    _wait_all(received.pop((B, i), ()))
                    backwards += 1
                    self._backward(i, last=backwards == self.microbatches)
            stage.perform_reduce_grad(1)  # the loss is scaled already (scale_grads=False)
        except BaseException:
            self._posted = []  # a failed step: nothing to wait for (torch's schedules wait on none)
            raise
        posted, self._posted = self._posted, []
        for done in posted:  # every send of the step complete, as torch's schedules end a step
            for work in done.result():
                work.wait()
        end_step(self, stage, losses)

    def _backward(self, i: int, *, last: bool) -> None:
        """Microbatch `i`'s backward (`last`: the step's last, where torch's stage finishes its
        gradients), its input's gradient handed to the sending thread."""
        stage = self.stage
        stage.backward_one_chunk(
            i, loss=loss_of(self, stage, i), full_backward=True, last_backward=last
        )
        if not stage.is_first:
            self._posted.append(_post(stage.get_bwd_send_ops(i)))


def _wait_all(received: Iterable[dist.Work]) -> None:
    """A microbatch's receives, posted ahead, complete before it is computed (gloo)."""
    for work in received:
        work.wait()


def _receive(ops: list[dist.P2POp]) -> list[dist.Work]:
    """Post `ops` (receives), each on its own as torch's schedules post a batch of receives."""
    return [p.op(p.tensor, group=p.group, tag=p.tag, group_src=p.group_peer) for p in ops]


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
