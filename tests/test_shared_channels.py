"""A pipeline's sends and receives through shared memory (engine/wire/shared_channels.py)
between two real processes on a real gloo group: the same bits arrive, in order, through a ring
smaller than the message and across its wrap-around; a message out of order is refused; a peer
that leaves or dies is reported, not waited for; nothing stays in /dev/shm."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sagenb.engine.wire import shared_channels, shared_memory
from sagenb.engine.wire.shared_memory import PeerLost

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not os.path.isdir("/dev/shm"),
    reason="the shared-memory path serves x86-64 Linux only",
)

PAIRS = [(0, 1), (1, 0)]


def _ranks(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        _scenarios(rank, Path(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attach(rank: int) -> shared_channels.SharedChannels:
    channels = shared_channels.attach(
        rank=rank, world_size=2, device=torch.device("cpu"), pairs=PAIRS, timeout_s=60
    )
    assert channels is not None, "2 one-thread ranks on one x86-64 host: shared memory serves"
    return channels


def _messages() -> list[torch.Tensor]:
    """Odd sizes (the ring's positions then wrap inside a message) and every dtype a stage
    sends, three times round (the counters pass the ring's size): 1.3 MiB, which a ring holds
    whole, so both ranks may send all of it before either receives."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(n, generator=g) for n in (1, 333, 100_003)]
    out.append(torch.randn(3, 7, generator=g).to(torch.bfloat16))
    out.append(torch.randint(0, 2**40, (1001,), generator=g))
    out.append(torch.rand(999, generator=g) > 0.5)
    return out * 3


def _scenarios(rank: int, out: Path) -> None:
    channels = _attach(rank)
    peer = 1 - rank
    # both directions at once, each rank's messages its own
    mine = [t if rank == 0 else t.flip(-1) for t in _messages()]
    theirs = [t if rank == 1 else t.flip(-1) for t in _messages()]
    for tensor in mine:
        channels.send(tensor, peer)
    for expected in theirs:
        buffer = torch.empty_like(expected)
        channels.recv(buffer, peer)
        assert torch.equal(buffer, expected)
    # a message of 2.5 rings passes in pieces while the receiver reads
    big = torch.randn(
        5 * shared_channels.RING_BYTES // 2 // 4, generator=torch.Generator().manual_seed(1)
    )
    if rank == 0:
        channels.send(big, 1)
    else:
        buffer = torch.empty_like(big)
        channels.recv(buffer, 0)
        assert torch.equal(buffer, big)
    dist.barrier()

    # a receiver expecting another size raises instead of reading the wrong bytes
    if rank == 0:
        channels.send(torch.ones(10), 1)
    else:
        with pytest.raises(RuntimeError, match=r"message \d+ of 40 bytes where this rank expected"):
            channels.recv(torch.empty(11), 0)
    dist.barrier()
    channels.close()
    dist.barrier()

    # a receiver waiting for a late sender sleeps (a futex), leaving its core to other work
    channels = _attach(rank)
    if rank == 0:
        time.sleep(1.0)
        channels.send(torch.ones(10), 1)
    else:
        cpu, wall = time.process_time(), time.monotonic()
        channels.recv(torch.empty(10), 0)
        (out / "waited").write_text(f"{time.process_time() - cpu} {time.monotonic() - wall}")

    # a rank that leaves (its process group shut down) releases the one waiting on it
    if rank == 1:
        shared_memory.abort_all()
    else:
        started = time.monotonic()
        with pytest.raises(PeerLost, match="rank 1 left the run while this one waited"):
            channels.recv(torch.empty(10), 1)
        (out / "left_s").write_text(str(time.monotonic() - started))
    dist.barrier()

    # a rank that dies mid-run: the other says so instead of waiting out the timeout
    channels = _attach(rank)
    if rank == 1:
        dist.destroy_process_group()
        os._exit(0)
    started = time.monotonic()
    with pytest.raises(PeerLost, match=r"rank 1 \(pid \d+\) died while this one waited"):
        channels.recv(torch.empty(10), 1)
    (out / "died_s").write_text(str(time.monotonic() - started))


def test_exact_bytes_in_order_and_peers_that_leave_or_die(tmp_path):
    before = set(Path("/dev/shm").glob("sagenb-*"))
    mp.spawn(_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    # both were noticed within the waiting rank's checks (every 0.05 s), not a timeout (60 s)
    assert float((tmp_path / "left_s").read_text()) < 5
    assert float((tmp_path / "died_s").read_text()) < 5
    cpu, wall = map(float, (tmp_path / "waited").read_text().split())
    # ~1 s waited; a spinning wait would use ~1 s of CPU, a sleeping one ~1 ms; 0.2 s leaves
    # room for a loaded machine's slower checks (as test_shared_memory.py's bound)
    assert wall > 0.5 and cpu < 0.2, (cpu, wall)
    assert set(Path("/dev/shm").glob("sagenb-*")) == before  # unlinked once mapped
