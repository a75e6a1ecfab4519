"""Streams: a dataset without random access (a torch `IterableDataset`, a Hugging Face
`datasets.IterableDataset` such as `load_dataset(..., streaming=True)`, any iterable without
`__len__`), read in order.

The contract for a stream (docs/contract.md): epoch e reads `iter(dataset)` from its start (after
`dataset.set_epoch(e)` where the dataset has it, which reseeds a Hugging Face shuffle buffer), and
global batch k of the epoch holds items k*B to (k+1)*B - 1; an incomplete last batch is dropped.
Shuffling is the stream's own business. Each engine trains on its share of each global batch,
exactly as for map-style data (`strategy.local_indices`).

Every engine reads the whole stream and keeps the items of its share, as one process would read
it: so every engine sees the same end, and the run stops at the same step everywhere, however the
stream's shards divide by the engines (uneven shards per rank hang DDP or duplicate samples when
each rank reads its own shards: huggingface/datasets #6437, #6623). The price is that reading is
repeated on every engine, as `datasets.distributed.split_dataset_by_node` also does when the
shards do not divide by the ranks; collation (the collate_fn), which usually costs more, is done
only for the engine's share.

`StreamSource` gives the rest of sagenb a map-style face over the stream: `source[p]` is the item
at position p, positions counting every item read across epochs (the dropped remainder of an
epoch included), so that a step's batch is a tensor of positions like a map-style step's, and
`fetch`, `collate`, `local_indices` and the pipeline's probes work unchanged. Only a window of
items is held: those of the step being loaded, one step ahead (to know whether the stream ends
there), and the few the checks before the first step read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from sagenb.config.job import JobError
from sagenb.engine.data.order import Step

__all__ = ["is_stream", "as_source", "readable", "StreamSource", "ReadOnce", "stream_steps"]


def is_stream(data: Any) -> bool:
    """A torch IterableDataset, or any iterable without __len__ (a Hugging Face
    IterableDataset has a __getitem__ of columns but no __len__)."""
    return isinstance(data, IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__len__")
    )


def as_source(name: str, data: Any) -> Any:
    """What sagenb reads `name` through: a map-style dataset as it is; a training stream as a
    StreamSource, an eval stream as ReadOnce; anything else is refused before any step."""
    if is_stream(data):
        return StreamSource(data, name=name) if name == "dataset" else ReadOnce(data)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return data
    raise JobError(
        f"{name} must be a map-style Dataset (with __len__ and __getitem__) or a stream (an "
        f"iterable: a torch IterableDataset, a datasets.IterableDataset); it is a "
        f"{type(data).__module__}.{type(data).__qualname__}, which is neither"
    )


def readable(dataset: Any, n: int) -> int:
    """How many of the first n samples exist: of a stream, read up to n to know."""
    return dataset.readable(n) if isinstance(dataset, StreamSource) else min(n, len(dataset))


class StreamSource:
    """The cell's stream, read forward across epochs, indexed by position (the module's
    docstring). `next_batch` advances the plan; `source[p]` reads up to p when needed."""

    def __init__(self, stream: Any, *, name: str = "dataset") -> None:
        self.stream, self.name = stream, name
        self.items: dict[int, Any] = {}
        #: how many items have been read, all epochs together (the next item's position)
        self.read = 0
        self.epoch = -1
        self.first_epoch_items = 0
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)
        self.epoch, self.begin, self.next = epoch, self.read, self.read
        self.it: Iterator[Any] | None = iter(self.stream)

    def _read_to(self, stop: int) -> None:
        """Read items until position stop - 1 is read or the epoch's stream ends."""
        while self.read < stop and self.it is not None:
            try:
                item = next(self.it)
            except StopIteration:
                self.it = None
                break
            self.items[self.read] = item
            self.read += 1
        if self.epoch == 0:
            self.first_epoch_items = self.read

    def __getitem__(self, position: int) -> Any:
        self._read_to(position + 1)
        if position not in self.items:
            raise IndexError(
                f"{self.name}: item {position} of the stream is no longer held (or beyond its "
                f"end, {self.read} items read)"
            )
        return self.items[position]

    def readable(self, n: int) -> int:
        """How many of the epoch's first n items exist (the checks before the first step)."""
        self._read_to(self.begin + n)
        return min(n, self.read - self.begin)

    def next_batch(self, size: int, epochs: int) -> tuple[int, int] | None:
        """(epoch, first position) of the next complete global batch of `size` items, starting
        another epoch when this one cannot fill one; None after the last epoch."""
        while True:
            self._read_to(self.next + size)
            if self.read >= self.next + size:
                start, self.next = self.next, self.next + size
                return self.epoch, start
            self._require_items(size)
            if self.epoch + 1 >= epochs:
                return None
            self._start_epoch(self.epoch + 1)

    def _require_items(self, size: int) -> None:
        """An epoch that ends without one global batch: too small, or a one-shot iterable
        (a generator) that yields nothing when read again."""
        got = self.read - self.begin
        if self.next > self.begin:  # the epoch filled at least one batch
            return
        if self.epoch == 0:
            raise JobError(
                f"{self.name} yielded {got} items, fewer than one global batch (--batch-size "
                f"{size}): lower --batch-size or give a longer stream"
            )
        raise JobError(
            f"{self.name} yielded {got} items when read again for epoch {self.epoch + 1} "
            f"({self.first_epoch_items} in epoch 1): each epoch calls iter(dataset) anew, and "
            "a generator object cannot start again; define a torch IterableDataset whose "
            "__iter__ starts a new pass, or train one epoch"
        )

    def release_before(self, position: int) -> None:
        """Forget the items before `position` (their step is loaded)."""
        for p in [p for p in self.items if p < position]:
            del self.items[p]


def stream_steps(
    source: StreamSource,
    *,
    batch_size: int,
    epochs: int,
    steps: int | None,
    start_after: int = 0,
) -> Iterator[Step]:
    """The steps of a run over a stream, from step start_after + 1 on: the steps before it are
    read and skipped (a resumed run reads the stream up to where it stopped). Each step is
    planned one batch ahead, so the last one knows it is the last (its `total`)."""
    ahead = source.next_batch(batch_size, epochs)
    number = 0
    while ahead is not None:
        number += 1
        epoch, start = ahead
        ahead = None if number == steps else source.next_batch(batch_size, epochs)
        total = number if ahead is None else steps
        if number > start_after:
            yield Step(number, epoch, torch.arange(start, start + batch_size), total)
        # the step's items are loaded once the loader asks for the next one
        source.release_before(start + batch_size)


class ReadOnce:
    """An eval stream, read whole at its first use and held as a list: evaluation reads the
    eval set in order, every rank its part, which needs its length (data.order.eval_batches).
    An eval set must therefore fit in memory; a training stream need not."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._items: list[Any] | None = None

    @property
    def items(self) -> list[Any]:
        if self._items is None:
            self._items = list(self.stream)
        return self._items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]
