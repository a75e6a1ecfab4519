"""The cell's `collate_fn`: how the samples of one piece of a global batch become its batch.

A cell may define `collate_fn(samples) -> batch`, the convention of torch's
`DataLoader(collate_fn=...)` and of transformers' data collators (an instance such as
`DataCollatorForLanguageModeling(tokenizer, mlm=False)` is a callable too): it receives the list
`[dataset[i] for i in piece]` and returns a dict of tensors or an `(input, target)` tuple. It
is what lets samples of unequal lengths be padded, and labels be built from `input_ids`.

sagenb collates every piece it cuts on its own, with the cell's collate_fn: an engine's share of
a grad-accum slice (engine/data/loader.py, in the training thread or a --data-workers process), each
pipeline microbatch of that share (collated one by one, then concatenated into the share, which
the schedule cuts again at the same rows: both use torch.tensor_split), an evaluation chunk,
and the examples that pipelines trace and tensor parallel tries. One process would collate the
whole global batch at once; the pieces are then padded to other lengths, and train the same
model when the padding is masked (attention_mask, labels of -100): a real token's output and
loss do not depend on how many pads follow it, and each piece's loss is weighted by the labels
it counts (engine/objective.py).

Without a collate_fn nothing changes: a TensorDataset is indexed in one go, other datasets
sample by sample and torch's default_collate.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

from sagenb.config.job import JobError

__all__ = [
    "Collate",
    "RandomStateKept",
    "collate",
    "collate_samples",
    "as_batch",
    "concat",
    "example_batch",
    "shapes_of",
    "require_shapes",
    "require_one_length",
    "FIXED_LENGTH",
    "PROBES",
]

#: the cell's collate_fn: a list of samples in, a batch out
Collate = Callable[[list[Any]], Any]

#: samples a pipeline collates one by one before its first step (require_one_length): a few
#: suffice to show a collator that pads to its batch's longest sample, and cost microseconds
PROBES = 8

#: what to do when a pipeline meets batches of more than one shape
FIXED_LENGTH = (
    "pad every batch to one fixed length in collate_fn (e.g. tokenizer.pad(samples, "
    "padding='max_length', max_length=N), or DataCollatorForLanguageModeling(tokenizer, "
    "mlm=False, pad_to_multiple_of=N) with N at least the longest sample), or train with "
    "--strategy data, sharded or tensor, which take batches of any length"
)


def collate(dataset: Any, indices: torch.Tensor, collate_fn: Collate, parts: int = 1) -> Any:
    """The batch of dataset[indices] made by `collate_fn`, as `collate_samples` makes it."""
    return collate_samples([dataset[i] for i in indices.tolist()], collate_fn, parts)


def collate_samples(samples: list[Any], collate_fn: Collate, parts: int = 1) -> Any:
    """The batch `collate_fn` makes of `samples`; with `parts` > 1, each of the `parts` runs
    torch.tensor_split makes is collated on its own (a pipeline's microbatches) and the
    batches are concatenated."""
    if parts == 1:
        return as_batch(collate_fn(samples))
    runs = torch.arange(len(samples)).tensor_split(parts)
    return concat([as_batch(collate_fn(samples[r[0] : r[-1] + 1])) for r in runs if len(r)])


def as_batch(batch: Any) -> Any:
    """A collated batch as sagenb reads it: a Mapping (transformers' BatchEncoding is a
    UserDict, not a dict) becomes a plain dict, which moves to the device and splits into
    keyword arguments like any dict."""
    return dict(batch) if isinstance(batch, Mapping) and not isinstance(batch, dict) else batch


def concat(batches: list[Any], where: str = "batch") -> Any:
    """Batches of the same structure joined along their first dimension (pipeline
    microbatches into the engine's share); unequal shapes are refused, naming the fix."""
    first = batches[0]
    if torch.is_tensor(first):
        shapes = {tuple(b.shape[1:]) for b in batches}
        if len(shapes) > 1:
            raise JobError(
                f"collate_fn made the microbatches of one step with {where} of different "
                f"shapes ({' and '.join(str([-1, *s]) for s in sorted(shapes))}): a pipeline "
                f"runs every microbatch through stages fixed to one shape; {FIXED_LENGTH}"
            )
        return torch.cat(batches)
    if isinstance(first, dict):
        return {k: concat([b[k] for b in batches], _key(where, k)) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat(list(vs), f"{where}[{i}]") for i, vs in enumerate(zip(*batches)))
    raise JobError(
        f"collate_fn returned a {type(first).__name__} as {where}: a pipeline's stages pass "
        "tensors only; return tensors (a dict of them, or an (input, target) tuple)"
    )


def _key(where: str, key: Any) -> str:
    """How a batch's entry is named in messages: `input_ids`, or `batch[0]['mask']` deeper."""
    return str(key) if where == "batch" else f"{where}[{key!r}]"


class RandomStateKept:
    """torch's (CPU), Python's and numpy's RNG states, restored after the block: collations
    made only to check the batch leave them as they were (a collator that draws, masked-LM
    masking, would otherwise shift the training's stream), and so does the kernel's own build
    of a trained model (run/trained.py). `drew` says, after the block, whether it drew from
    any of them."""

    drew = False

    def __enter__(self) -> RandomStateKept:
        self.states = _random_states()
        return self

    def __exit__(self, *exc: object) -> None:
        now = _random_states()
        self.drew = any(not _same(a, b) for a, b in zip(now, self.states))
        torch.set_rng_state(self.states[0])
        random.setstate(self.states[1])
        if self.states[2] is not None:
            _numpy_random().set_state(self.states[2])


def _numpy_random() -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the engine side
        return None
    return np.random


def _random_states() -> tuple[torch.Tensor, Any, Any]:
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    return torch.get_rng_state(), random.getstate(), numpy_state


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):  # torch's state: its bytes read directly, as estimates (sizing/
        # footprint.py) build the workspace under FakeTensorMode, where any tensor op on a
        # real tensor (torch.equal, .numpy()) is refused
        return _raw(a) == _raw(b)
    if isinstance(a, tuple):  # numpy's state holds an array: compare element by element
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):
        return bool((a == b).all())
    return a == b


