"""Reading a sagenb checkpoint in one process, without engines; choosing the one --resume
continues from before the engines start."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from sagenb.engine.checkpoint.distributed import choose, load_newest
from sagenb.engine.checkpoint.reader import CheckpointError, SafePlanner, SafeReader
from sagenb.engine.checkpoint.resume import (
    check_options,
    check_replaceable,
    replaced_note,
    saved_options,
)

__all__ = ["load_checkpoint", "resume_warnings", "CheckpointError"]


def load_checkpoint(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state_dict (keys of `model.state_dict()`) of the newest readable
    checkpoint in `directory`, whatever strategy wrote it (a newer one that cannot be read is
    skipped with a RuntimeWarning, as --resume does). Tensors are read with
    torch.load(weights_only=True), the metadata and the key order without unpickling
    anything else (engine/checkpoint/reader.py). Raises CheckpointError (an Exception) naming
    the directory and the cause when no checkpoint there can be read."""
    if not Path(directory).is_dir():
        raise CheckpointError(f"load_checkpoint: {directory} is not a directory")
    state, notes = load_newest(directory, _read_model, by="load_checkpoint")
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return state


def _read_model(path: Path, metadata: Metadata) -> dict[str, torch.Tensor]:
    """The model entries and the key order of one checkpoint, in this process (no_dist)."""
    target: dict[str, Any] = {"key_order": None}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model/") and isinstance(meta, TensorStorageMetadata):
            target[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # DCP's note that it loads in one process: we asked it to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(target, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=True)
    order = target["key_order"]
    if not isinstance(order, list) or any(f"model/{k}" not in target for k in order):
        raise CheckpointError(f"{path}: its key order does not match its model entries")
    return {k: target[f"model/{k}"] for k in order}


def resume_warnings(config: Any, engines: int) -> list[str]:
    """With --resume: which checkpoint the run continues from is decided here, before the
    engines start (they find the same one): a newer one that cannot be read on `engines`
    engines is skipped with a RuntimeWarning, whose text is returned for the run's result, as
    is each option that differs from the checkpoint's and is honoured. None readable raises
    CheckpointError naming --checkpoint-dir and what it holds; an option that cannot be
    resumed with (engine/checkpoint/resume.py) ConfigError; both before any engine works.
    Without --resume, a --checkpoint-dir holding another run's checkpoints (another seed or
    batch size) raises ConfigError, and one of the same options is said to be replaced."""
    if not getattr(config, "resume", False):
        return _fresh_run_notes(config)
    path, metadata, notes = choose(config.checkpoint_dir, world_size=engines)
    notes += check_options(saved_options(path, metadata), config, path)
    for note in notes:
        # no source line of sagenb's under the cell: the warning is about the run
        warnings.warn_explicit(note, RuntimeWarning, "sagenb", 0, module="sagenb")
    return notes


def _fresh_run_notes(config: Any) -> list[str]:
    """A run without --resume starts over, and its checkpoints replace those in its
    --checkpoint-dir (engine/checkpoint/distributed.py, save): refused when they are another
    run's, said when they are an earlier run's of the same options. The engines check the
    model before they train (check_fresh: only they build it)."""
    directory = getattr(config, "checkpoint_dir", None)
    if not directory or not Path(directory).is_dir():
        return []
    try:
        path, metadata, _ = choose(directory)
    except CheckpointError:
        return []  # nothing readable that this run would lose
    saved = saved_options(path, metadata)
    check_replaceable(saved, config, path)
    note = replaced_note(saved, path)
    warnings.warn_explicit(note, RuntimeWarning, "sagenb", 0, module="sagenb")
    return [note]
