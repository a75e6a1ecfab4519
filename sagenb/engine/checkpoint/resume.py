"""What --resume checks before it continues from a checkpoint: that this run's engines can read
it, that the options it was written with still mean the same, and that it holds this model.

The step a checkpoint records is also the sampler's position (engine/loop.py): the samples a
resumed run trains next are those after `step * batch_size` in the order the seed draws. So a
checkpoint records the options it was written with, as one JSON string (a plain value, read
with torch.load(weights_only=True) like the step: reader.py), and options that would move that
position or change that order are refused. Checkpoints written before the record resume as
they did.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from sagenb.config.errors import ConfigError, flag_name
from sagenb.config.job import JobError
from sagenb.engine.checkpoint.reader import CheckpointError, read_entry

__all__ = [
    "RECORD",
    "record",
    "saved_options",
    "layout_problem",
    "check_options",
    "check_model",
    "model_difference",
    "check_replaceable",
    "replaced_note",
]

RECORD = "options"

#: options whose change would train other samples than an uninterrupted run: refused, and why
_REFUSED = {
    "batch_size": "the step is the sample position (step x batch size), so another batch size "
    "would skip or repeat samples of the epoch",
    "seed": "the sample order is drawn from the seed, so another seed changes the order of "
    "the samples still to come",
}


def record(config: Any, *, world_size: int, lr: float | None) -> str:
    """The options a checkpoint is written with, as JSON. `lr`: the base lr its optimizer
    trains with (after a resume, the saved one), None when the cell's make_optimizer sets
    its own (--lr is not used then)."""
    options = dict(batch_size=config.batch_size, seed=config.seed, grad_accum=config.grad_accum)
    return json.dumps({**options, "lr": lr, "engines": world_size})


def saved_options(path: str | os.PathLike, metadata: Metadata) -> dict[str, Any] | None:
    """The options the checkpoint `path` was written with; None for one written before
    checkpoints recorded them."""
    text = read_entry(path, metadata, RECORD)
    if text is None:
        return None
    try:
        options = json.loads(text)
    except (TypeError, ValueError):
        options = None
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: its {RECORD!r} entry is not a JSON object")
    return options


def layout_problem(metadata: Metadata, world_size: int) -> str | None:
    """Why this run's `world_size` engines cannot read the checkpoint, or None: each rank
    restores its own RNG state (distributed.py), so a checkpoint written on fewer engines
    holds nothing for the others."""
    keys = metadata.state_dict_metadata
    written = sum(1 for key in keys if key.startswith("rng/"))
    missing = next((r for r in range(world_size) if f"rng/{r}" not in keys), None)
    if missing is None:
        return None
    return (
        f"it was written on {written} engine{'s' * (written != 1)} and holds no state for "
        f"rank {missing} of this run's {world_size}"
    )


def check_options(saved: dict[str, Any] | None, config: Any, path: Path) -> list[str]:
    """A note for each option that differs from the checkpoint's and is honoured; ConfigError
    naming the option, both values and why, for one that cannot be."""
    if saved is None:
        return []
    where = f"the checkpoint {path.name} in --checkpoint-dir {path.parent}"
    for name, why in _REFUSED.items():
        if name in saved and saved[name] != getattr(config, name):
            allowed = (
                f"differs from the {saved[name]!r} {where} was written with, and {why}: resume "
                f"with {flag_name(name)} {saved[name]}, or train without --resume"
            )
            raise ConfigError(name, getattr(config, name), allowed)
    notes = []
    if saved.get("grad_accum", config.grad_accum) != config.grad_accum:
        notes.append(
            f"--resume: --grad-accum {config.grad_accum} differs from the {saved['grad_accum']} "
            f"{where} was written with: each step still trains the same global batch, cut into "
            f"{config.grad_accum} slices, so losses can differ from an uninterrupted run's by "
            "rounding"
        )
    if saved.get("lr") is not None and saved["lr"] != config.lr:
        notes.append(
            f"--resume: --lr {config.lr} differs from the {saved['lr']} {where} was written "
            f"with: the optimizer's saved state holds lr {saved['lr']}, and the run trains on "
            f"with it (--lr {config.lr} is not used)"
        )
    return notes


def check_model(path: Path, metadata: Metadata, saved_order: Any, strategy: Any) -> None:
    """JobError naming the first key where this rank's model differs from the checkpoint's:
    a key only one of them has, or a shape that differs. Without it, DCP reports a shape
    mismatch as a checkpoint it cannot read, and --resume would skip it."""
    difference = model_difference(metadata, saved_order, strategy)
    if difference is not None:
        raise JobError(
            f"--resume: the model differs from the checkpoint's ({path.name} in "
            f"--checkpoint-dir {path.parent}): {difference}; resume with the cell that wrote "
            "it, or train without --resume"
        )


def model_difference(metadata: Metadata, saved_order: Any, strategy: Any) -> str | None:
    """The first key where this rank's model differs from the checkpoint's, said in words
    ("0.weight is [16, 8] in the checkpoint, [32, 8] in the model"), or None."""
    difference = _key_difference(saved_order, list(strategy.key_order))
    sizes = {
        key.removeprefix("model/"): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)
    }
    # this rank's entries (a pipeline stage holds some), with global shapes (a DTensor's)
    for key, tensor in strategy.checkpoint_state().items():
        if difference is None and key in sizes and sizes[key] != tuple(tensor.shape):
            difference = (
                f"{key} is {list(sizes[key])} in the checkpoint, {list(tensor.shape)} in the model"
            )
    return difference


def check_replaceable(saved: dict[str, Any] | None, config: Any, path: Path) -> None:
    """A run without --resume into a folder holding checkpoints starts over, and its own
    replace them (distributed.save prunes what this run did not write): ConfigError when they
    are another run's, written with another seed or batch size, which the user would lose.
    The same options: a rerun of the same cell, which replaces them (a note says so)."""
    others = {
        name: saved[name]
        for name in _REFUSED
        if saved is not None and name in saved and saved[name] != getattr(config, name)
    }
    if not others:
        return
    written = " and ".join(
        f"{flag_name(n)} {v}, not {getattr(config, n)}" for n, v in others.items()
    )
    theirs = " ".join(f"{flag_name(n)} {v}" for n, v in others.items())
    raise ConfigError(
        "checkpoint_dir",
        config.checkpoint_dir,
        f"holds the checkpoints of another run ({path.name}, written with {written}), which "
        f"this run would replace: choose another --checkpoint-dir, empty this one, or continue "
        f"that run with --resume {theirs}",
    )


def replaced_note(saved: dict[str, Any] | None, path: Path) -> str:
    """What a run without --resume says when it replaces the checkpoints of a run of the same
    seed and batch size (or of one written before checkpoints recorded their options)."""
    earlier = (
        "an earlier run of the same seed and batch size"
        if saved is not None
        else "an earlier run (written before checkpoints recorded their options)"
    )
    return (
        f"--checkpoint-dir {path.parent} holds {path.name} of {earlier}: this run starts "
        "over (no --resume) and its checkpoints replace those; to continue that run instead, "
        "train with --resume"
    )


def _key_difference(saved_order: Any, model_order: list[str]) -> str | None:
    if not isinstance(saved_order, list):
        return None
    saved, model = set(saved_order), set(model_order)
    only_saved = next((k for k in saved_order if k not in model), None)
    if only_saved is not None:
        return f"{only_saved} is in the checkpoint, not in the model"
    only_model = next((k for k in model_order if k not in saved), None)
    if only_model is not None:
        return f"{only_model} is in the model, not in the checkpoint"
    return None