def _raw(state: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor (an RNG state), read without a tensor op."""
    return ctypes.string_at(state.data_ptr(), state.numel() * state.element_size())


def example_batch(dataset: Any, collate_fn: Collate, size: int) -> tuple[Any, bool]:
    """The first `size` samples collated (as many as the dataset has: the caller knows, a
    stream's by reading them, data/stream.py readable), before any step: what the labels
    check reads, and whether collate_fn drew random numbers to make it
    (engine/model/equivalence.py says so). A collate_fn that fails is named, with what it is
    given and must return; the samples are read first, so that only collate_fn's own failures
    are put on it."""
    indices = list(range(size))
    samples = [dataset[i] for i in indices]
    try:
        with RandomStateKept() as kept:
            batch = as_batch(collate_fn(samples))
    except Exception as exc:
        raise JobError(
            f"collate_fn failed on [dataset[i] for i in {indices}]: "
            f"{type(exc).__name__}: {str(exc)[:300]}; it receives a list of samples and must "
            "return a batch (a dict of tensors, or an (input, target) tuple)"
        ) from exc
    return batch, kept.drew


def shapes_of(batch: Any, where: str = "batch") -> dict[str, tuple[int, ...]]:
    """Every tensor of a batch, by where it sits, with its shape after the first (sample)
    dimension: what a pipeline's stages are fixed to."""
    if torch.is_tensor(batch):
        return {where: tuple(batch.shape[1:])}
    found: dict[str, tuple[int, ...]] = {}
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            found.update(shapes_of(value, _key(where, key)))
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            found.update(shapes_of(value, f"{where}[{i}]"))
    return found


def require_shapes(
    expected: dict[str, tuple[int, ...]], batch: Any, *, strategy: str, what: str
) -> None:
    """Refuse `batch` when its tensors' shapes differ from `expected` (the first
    microbatch's, which the pipeline was built for), naming the first that differs."""
    found = shapes_of(batch)
    for name, shape in expected.items():
        if found.get(name, shape) != shape:
            raise JobError(
                f"--strategy {strategy}: {what} has {name} of shape {[-1, *found[name]]}, the "
                f"first microbatch {[-1, *shape]}: a pipeline's stages are traced and their "
                f"messages sized for one shape; {FIXED_LENGTH}"
            )


def require_one_length(
    dataset: Any,
    collate_fn: Collate,
    expected: dict[str, tuple[int, ...]],
    *,
    strategy: str,
    name: str = "dataset",
    probes: int = PROBES,
) -> None:
    """Before a pipeline's first step: the first `probes` samples of `name` (PROBES, or as
    many as it has), each collated alone, must have the first microbatch's shapes. A collator
    that pads to the longest sample of its batch shows here whenever those samples differ in
    length; one that slips past (its first samples all of one length) is refused at the first
    step that differs."""
    with RandomStateKept():
        for i in range(probes):
            batch = collate(dataset, torch.tensor([i]), collate_fn)
            require_shapes(expected, batch, strategy=strategy, what=f"{name}[{i}], collated alone,")
