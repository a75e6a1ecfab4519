"""Data parallel's shared-memory all-reduce (engine/wire/shared_memory.py) between two real
processes on a real gloo group: exact means, identical on every rank, in pieces larger than a
slot; a peer that leaves or dies is reported, not waited for; nothing stays in /dev/shm."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sagenb.engine.wire import segments, shared_memory
from sagenb.engine.wire.shared_memory import PeerLost

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not os.path.isdir("/dev/shm"),
    reason="the shared-memory path serves x86-64 Linux only",
)


def _ranks(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        _scenarios(rank, Path(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attach(rank: int) -> shared_memory.SharedMemoryReduce:
    reducer = shared_memory.attach(
        rank=rank, world_size=2, device=torch.device("cpu"), timeout_s=60
    )
    assert reducer is not None, "2 one-thread ranks on one x86-64 host: shared memory serves"
    return reducer


def _scenarios(rank: int, out: Path) -> None:
    since = time.time_ns()
    reducer = _attach(rank)
    # what each rank holds: float32 over 2.5 slots (3 pieces), bfloat16, and float64
    slot = shared_memory._slot_bytes(2) // 4
    for dtype, n in ((torch.float32, 5 * slot // 2), (torch.bfloat16, 1000), (torch.float64, 7)):
        mine = [
            torch.randn(n, generator=torch.Generator().manual_seed(k)).to(dtype) for k in (0, 1)
        ]
        got = reducer.all_reduce_mean(mine[rank].clone())
        # DDP's default hook divides by the world size before it sums
        assert torch.equal(got, mine[0] / 2 + mine[1] / 2), dtype
        everywhere = [torch.empty_like(got) for _ in range(2)]
        dist.all_gather(everywhere, got)
        assert torch.equal(everywhere[0], everywhere[1])  # the same bits on both ranks
    sizes = [r["input_bytes"] for r in shared_memory.recorded_since(since)]
    assert sizes == [5 * slot // 2 * 4, 2000, 56], sizes

    # a rank waiting for a late one sleeps (a futex), leaving its core to other work
    if rank == 1:
        time.sleep(1.0)
    cpu, wall = time.process_time(), time.monotonic()
    reducer.all_reduce_mean(torch.ones(10))
    if rank == 0:
        (out / "waited").write_text(f"{time.process_time() - cpu} {time.monotonic() - wall}")

    # a rank that leaves (its process group shut down) releases the one waiting on it
    if rank == 1:
        shared_memory.abort_all()
    else:
        started = time.monotonic()
        with pytest.raises(PeerLost, match="rank 1 left the run"):
            reducer.all_reduce_mean(torch.ones(10))
        (out / "left_s").write_text(str(time.monotonic() - started))
    dist.barrier()

    # a rank that dies mid-run: the other says so instead of waiting out the timeout
    reducer = _attach(rank)
    if rank == 1:
        dist.destroy_process_group()
        os._exit(0)
    started = time.monotonic()
    with pytest.raises(PeerLost, match=r"rank 1 \(pid \d+\) died"):
        reducer.all_reduce_mean(torch.ones(10))
    (out / "died_s").write_text(str(time.monotonic() - started))


def test_exact_means_and_peers_that_leave_or_die(tmp_path):
    before = set(Path("/dev/shm").glob("sagenb-*"))
    mp.spawn(_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    # both were noticed within the waiting rank's checks (every 0.05 s), not a timeout (60 s)
    assert float((tmp_path / "left_s").read_text()) < 5
    assert float((tmp_path / "died_s").read_text()) < 5
    cpu, wall = map(float, (tmp_path / "waited").read_text().split())
    # ~1 s waited; a spinning wait would use ~1 s of CPU, a sleeping one ~1 ms (its checks
    # every 0.05 s); 0.2 s leaves room for a loaded machine's slower checks
    assert wall > 0.5 and cpu < 0.2, (cpu, wall)
    assert set(Path("/dev/shm").glob("sagenb-*")) == before  # unlinked once mapped


def test_oversubscribed_cores_keep_gloo():
    """A rank waiting on an oversubscribed core would take CPU from the rank it waits for."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert shared_memory._can_serve(cores)
        assert not shared_memory._can_serve(cores + 1)
        torch.set_num_threads(2)
        assert not shared_memory._can_serve(cores)
    finally:
        torch.set_num_threads(threads)


def test_only_segments_of_creators_gone_are_removed(tmp_path):
    """By the pid in the name: a segment of a process that has exited goes; one of a running
    process, a file of another name, and what is not a regular file stay."""
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    dead = Path(segments.new_path(gone.pid)).name
    live = Path(segments.new_path(os.getpid())).name
    for name in (dead, live, "sagenb-run.lock", f"sagenb-{gone.pid}-xyz"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    folder = Path(segments.new_path(gone.pid)).name
    (tmp_path / folder).mkdir()
    assert segments.creator(dead) == gone.pid and segments.creator("sagenb-run.lock") is None
    assert segments.remove_orphans(str(tmp_path)) == [str(tmp_path / dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live, "sagenb-run.lock", f"sagenb-{gone.pid}-xyz", folder]
    )
    assert segments.remove_orphans(str(tmp_path / "missing")) == []
