"""The contract's sample order, the slice of each global batch that one engine loads, and the
eval set's batches (in order, made as they are needed: `eval_batches`).

Epoch e visits the dataset in the order randperm(len(dataset), seed + e), in global batches of
`batch_size` consecutive samples; the incomplete last batch is dropped. Every strategy uses this
one plan, which is why every strategy trains the same model as a single process.

Above EAGER_MAX samples (2**22) the order is `FeistelOrder` instead: the same kind of order (a
pseudo-random permutation of range(n) drawn from seed + e) computed per position, so a run
holds only the indices of the steps it runs. torch.randperm(n) builds all n indices as int64
(8 bytes each) before the first step: 8 GB and minutes for 10**9 samples (sagenb issue 19), on
every engine. 2**22 keeps randperm, and so every earlier result, for ordinary datasets
(ImageNet-1k's 1,281,167 images among them) while its order stays at most 32 MiB and builds in
well under a second (benchmarks/results/measured_in_code.md), so no progress needs showing
while an epoch's order is built.

The lazy order is a balanced Feistel network (Luby & Rackoff 1988: a permutation from any round
function) on the 2h-bit integers, h = ceil(bits(n - 1) / 2), with cycle-walking (Black &
Rogaway, "Ciphers with arbitrary finite domains", CT-RSA 2002): position i maps to the first of
f(i), f(f(i)), ... that is below n, which is a permutation of range(n) since f permutes the
larger domain (each cycle that holds a value below n walks back to it). The domain is under 4n,
so a position takes under 4 walks on average. Exactly, with every value an unsigned integer:

    keys: s = (seed + e) mod 2**64; six times: s = splitmix64 step of s, k_r = its top 32 bits
    round r: (L, R) -> (R, L xor (hash32(R xor k_r) mod 2**h)), L the high and R the low h bits
    hash32(x): x = (x xor x >> 16) * 0x45d9f3b mod 2**32, twice, then x xor x >> 16

(splitmix64: Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA
2014; hash32: the integer hash of T. Mueller, https://stackoverflow.com/a/12996028.) Every
product stays below 2**63, so torch's int64 arithmetic computes it exactly on every engine and
platform, and tests/reference.py recomputes it in plain Python integers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate

from sagenb.config.job import JobError
from sagenb.engine.data.collation import Collate, collate_samples

__all__ = [
    "Step",
    "FeistelOrder",
    "epoch_order",
    "plan_steps",
    "total_steps",
    "eval_batches",
    "fetch",
    "collated",
]


@dataclass(frozen=True)
class Step:
    """One optimizer step: its number (1-based, across epochs), epoch and global batch indices
    (a stream's: positions in the stream, data/stream.py)."""

    number: int
    epoch: int
    indices: torch.Tensor
    #: the steps the run makes, as known when this step was planned: a stream's is --steps (or
    #: None) until its end is read, then the last step's number
    total: int | None


#: the largest dataset whose order is torch.randperm (see the module's docstring)
EAGER_MAX = 2**22
#: the largest dataset the lazy order handles: its 2h-bit values must fit in int64
LAZY_MAX = 2**62
ROUNDS = 6
_M32, _M64 = 2**32 - 1, 2**64 - 1


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor | FeistelOrder:
    """Epoch `epoch`'s order of range(n): a tensor up to EAGER_MAX samples, else computed per
    position. Either is sliced, order[a:b], into a tensor of indices."""
    if n <= EAGER_MAX:
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return FeistelOrder(n, seed + epoch)


class FeistelOrder:
    """A pseudo-random permutation of range(n), computed only at the positions asked for."""

    def __init__(self, n: int, seed: int) -> None:
        if not 0 < n <= LAZY_MAX:
            raise JobError(f"dataset has {n} samples: sagenb orders at most 2**62")
        self.n = n
        self.half = (max(1, (n - 1).bit_length()) + 1) // 2
        self.keys = round_keys(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, where: slice) -> torch.Tensor:
        start, stop, step = where.indices(self.n)
        return self.at(torch.arange(start, stop, step, dtype=torch.int64))

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The values at `positions` (int64, each in range(n)): cycle-walk until below n."""
        x = feistel(positions, self.keys, self.half)
        out = x >= self.n
        while bool(out.any()):
            x[out] = feistel(x[out], self.keys, self.half)
            out = x >= self.n
        return x


def round_keys(seed: int) -> list[int]:
    """ROUNDS 32-bit keys: the top halves of successive splitmix64 outputs from `seed`."""
    state, keys = seed & _M64, []
    for _ in range(ROUNDS):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        keys.append((z ^ (z >> 31)) >> 32)
    return keys


def feistel(x: torch.Tensor, keys: list[int], half: int) -> torch.Tensor:
    """The balanced Feistel network on 2 * half-bit integers (a permutation of them)."""
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for key in keys:
        left, right = right, left ^ (_hash32(right ^ key) & mask)
    return (left << half) | right


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """T. Mueller's 32-bit integer hash; x < 2**32, so each product stays below 2**59."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def total_steps(n: int, *, batch_size: int, epochs: int, steps: int | None) -> int:
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise JobError(
            f"dataset has {n} samples, fewer than one global batch (--batch-size {batch_size}): "
            "lower --batch-size or enlarge the dataset"
        )
    return min(per_epoch * epochs, steps) if steps is not None else per_epoch * epochs


def plan_steps(
    n: int, *, batch_size: int, epochs: int, steps: int | None, seed: int, start_after: int = 0
) -> Iterator[Step]:
    """The steps of the run, from step start_after + 1 on (resuming from a checkpoint)."""
    total = total_steps(n, batch_size=batch_size, epochs=epochs, steps=steps)
    per_epoch = n // batch_size
    order, built = None, -1
    # straight to step start_after + 1: no order is built, nor any index computed, for the
    # steps and epochs before it
    for number in range(start_after + 1, total + 1):
        epoch, b = divmod(number - 1, per_epoch)
        if epoch != built:
            order, built = epoch_order(n, seed, epoch), epoch
        assert order is not None  # built at the first step: its epoch (>= 0) is not -1
        yield Step(number, epoch, order[b * batch_size : (b + 1) * batch_size], total)


def eval_batches(n: int, size: int, *, parts: int = 1, part: int = 0) -> Iterator[torch.Tensor]:
    """Part `part` of range(n) cut into `parts` contiguous parts, in order, `size` indices at a
    time (the last batch shorter). Cut as torch.tensor_split cuts, the first n % parts parts one
    longer, so each batch is the one evaluation took from tensor_split(arange(n), parts) before;
    but only one batch's indices exist at a time: the arange held 8 bytes per eval sample on
    every engine before the first was evaluated (8 GB for 10**9)."""
    base, longer = divmod(n, parts)
    start = part * base + min(part, longer)
    stop = start + base + (1 if part < longer else 0)
    for first in range(start, stop, size):
        yield torch.arange(first, min(first + size, stop))


def fetch(
    dataset: Any, indices: torch.Tensor, collate_fn: Collate | None = None, parts: int = 1
) -> Any:
    """Load and collate the samples at `indices` (a stream's: positions, data/stream.py): in
    the training thread, or in a --data-workers process (loader.py). A TensorDataset without
    a collate_fn is indexed in one go; other samples are collated by `collated`."""
    if collate_fn is None and isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    return collated([dataset[i] for i in indices.tolist()], collate_fn, parts)


def collated(samples: list[Any], collate_fn: Collate | None = None, parts: int = 1) -> Any:
    """The batch of `samples`: by the cell's collate_fn, in `parts` runs collated one by one
    (a pipeline's microbatches, data/collation.py); without one, by default_collate."""
    if collate_fn is not None:
        return collate_samples(samples, collate_fn, parts)
    try:
        return default_collate(samples)
    except RuntimeError as err:
        if "stack expects each tensor to be equal size" not in str(err):
            raise
        raise JobError(
            f"the samples cannot be stacked into a batch: their tensors differ in shape "
            f"({err}). Define collate_fn(samples) -> batch that pads them to one length "
            f"(transformers' DataCollatorWithPadding(tokenizer) does, with an attention_mask), "
            f"or give samples of one shape"
        ) from None


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
