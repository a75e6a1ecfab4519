"""Data parallel's gradient all-reduce through shared memory, when every rank runs on one host's
CPU cores.

Gloo carries an all-reduce over TCP even between the processes of one machine. On a 2-core
machine its threads took ~3.5 ms of CPU a step on each rank (a quarter of a 2-engine DDP
step's CPU, on benchmarks/against_peers.py's integer-class job, read per thread from
/proc/PID/task) to push 6 MiB of gradients through loopback sockets, and the ranks waited for
each other's wake-ups. Here, for each of DDP's gradient buckets (a DDP communication hook:
`DistributedDataParallel.register_comm_hook`, torch's "DDP Communication Hooks" docs), each rank
writes its bucket divided by the world size (as DDP's default hook does before its all-reduce:
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py) into its slot of a shared segment;
all meet at a barrier; each sums 1/N of the slots, in rank order, into slot 0; all meet again;
each copies slot 0 back into its bucket. Every rank ends with the same numbers, each element
summed in the same order in every run. DeepSpeed reduces CPU tensors the same way
(deepspeed/ops/csrc/cpu/comm/shm.cpp). A bucket larger than a slot goes through in pieces.

The barrier: each rank writes a count into a cache line of its own and wakes whoever sleeps on
it; then it waits until every rank's count has reached its own, yielding its core for a few
microseconds (sched_yield), then asleep on the count's futex (futex(2), shared between the
processes that map the word), so that a waiting rank leaves its core free: spinning, it left
none, and the notebook's dashboard then took a core from a rank still computing, which the
other rank waited for too (0.93x throughput with the live dashboard against 1.02 on gloo).
One writer per count, after a locked instruction (a lock's acquire), which on x86-64 makes
the bucket's stores, non-temporal ones included, visible before the count; other
architectures order stores less strictly, so there gloo reduces.

Failures lose nothing. A rank that leaves the run (process_group.shutdown, also after an error
on that rank alone) sets its abort flag, which the others see in their wait and raise on; a rank
that dies is found by its pid; a wait longer than the run's collective timeout raises, as
gloo's would; and the notebook's interrupt reaches a waiting rank (the wait is Python). The
segment is unlinked as soon as every rank has mapped it, so nothing stays in /dev/shm once
mapped, however the processes end (one left by a rank 0 that died before unlinking it is
removed by the notebook: segments.py), and it is reserved with posix_fallocate, so a /dev/shm
too small for it fails at setup (the run then uses gloo), never with a SIGBUS mid-step.

Used when: CPU, more than one rank, every rank on one host (one boot id), x86-64 Linux, and
the ranks' threads no more than the cores they may use (a waiting rank wakes to check: on
oversubscribed cores it would take CPU from the rank it waits for). Each reduction is kept for
the run's traffic (engine/wire/traffic.py), as gloo's are by torch's flight recorder.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import os
import platform
import socket
import struct
import threading
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

from sagenb.engine.wire import segments

__all__ = [
    "DIED",
    "LEFT",
    "OP",
    "PeerLost",
    "SharedMemoryReduce",
    "attach",
    "abort_all",
    "in_flight",
    "recorded_since",
]

#: bytes of slots across the ranks in each of the two sets (a piece of a bucket fills one slot)
_SLOTS_BYTES = 8 * 2**20
_LINE = 64  # one cache line of header per rank: count, abort flag, pid
_COUNT, _ABORT, _PID = 0, 1, 2
#: sched_yields (~1 us each) before a waiting rank sleeps on the futex of a peer's count
_SPINS = 20
#: how often a sleeping rank wakes to check on its peers (abort flag, pid, timeout)
_CHECK_S = 0.05
#: futex(2) on x86-64: the syscall's number and operations (shared, not private: the words are
#: in memory other processes map)
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1
_EVERYONE = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _syscall() -> Any:
    """libc's syscall(2); a CDLL call releases the GIL while it waits. Loaded on first use:
    only where the path serves (x86-64 Linux)."""
    return ctypes.CDLL(None, use_errno=True).syscall


def _futex(address: int, op: int, value: int, timeout: _Timespec | None = None) -> None:
    """FUTEX_WAIT: sleep while the 32-bit word at `address` holds `value`, until woken or
    `timeout` (returns at once if the word already differs: no wake-up is lost between the
    look and the sleep); FUTEX_WAKE: wake up to `value` sleepers. Its errors (EAGAIN,
    ETIMEDOUT, EINTR) all mean: look again."""
    _syscall()(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        ctypes.c_int(op),
        ctypes.c_int(value),
        ctypes.byref(timeout) if timeout is not None else None,
        None,
        ctypes.c_int(0),
    )


#: this process's reductions not yet closed, held until they are: a rank whose step raised
#: drops its model (and with it the DDP hook's reducer) before process_group.shutdown runs,
#: and a reducer freed unclosed leaves its peers waiting on a rank that looks alive
_open: set[SharedMemoryReduce] = set()
#: this process's reductions (kind, time, bytes), as the flight recorder keeps gloo's
_record: collections.deque[dict[str, Any]] = collections.deque(maxlen=2000)
#: the reduction this process is in, as tracing.in_flight reports collectives; its name
OP = "shared_memory:all_reduce"
_in_flight: dict[str, Any] | None = None


class PeerLost(RuntimeError):
    """A rank left the run, died, or did not arrive within the timeout."""


#: what PeerLost says of a peer that left or died, which the notebook reads as a lost peer
#: (run/failures.py PEER_LOST): that peer's own error is the one to report
LEFT = "left the run during a gradient all-reduce"
DIED = "died during a gradient all-reduce"


class SharedMemoryReduce:
    """One run's segment on one rank; `hook` is DDP's communication hook."""

    def __init__(self, mapped: mmap.mmap, *, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._map = mapped
        header = _LINE * world_size
        self._words = memoryview(mapped)[:header].cast("q")
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        self._segment_address = whole.data_ptr()
        self._bytes = whole[header:]
        self._check = _Timespec(0, int(_CHECK_S * 1e9))
        self._slot = _slot_bytes(world_size)
        self._seq = 0
        self._piece = 0
        self._calls = 0
        self._closed = False
        self._fence = threading.Lock()
        _open.add(self)

    # -- the barrier -------------------------------------------------------------------------
    def _word(self, rank: int, field: int) -> int:
        return self._words[rank * _LINE // 8 + field]

    def _set(self, field: int, value: int) -> None:
        with self._fence:  # a locked instruction: the stores before it are seen first
            pass
        self._words[self.rank * _LINE // 8 + field] = value

    def _barrier(self) -> None:
        self._seq += 1
        seq = self._seq
        self._set(_COUNT, seq)
        _futex(self._address(self.rank), _FUTEX_WAKE, _EVERYONE)
        started = time.monotonic()
        for k in range(self.world_size):
            spins = 0
            while (seen := self._word(k, _COUNT)) < seq:
                spins += 1
                if spins <= _SPINS:
                    os.sched_yield()
                    continue
                # asleep, not spinning: the core is free for whatever else wants it (the
                # notebook's dashboard) instead of that taking the core of a rank still computing
                _futex(self._address(k), _FUTEX_WAIT, seen & 0x7FFFFFFF, self._check)
                if self._word(k, _COUNT) < seq:  # a timeout, a signal: is rank k still there?
                    self._check_peers(time.monotonic() - started)

    def _address(self, rank: int) -> int:
        """The address of `rank`'s count: its low 32 bits are a futex word (x86-64 is
        little-endian)."""
        return self._segment_address + rank * _LINE + 8 * _COUNT

    def _check_peers(self, waited_s: float) -> None:
        for k in range(self.world_size):
            if k == self.rank:
                continue
            if self._word(k, _ABORT):
                raise PeerLost(f"rank {k} {LEFT}")
            pid = self._word(k, _PID)
            if not _alive(pid):
                raise PeerLost(f"rank {k} (pid {pid}) {DIED}")
        if waited_s > self.timeout_s:
            late = [k for k in range(self.world_size) if self._word(k, _COUNT) < self._seq]
            raise PeerLost(
                f"ranks {late} did not reach the gradient all-reduce within the collective "
                f"timeout ({self.timeout_s:.0f} s)"
            )

    # -- the reduction -----------------------------------------------------------------------
    def _slots(self, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """Every rank's slot of the set the next piece uses, as `count` elements of `dtype`."""
        base = (self._piece % 2) * self._slot * self.world_size
        size = count * dtype.itemsize
        return [
            self._bytes[base + k * self._slot : base + k * self._slot + size].view(dtype)
            for k in range(self.world_size)
        ]

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (contiguous, on the CPU) replaced by its mean over the ranks, in place."""
        global _in_flight
        self._calls += 1
        _in_flight = {
            "op": OP,
            "seq": self._calls,
            "sizes": [list(tensor.shape)],
            "group": "shared memory",
        }
        try:
            self._reduce(tensor)
        finally:
            _in_flight = None
        nbytes = tensor.numel() * tensor.element_size()
        _record.append(
            {
                "kind": "all_reduce",
                "time_ns": time.time_ns(),
                "input_bytes": nbytes,
                "output_bytes": nbytes,
                "group": "shared memory",
                "default": False,
            }
        )
        return tensor

    def _reduce(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        step = self._slot // tensor.element_size()
        world, rank = self.world_size, self.rank
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            n = piece.numel()
            # two sets of slots, used in turn: a set is written again only after every rank
            # has passed the next piece's first barrier, so has copied this piece out
            slots = self._slots(piece.dtype, n)
            self._piece += 1
            torch.div(piece, world, out=slots[rank])
            self._barrier()
            lo, hi = rank * n // world, (rank + 1) * n // world
            mine = slots[0][lo:hi]
            for k in range(1, world):
                mine.add_(slots[k][lo:hi])
            self._barrier()
            piece.copy_(slots[0])

    def hook(self, _state, bucket):  # noqa: ANN001, ANN201 - see below
        """DDP's communication hook (bucket: a dist.GradBucket): the bucket's mean, computed
        before it returns a completed torch.futures.Future. Unannotated: DDP checks the
        annotations it finds against its own types, and this module's are strings."""
        done = torch.futures.Future()
        done.set_result(self.all_reduce_mean(bucket.buffer()))
        return done

    def close(self) -> None:
        """This rank leaves: peers waiting on it raise instead of waiting for the timeout."""
        if self._closed:
            return
        self._closed = True
        self._set(_ABORT, 1)
        _futex(self._address(self.rank), _FUTEX_WAKE, _EVERYONE)  # those waiting on this rank
        _open.discard(self)
        self._words.release()
        del self._bytes  # the tensor's view of the map, before the map closes
        try:
            self._map.close()
        except BufferError:  # a slot's tensor still referenced (a traceback): freed with it
            pass


