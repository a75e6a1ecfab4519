"""The torch.distributed process group of one training run on one engine."""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from sagenb.engine.rendezvous import use_interface

__all__ = ["init_process_group", "shutdown", "pick_device", "stop_requested", "STOP_KEY"]

#: set by the notebook in the run's store when the user interrupts
STOP_KEY = "sagenb/stop_requested"
#: set by rank 0 once it sees STOP_KEY: every rank stops after this step
_STOP_AT = "sagenb/stop_after_step"
_store: dist.TCPStore | None = None
_request_checked = 0.0


def pick_device(local_rank: int, local_size: int) -> torch.device:
    """One CUDA device per engine when its host has one for each of its engines, else the
    CPU; `local_rank` is the engine's position among the run's engines on its host."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_size:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(
    *, rank: int, world_size: int, addr: str, port: int, timeout_s: float, device: torch.device
) -> None:
    """nccl when every engine has its own CUDA device, gloo otherwise.

    The rendezvous store is hosted by the notebook (session.py), already listening before any
    engine connects: with rank 0 hosting it, the other ranks could arrive first and back off
    for ~0.5 s before retrying.
    """
    if dist.is_initialized():  # a previous run on this engine died before cleaning up
        shutdown()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    use_interface(addr)  # gloo/nccl talk on the interface that reaches the store
    global _store
    store = _store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def shutdown() -> None:
    """Destroy the process group; peers blocked in a collective then fail within about a second.

    Collect garbage first: a traceback or tensor still holding the group keeps its sockets open
    (measured in ../shared/FACTS.md, "Failures").
    """
    global _store
    _store = None
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def stop_requested(step: int, rank: int) -> bool:
    """Whether every rank is to stop after `step`, so that all stop after the same step.

    Rank 0, seeing the notebook's request after step s, fixes the last step at s + 1. No rank
    can have finished step s + 1 yet: each step ends in collectives that need rank 0, which has
    not started it. So every rank reads the decision at or before its boundary after s + 1.
    One look-up in the notebook's store per step (~0.1 ms on loopback); rank 0 adds one for
    the request at most every 50 ms.
    """
    global _request_checked
    if _store is None:
        return False
    now = time.monotonic()  # rank 0 looks for the request at most every 50 ms
    if rank == 0 and now - _request_checked > 0.05:
        _request_checked = now
        if _store.check([STOP_KEY]) and not _store.check([_STOP_AT]):
            _store.set(_STOP_AT, str(step + 1))
    return _store.check([_STOP_AT]) and step >= int(_store.get(_STOP_AT))
