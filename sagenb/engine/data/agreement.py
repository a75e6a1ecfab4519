"""Every rank reads the same stream: the first global batches' items, fingerprinted on each rank
and compared across the ranks before they train on them.

The contract (data/stream.py, docs/contract.md) has every engine read the whole stream and keep
its share of each global batch itself. A stream that shards itself by rank (it yields every
other item by `torch.distributed.get_rank()` in `__iter__`, a common pattern written for
loaders that do not shard) breaks it without an error: each rank keeps its share of global
batches no process reads, the run trains half its steps, and nothing says so. A stream that
shuffles with an unseeded generator does the same. So the first `CHECKED_STEPS` global batches
are fingerprinted on every rank (a 64-bit BLAKE2b digest of each item's values: tensors by
dtype, shape and up to `SAMPLED` of their elements, evenly spaced; text, numbers and containers
whole) and the digests all-gathered on the run's process group; a rank whose digest differs
from rank 0's stops every rank, naming the fix.

The cost is paid at the first steps only, then never again: one all-gather of 8 bytes per
rank and the hashing of one global batch's items, per checked step. On the 2-core test machine
(benchmarks/stream_agreement.py) a check took 2.6 ms on a rank (median of 28, the wait for the
other rank included; 16 items of (8,) floats), the first two steps 7.2 ms with it and 5.8 ms
without (medians of 7, within the load's noise); hashing 64 (3, 224, 224) images takes 6-10 ms
and 32 records of 512 token ids 2-4 ms, once per checked step.

Items of a type it does not know are fingerprinted by type name alone: their repr may hold an
address, which differs across processes for equal items.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from sagenb.config.job import JobError
from sagenb.engine.data.order import Step

__all__ = ["CHECKED_STEPS", "SAMPLED", "fingerprint", "checked", "differing_ranks"]

#: global batches compared across the ranks, from the run's first
CHECKED_STEPS = 2
#: elements of a tensor or array that its fingerprint reads at most, evenly spaced
SAMPLED = 4096
#: element types a list is fingerprinted by its repr for (exact, and the same in every process)
_PLAIN = (int, float, bool, str)
#: how deep containers (tuples, dicts, a dataclass's fields) are followed
_DEPTH = 6


def fingerprint(items: list[Any]) -> int:
    """A 64-bit digest of `items`' values, the same in every process for equal items."""
    digest = hashlib.blake2b(digest_size=8)
    for item in items:
        _update(digest, item, _DEPTH)
    return struct.unpack("<q", digest.digest())[0]


def _update(digest: Any, value: Any, depth: int) -> None:
    digest.update(type(value).__qualname__.encode())
    if isinstance(value, torch.Tensor):
        digest.update(_tensor_bytes(value))
    elif isinstance(value, (str, bytes, bytearray, int, float, complex, bool)) or value is None:
        digest.update(value.encode() if isinstance(value, str) else repr(value).encode())
    elif depth <= 0:
        return
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            _update(digest, key, depth - 1)
            _update(digest, value[key], depth - 1)
    elif isinstance(value, (list, tuple)) and all(type(e) in _PLAIN for e in value):
        digest.update(repr(value).encode())  # token ids: one repr, not one update per id
    elif isinstance(value, (list, tuple)):
        for element in value:
            _update(digest, element, depth - 1)
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        digest.update(_array_bytes(value))
    elif hasattr(value, "__dict__"):  # a dataclass or a plain record object
        _update(digest, vars(value), depth - 1)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """dtype, shape and up to SAMPLED evenly spaced elements' bytes."""
    head = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    if tensor.is_meta or tensor.layout != torch.strided or tensor.numel() == 0:
        return head
    flat = tensor.detach().reshape(-1)
    sample = (
        flat
        if flat.numel() <= SAMPLED
        else torch.cat([flat[:: flat.numel() // SAMPLED], flat[-1:]])
    )
    try:
        return head + sample.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # a dtype without plain bytes (quantized): shape alone
        return head


def _array_bytes(array: Any) -> bytes:
    """A numpy array or scalar as a tensor: dtype, shape and sampled elements (an object
    array's elements are pointers, different in each process: its dtype and shape only)."""
    head = f"{array.dtype}{tuple(array.shape)}".encode()
    if array.dtype.hasobject:
        return head
    flat = array.reshape(-1)
    sample = flat if flat.size <= SAMPLED else flat[:: flat.size // SAMPLED]
    return head + sample.tobytes() + flat[-1:].tobytes()


def differing_ranks(digests: list[int]) -> list[int]:
    """The ranks whose digest is not rank 0's."""
    return [rank for rank, d in enumerate(digests) if d != digests[0]]


def checked(plan: Iterator[Step], source: Any, *, name: str = "dataset") -> Iterator[Step]:
    """`plan`'s steps, the first CHECKED_STEPS compared across the ranks before they are
    handed on (nothing to compare in one process, or without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        yield from plan
        return
    for checked_so_far, step in enumerate(plan):
        if checked_so_far < CHECKED_STEPS:
            _compare(step, [source[p] for p in step.indices.tolist()], name)
        yield step


def _compare(step: Step, items: list[Any], name: str) -> None:
    """All-gather this rank's digest of the step's items; raise on every rank when one differs."""
    # the default group's backend decides where its tensors live: nccl's on this rank's GPU
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.tensor([fingerprint(items)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # all_gather_into_tensor is deprecated in torch 2.13
    others = differing_ranks([int(d) for d in gathered])
    if others:
        raise JobError(_refusal(name, step, others))


def _refusal(name: str, step: Step, ranks: list[int]) -> str:
    first = int(step.indices[0])
    which = ", ".join(map(str, ranks))
    return (
        f"{name}: the stream reads differently on rank {which} than on rank 0 (the items of "
        f"global batch {step.number}, {first} to {first + len(step.indices) - 1} of the stream, "
        "differ), as a stream does that shards itself by torch.distributed.get_rank() (or "
        "get_worker_info()) or shuffles without a fixed seed: yield every item on every rank; "
        "sagenb keeps each rank's share itself (docs/contract.md)"
    )