def attach(
    *, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> SharedMemoryReduce | None:
    """This run's shared segment, mapped on every rank; None where it cannot serve (see the
    module docstring), decided alike on every rank. Collective: every rank calls it."""
    if device.type != "cpu" or world_size < 2:
        return None
    facts: list[Any] = [None] * world_size
    dist.all_gather_object(facts, (_host(), _can_serve(world_size)))
    if not all(ok for _, ok in facts) or len({host for host, _ in facts}) != 1:
        return None
    size = _LINE * world_size + 2 * _slot_bytes(world_size) * world_size
    path = [_create(size) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    mapped = _map(path[0], size) if path[0] is not None else None
    if mapped is not None:  # before any rank can wait on this one: its pid says it lives
        struct.pack_into("q", mapped, rank * _LINE + 8 * _PID, os.getpid())
    mapped_everywhere: list[Any] = [None] * world_size
    dist.all_gather_object(mapped_everywhere, mapped is not None)
    if rank == 0 and path[0] is not None:
        os.unlink(path[0])  # every rank that could map it has: nothing left behind
    if all(mapped_everywhere):
        assert mapped is not None
        # every peer's process is one this rank can see, as the check that finds a dead peer
        # needs (engines in containers of their own that share /dev/shm see other pids)
        pids = [struct.unpack_from("q", mapped, k * _LINE + 8 * _PID)[0] for k in range(world_size)]
        dist.all_gather_object(mapped_everywhere, all(_alive(pid) for pid in pids))
        if all(mapped_everywhere):
            return SharedMemoryReduce(mapped, rank=rank, world_size=world_size, timeout_s=timeout_s)
    if mapped is not None:
        mapped.close()
    return None


def abort_all() -> None:
    """Leave every run this process is in (process_group.shutdown)."""
    for reducer in list(_open):
        reducer.close()


def in_flight() -> list[dict[str, Any]]:
    """The reduction this process is in, if any, as tracing.in_flight reports collectives
    (a stalled run names what its waiting ranks wait in: run/stacks.py)."""
    return [dict(_in_flight)] if _in_flight is not None else []


def recorded_since(since_ns: int) -> list[dict[str, Any]]:
    """This process's shared-memory reductions at or after `since_ns`, as traffic.py reports
    collectives."""
    return [dict(r) for r in _record if r["time_ns"] >= since_ns]


def _slot_bytes(world_size: int) -> int:
    return max(2**16, _SLOTS_BYTES // world_size // _LINE * _LINE)


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _can_serve(world_size: int) -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not os.path.isdir("/dev/shm"):
        return False
    return torch.get_num_threads() * world_size <= len(os.sched_getaffinity(0))


def _create(size: int) -> str | None:
    path = segments.new_path(os.getpid())  # its pid: a dead creator's is removed (segments.py)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS when a page is first touched
        return path
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _map(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: its parent has not reaped it yet), read
    with psutil as the pool's watchers read their processes (pool/reaper.py)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):  # gone, or not a process this one can see
        return False
