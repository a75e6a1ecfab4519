"""The batches of each step, in the contract's order: loaded in the training thread, or by worker
processes that prepare the next steps' batches while this one trains (--data-workers).

Either way the loop reads one iterator of `StepData`: for each step of the plan, its grad-accum
slices, each this engine's share (`strategy.local_indices`), collated by `fetch` (with the
cell's collate_fn when it has one, a pipeline's microbatches one by one: engine/data/collation.py)
and moved to the device. With --data-workers 0 (the default) nothing changes from loading in
the loop: each step's samples are fetched when the loop asks for them. With N > 0, a
`torch.utils.data.DataLoader` (https://pytorch.org/docs/stable/data.html) whose batch sampler
is exactly that list of index lists loads them in N processes, `prefetch_factor` batches ahead
per worker, pinned on CUDA, in order (`in_order=True`, the default), so the batches and hence
the training are the same as without workers.

Worker processes are forked on Linux, on purpose. An engine is a long-lived ipyparallel process
and the cell's Dataset class lives in the cell's module (sagenb/config/cell_module.py), which
the engine registered and no fresh interpreter can import: a spawned or forkserver worker
could not unpickle the dataset by reference (see "Platform-specific behaviors" in the
torch.utils.data docs). A fork inherits it (copy-on-write, nothing pickled, no per-run
interpreter start); the worker runs nothing but `__getitem__` and collation (the cell's
collate_fn too) on the CPU, with one torch thread (torch's worker loop sets it:
torch/utils/data/_utils/worker.py), and never touches the parent's CUDA context, process group
or sockets. Where fork is not safe or absent (macOS, Windows), workers are spawned and the
dataset (and collate_fn) travel by value with cloudpickle (a cell's module is registered with
it by value), the cost being a copy of the dataset per worker; the cell's top-level classes go
with them, and the worker registers a stand-in module of the cell's name holding them, so a
batch of a cell's class (a collate_fn's dataclass) pickles back to the engine by reference.

The DataLoader draws its workers' base seed from `generator`; left None it would draw from
torch's global RNG and shift the training's random stream (dropout), so it gets its own. A
`__getitem__` that draws random numbers (random augmentation) draws from the worker's RNG, not
the engine's: its samples differ from --data-workers 0 unless it seeds itself per index.

A stream (data/stream.py) is read here, in the training process, in order and once: its items,
not their indices, go to the workers, which collate them. Workers that each read the stream
would either read it N times or, splitting it by worker (get_worker_info, a dataset's own
shards), change which items make global batch k, and so the training.

One iterator spans the whole run, every epoch included, so the workers start once per run and
live until its end (what `persistent_workers` gives a loader iterated once per epoch); they are
shut down when the run ends, stops early or fails (`batches_of` is a context manager), so an
engine keeps no child processes between runs.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from sagenb.config import cell_module
from sagenb.engine.data.collation import Collate
from sagenb.engine.data.order import Step, collated, fetch, to_device
from sagenb.engine.data.stream import StreamSource
from sagenb.engine.torch_private import shutdown_workers

__all__ = ["StepData", "batches_of", "START_METHOD"]

#: how worker processes start (see the module's docstring)
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


@dataclass(frozen=True)
class StepData:
    """One step of the plan and its grad-accum slices' batches (this engine's share)."""

    step: Step
    batches: list[Any]
    #: seconds the loop waited for these batches (loading them, without workers)
    wait_s: float


@contextmanager
def batches_of(
    dataset: Any,
    strategy: Any,
    plan: Iterable[Step],
    *,
    grad_accum: int,
    workers: int,
    device: torch.device,
    seed: int = 0,
    rank: int = 0,
    collate_fn: Collate | None = None,
    parts: int = 1,
) -> Iterator[Iterator[StepData]]:
    """The steps of `plan` with their batches; with `workers` > 0, loaded by that many worker
    processes, which are shut down when the block exits, however it exits. The workers' seeds
    follow `seed` and differ across ranks (augmentations differ, as each rank's samples do).
    `collate_fn` (the cell's, or None) collates each batch in `parts` runs (data.fetch)."""
    collating = _Collating(collate_fn, parts)
    if workers == 0:
        yield _in_thread(dataset, collating, strategy, plan, grad_accum, device)
        return
    # the sampler and the loop both walk the plan, lazily: tee holds only the steps the
    # sampler is ahead by (the prefetch), never a whole epoch of a huge dataset's indices
    for_sampler, steps = itertools.tee(plan)
    streamed = isinstance(dataset, StreamSource)
    loader = DataLoader(
        _Samples(None if streamed else dataset, collating),
        batch_sampler=(
            piece
            for step in for_sampler
            for piece in _pieces(dataset, strategy, step, grad_accum, streamed)
        ),
        collate_fn=_as_is,
        num_workers=workers,
        # about two steps' slices in flight across the workers
        prefetch_factor=max(2, math.ceil(2 * grad_accum / workers)),
        pin_memory=device.type == "cuda",
        multiprocessing_context=START_METHOD,
        generator=torch.Generator().manual_seed(seed * 65536 + rank),
    )
    loaded = iter(loader)
    try:
        yield _from_workers(steps, grad_accum, loaded, device)
    finally:
        # now, not when a traceback frees the iterator
        shutdown_workers(loaded)


def _pieces(
    dataset: Any, strategy: Any, step: Step, grad_accum: int, streamed: bool
) -> list[list[Any]]:
    """This engine's share of each grad-accum slice of `step`, as the workers get it: indices
    of a map-style dataset (the workers read the samples), or a stream's items themselves (the
    stream is read here, in order, once: data/stream.py; the workers collate them)."""
    shares = [strategy.local_indices(piece).tolist() for piece in step.indices.chunk(grad_accum)]
    return [[dataset[i] for i in share] for share in shares] if streamed else shares


@dataclass(frozen=True)
class _Collating:
    """How each batch is collated: the cell's collate_fn (or None) and the runs per batch."""

    collate_fn: Collate | None = None
    parts: int = 1

    def fetch(self, dataset: Any, indices: torch.Tensor) -> Any:
        return fetch(dataset, indices, self.collate_fn, self.parts)

    def collated(self, samples: list[Any]) -> Any:
        return collated(samples, self.collate_fn, self.parts)


def _in_thread(dataset, collating, strategy, plan, grad_accum, device) -> Iterator[StepData]:
    for step in plan:
        started = time.perf_counter()
        batches = [
            to_device(collating.fetch(dataset, strategy.local_indices(piece)), device)
            for piece in step.indices.chunk(grad_accum)
        ]
        yield StepData(step, batches, time.perf_counter() - started)


def _from_workers(steps, grad_accum, loaded, device) -> Iterator[StepData]:
    for step in steps:
        started = time.perf_counter()
        pieces = len(step.indices.chunk(grad_accum))  # as many as _pieces made
        batches = [to_device(next(loaded), device) for _ in range(pieces)]
        yield StepData(step, batches, time.perf_counter() - started)


class _Samples(Dataset):
    """The cell's dataset, loaded a slice at a time by `fetch`: DataLoader's map-style fetcher
    hands a dataset with `__getitems__` the whole index list (torch/utils/data/_utils/fetch.py),
    so a worker's batch is exactly what `fetch` returns in the training thread (the cell's
    collate_fn's, or a TensorDataset indexed in one go, other datasets sample by sample and
    default_collate)."""

    def __init__(self, dataset: Any, collating: _Collating) -> None:
        #: None for a stream: the batch sampler hands the workers its items, not indices
        self.dataset, self.collating = dataset, collating

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, given: list[Any]) -> Any:
        if self.dataset is None:
            return self.collating.collated(given)
        return self.collating.fetch(self.dataset, torch.tensor(given, dtype=torch.int64))

    def __reduce__(self):  # spawned workers only: the cell's classes and functions go by value
        import cloudpickle

        # the cell's classes with them, for the worker's stand-in of the cell's module
        return _unpickle, (cloudpickle.dumps((self.dataset, self.collating, cell_module.live())),)


def _unpickle(payload: bytes) -> _Samples:
    import cloudpickle

    dataset, collating, modules = cloudpickle.loads(payload)
    cell_module.install(modules)  # batches of a cell's class pickle back by its module's name
    return _Samples(dataset, collating)


def _as_is(batch: Any) -> Any:
    """The collate function: `__getitems__` has collated already."""
    return batch
