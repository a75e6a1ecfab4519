"""The torch.distributed process group of one training run on one engine."""

from __future__ import annotations

import gc
from datetime import timedelta

import torch
import torch.distributed as dist

from sagenb.engine.torch_private import forget_failed_init
from sagenb.engine.wire import shared_memory
from sagenb.engine.wire.rendezvous import use_interface
from sagenb.engine.wire.stopping import StopWatch

__all__ = [
    "init_process_group",
    "new_segment",
    "end_segment",
    "shutdown",
    "pick_device",
    "stop_requested",
]

_store: dist.TCPStore | None = None
_stop_watch: StopWatch | None = None


def pick_device(local_rank: int, local_size: int) -> torch.device:
    """One CUDA device per engine when its host has one for each of its engines, else the
    CPU; `local_rank` is the engine's position among the run's engines on its host."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_size:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(
    *,
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    timeout_s: float,
    device: torch.device,
    token: str = "",
) -> None:
    """nccl when every engine has its own CUDA device, gloo otherwise.

    The rendezvous store is hosted by the notebook (run/training_run.py), already listening
    before any engine connects: with rank 0 hosting it, the other ranks could arrive first and
    back off for ~0.5 s before retrying. `token` is the run's own, which every stop message carries
    (stopping.py).
    """
    if dist.is_initialized():  # a previous run on this engine died before cleaning up
        shutdown()
    # an init_process_group that raised here (a peer's address garbled in the store, a bad
    # gloo setting) left torch numbering the next group 1 where a fresh engine says 0: the
    # ranks would wait for each other under different store keys until --timeout
    forget_failed_init()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    use_interface(addr)  # gloo/nccl talk on the interface that reaches the store
    global _store, _stop_watch
    store = _store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    _stop_watch = StopWatch(
        store,
        addr=addr,
        port=port,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        token=token,
    )


def new_segment(
    *, rank: int, world_size: int, addr: str, port: int, timeout_s: float, token: str
) -> None:
    """The kept run's group goes on for another segment (--continue): its stop requests carry
    this segment's token (stopping.py); the group and its store are the kept run's."""
    global _stop_watch
    if _store is None or not dist.is_initialized():
        raise RuntimeError("no process group is kept on this engine")
    _stop_watch = StopWatch(
        _store,
        addr=addr,
        port=port,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        token=token,
    )


def end_segment() -> None:
    """The run ended keeping its state: its stop watch ends, its group and store stay up for
    the next segment (engine/live/kept.py releases them)."""
    global _stop_watch
    watch, _stop_watch = _stop_watch, None
    if watch is not None:
        watch.close()


def shutdown() -> None:
    """Destroy the process group; peers blocked in a collective then fail within about a second.

    Collect garbage first: a traceback or tensor still holding the group keeps its sockets open
    (observed on this project's CI machine: benchmarks/results/measured_in_code.md).
    """
    global _store, _stop_watch
    watch, _store, _stop_watch = _stop_watch, None, None
    shared_memory.abort_all()  # peers waiting in a shared-memory reduction raise
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_failed_init()  # also after an init that raised, which leaves no group to destroy
    if watch is not None:  # after the peers are released
        watch.close()


def stop_requested(step: int) -> bool:
    """Whether every rank is to stop after `step` (stopping.py)."""
    return _stop_watch is not None and _stop_watch.should_stop(step)
