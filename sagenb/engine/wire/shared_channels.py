"""A pipeline's sends and receives between stages through shared memory, when every rank runs
on one host's CPU cores (where data parallel's all-reduce goes through it too:
shared_memory.py, whose segment, futex wait and failure checks this shares).

Gloo carries a send over TCP even between the processes of one machine: the receiver's I/O
thread wakes, reads the socket and hands the tensor over, a round trip of wake-ups on the
critical path of every microbatch a stage waits for (a pipeline step has 2 x microbatches of
them), which made most of the measured bubble beyond the stages' own compute
(benchmarks/results/pipeline.md). Here each ordered pair of neighbouring ranks has a ring of
bytes in one shared segment: the sender copies each tensor in behind a short header (its
sequence number and size) and advances the ring's tail; the receiver waits for the tail (a few
sched_yields, then asleep on its futex), copies the tensor out into its receive buffer and
advances the head, which frees the space for the sender. A tensor larger than the free space
goes through in pieces, so any size passes through a ring of fixed size.

Messages on a ring arrive in the order they were sent; the pipeline's schedules send and
receive each pair's messages in one order (prefetch_schedule.py), and a receiver checks each
header's sequence number and size against what it expects, raising instead of reading a wrong
tensor. Memory order: one writer per counter, after a locked instruction (shared_memory.py).

Failures are handled as the all-reduce's are: a rank that leaves (its close(), called by
process_group.shutdown through shared_memory.abort_all) or dies, or a wait longer than the
run's collective timeout, raises PeerLost in its peers.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from typing import Any

import torch

from sagenb.engine.wire import shared_memory
from sagenb.engine.wire.shared_memory import PeerLost

__all__ = ["SharedChannels", "attach", "in_flight"]

_LINE = shared_memory._LINE
#: bytes of each ring (a pair's messages in one direction); 8 MiB holds a step's activations
#: of the pipeline benchmarks' stages at 8 microbatches, so a sender seldom waits for space
RING_BYTES = 8 * 2**20
_HEADER = struct.Struct("qq")  # sequence number, size in bytes
#: what a rank of this process waits in, as tracing.in_flight reports collectives
_in_flight: dict[str, Any] | None = None


class _Ring:
    """One direction between two ranks: tail (bytes written, the sender's), head (bytes read,
    the receiver's), then the bytes."""

    def __init__(self, channels: SharedChannels, offset: int, src: int, dst: int):
        self.src, self.dst = src, dst
        self.tail_index, self.head_index = offset // 8, (offset + _LINE) // 8
        self.data = channels._bytes[offset + 2 * _LINE : offset + 2 * _LINE + RING_BYTES]
        self.sent = self.received = 0  # messages, as each side counts them


class SharedChannels:
    """One run's rings on one rank: send(tensor, dst) and recv(tensor, src) (global ranks)."""

    def __init__(
        self,
        mapped: Any,
        *,
        rank: int,
        world_size: int,
        pairs: list[tuple[int, int]],
        timeout_s: float,
    ):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._words = memoryview(mapped).cast("q")
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        self._address = whole.data_ptr()
        self._bytes = whole
        del mapped  # held by the tensor and the words: unmapped when the last of them goes
        self._check = shared_memory._Timespec(0, int(shared_memory._CHECK_S * 1e9))
        self._fence = threading.Lock()
        self._closed = False
        header = _LINE * world_size
        self._rings = {
            pair: _Ring(self, header + i * (2 * _LINE + RING_BYTES), *pair)
            for i, pair in enumerate(pairs)
        }
        shared_memory.register(self)

    # -- counters ----------------------------------------------------------------------------
    def _publish(self, index: int, value: int) -> None:
        with self._fence:  # a locked instruction: the bytes before it are seen first
            pass
        self._words[index] = value
        shared_memory.futex_wake(self._address + 8 * index)

    def _wait(self, index: int, least: int, peer: int, what: str) -> int:
        """The counter at `index` once it reaches `least`, waiting as shared_memory.py's
        barrier does; PeerLost when `peer` leaves or dies, or after the timeout."""
        spins, started = 0, 0.0
        while (seen := self._words[index]) < least:
            spins += 1
            if spins <= shared_memory._SPINS:
                os.sched_yield()
                continue
            started = started or time.monotonic()
            shared_memory.futex_wait(self._address + 8 * index, seen, self._check)
            if self._words[index] < least:
                self._check_peer(peer, time.monotonic() - started, what)
        return seen

    def _check_peer(self, peer: int, waited_s: float, what: str) -> None:
        if self._closed:
            raise PeerLost(f"this rank left the run while it waited to {what}")
        base = peer * _LINE // 8
        if self._words[base + shared_memory._ABORT]:
            raise PeerLost(f"rank {peer} left the run while this one waited to {what}")
        pid = self._words[base + shared_memory._PID]
        if not shared_memory.alive(pid):
            raise PeerLost(f"rank {peer} (pid {pid}) died while this one waited to {what}")
        if waited_s > self.timeout_s:
            raise PeerLost(
                f"rank {peer} did not answer within the collective timeout "
                f"({self.timeout_s:.0f} s) while this one waited to {what}"
            )

    # -- messages ----------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Copy `tensor` (on the CPU) into the ring to rank `dst`, waiting for space as needed."""
        ring = self._rings[(self.rank, dst)]
        ring.sent += 1
        payload = tensor.detach().contiguous().view(-1).view(torch.uint8)
        header = torch.frombuffer(
            bytearray(_HEADER.pack(ring.sent, payload.numel())), dtype=torch.uint8
        )
        tail = self._words[ring.tail_index]
        for part in (header, payload):
            tail = self._write(ring, part, tail, f"send to rank {dst}")

    def _write(self, ring: _Ring, part: torch.Tensor, tail: int, what: str) -> int:
        done, n = 0, part.numel()
        while done < n:
            head = self._wait(ring.head_index, tail - RING_BYTES + 1, ring.dst, what)
            at = tail % RING_BYTES
            size = min(n - done, RING_BYTES - (tail - head), RING_BYTES - at)
            ring.data[at : at + size].copy_(part[done : done + size])
            done, tail = done + size, tail + size
            self._publish(ring.tail_index, tail)
        return tail

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Fill `tensor` (contiguous, on the CPU) with the next message from rank `src`."""
        global _in_flight
        ring = self._rings[(src, self.rank)]
        ring.received += 1
        what = f"receive from rank {src}"
        _in_flight = {
            "op": "shared_memory:recv",
            "seq": ring.received,
            "sizes": [list(tensor.shape)],
            "group": "shared memory",
        }
        try:
            head = self._words[ring.head_index]
            header = torch.empty(_HEADER.size, dtype=torch.uint8)
            head = self._read(ring, header, head, what)
            seq, size = _HEADER.unpack(header.numpy().tobytes())
            payload = tensor.detach().view(-1).view(torch.uint8)
            if seq != ring.received or size != payload.numel():
                raise RuntimeError(
                    f"rank {src} sent message {seq} of {size} bytes where this rank expected "
                    f"message {ring.received} of {payload.numel()}: the stages' schedules disagree"
                )
            self._read(ring, payload, head, what)
        finally:
            _in_flight = None

    def _read(self, ring: _Ring, part: torch.Tensor, head: int, what: str) -> int:
        done, n = 0, part.numel()
        while done < n:
            tail = self._wait(ring.tail_index, head + 1, ring.src, what)
            at = head % RING_BYTES
            size = min(n - done, tail - head, RING_BYTES - at)
            part[done : done + size].copy_(ring.data[at : at + size])
            done, head = done + size, head + size
            self._publish(ring.head_index, head)
        return head

    def close(self) -> None:
        """This rank leaves: peers waiting on it raise instead of waiting for the timeout. The
        segment stays mapped until the last tensor viewing it is gone (a torch.frombuffer
        tensor holds the map): a sending thread still copying never touches unmapped memory."""
        if self._closed:
            return
        self._closed = True
        self._publish(self.rank * _LINE // 8 + shared_memory._ABORT, 1)
        for ring in self._rings.values():  # whoever sleeps on a ring this rank shares
            shared_memory.futex_wake(self._address + 8 * ring.tail_index)
            shared_memory.futex_wake(self._address + 8 * ring.head_index)


def attach(
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    pairs: list[tuple[int, int]],
    timeout_s: float,
) -> SharedChannels | None:
    """Rings for `pairs` (sender, receiver: global ranks, the same list on every rank), mapped
    on every rank; None where shared memory cannot serve (shared_memory.map_shared), decided
    alike on every rank. Collective: every rank calls it."""
    size = _LINE * world_size + len(pairs) * (2 * _LINE + RING_BYTES)
    mapped = shared_memory.map_shared(rank=rank, world_size=world_size, device=device, size=size)
    if mapped is None:
        return None
    return SharedChannels(
        mapped, rank=rank, world_size=world_size, pairs=pairs, timeout_s=timeout_s
    )


def in_flight() -> list[dict[str, Any]]:
    """The receive this process waits in, if any (tracing.in_flight)."""
    return [dict(_in_flight)] if _in_flight is not None else []
