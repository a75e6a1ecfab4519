"""Reading a checkpoint without unpickling arbitrary objects, and telling a readable one apart.

torch.distributed.checkpoint (DCP) pickles two things: the checkpoint's `.metadata` (read with
`pickle.load` by FileSystemReader.read_metadata) and every non-tensor entry of the state dict
(the step, the key order, optimizer hyperparameters, the scheduler's state; read with
`torch.load(weights_only=False)` by DefaultLoadPlanner.load_bytes). Unpickling runs whatever a
crafted file asks for (https://docs.python.org/3/library/pickle.html, the warning at the top),
so both are replaced here through DCP's documented extension points, a StorageReader and a
LoadPlanner (https://pytorch.org/docs/stable/distributed.checkpoint.html):

- `.metadata` goes through an unpickler that builds only DCP's metadata dataclasses, torch.Size,
  dtypes, layouts and paths, and refuses any other class or function;
- non-tensor entries go through `torch.load(weights_only=True)`, as tensors already do.

`check` also finds a checkpoint that cannot be read (a truncated or garbled `.metadata`, a data
file missing or shorter than the metadata says) before any rank loads it, so that --resume can
skip it for the older one that is kept.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from sagenb.engine.torch_private import set_element

__all__ = [
    "CheckpointError",
    "SafeReader",
    "SafePlanner",
    "check",
    "read_entry",
    "read_metadata",
    "reason",
]

METADATA = ".metadata"  # DCP's name for it (filesystem.py, _metadata_fn)

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED = _DCP_CLASSES | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a dict lookup: layout name -> torch.layout
    ("collections", "OrderedDict"),
    *(
        (module, cls)
        for module in ("pathlib", "pathlib._local")
        for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    ),  # StorageMeta.checkpoint_id
}
_DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class CheckpointError(Exception):
    """A checkpoint that cannot be read, or that holds what sagenb refuses to unpickle."""


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only what DCP's metadata is made of (the way
    torch.load(weights_only=True) does for tensors); any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (not DCP metadata)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id (not DCP metadata)")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The `.metadata` of the checkpoint directory `path`, through the restricted unpickler."""
    file = Path(path) / METADATA
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing (the checkpoint was not finished)") from None
    except Exception as exc:
        raise CheckpointError(f"{file} cannot be read: {reason(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, its `.metadata` read by `read_metadata` (no pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: sagenb's saves never write it
            raise CheckpointError(f"{self.path}: per-rank metadata is not supported")
        metadata = read_metadata(self.path)
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:  # as FileSystemReader does
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, non-tensor entries loaded with torch.load(weights_only=True)
    (DefaultLoadPlanner.load_bytes uses weights_only=False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_entry(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _load_entry(value: io.BytesIO, fqn: str) -> Any:
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's message: a paragraph, the cause inside
        why = next((s for s in str(exc).splitlines() if "GLOBAL" in s), reason(exc))
        raise CheckpointError(
            f"the entry {fqn!r} was refused by torch.load(weights_only=True): {why.strip()} "
            "(add a class you trust with torch.serialization.add_safe_globals)"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"the entry {fqn!r} cannot be read: {reason(exc)}") from None


def check(path: str | os.PathLike) -> Metadata:
    """The metadata of the checkpoint `path` once it is known to be readable: its `.metadata`
    loads, every data file it names is there and long enough, and every non-tensor entry loads
    with weights_only=True (they are small; tensors are read by the ranks, also weights_only).
    Raises CheckpointError saying what is wrong."""
    root = Path(path)
    metadata = read_metadata(root)
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{root}: the metadata names a file outside it: {name!r}")
        if name not in sizes:
            try:
                sizes[name] = (root / name).stat().st_size
            except OSError as exc:
                raise CheckpointError(f"{root / name} cannot be read: {reason(exc)}") from None
        end = info.offset + info.length
        if sizes[name] < end:
            raise CheckpointError(
                f"{root / name} is truncated: {sizes[name]} bytes, the metadata needs {end}"
            )
    _check_entries(root, metadata)
    return metadata


def _check_entries(root: Path, metadata: Metadata) -> None:
    for index, info in metadata.storage_data.items():
        meta = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(meta, BytesStorageMetadata) or info.transform_descriptors:
            continue
        _read_bytes_entry(root, info, index.fqn)


def _read_bytes_entry(root: Path, info: Any, fqn: str) -> Any:
    with open(root / info.relative_path, "rb") as stream:
        stream.seek(info.offset)
        data = io.BytesIO(stream.read(info.length))
    try:
        return _load_entry(data, fqn)
    except CheckpointError as exc:
        raise CheckpointError(f"{root / info.relative_path}: {exc}") from None


def read_entry(path: str | os.PathLike, metadata: Metadata, fqn: str) -> Any:
    """The non-tensor entry `fqn` of the checkpoint `path` (weights_only, as `check` reads
    it), in this process and without the ranks; None when the checkpoint has no such entry."""
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn and not info.transform_descriptors:
            return _read_bytes_entry(Path(path), info, fqn)
    return None


def reason(exc: BaseException) -> str:
    """One line for what went wrong: a CheckpointError's own message; from DCP's
    CheckpointException (a BaseException carrying every rank's failure), the first rank's."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first = exc.failures[min(exc.failures)]
        return reason(first[0] if isinstance(first, tuple) else first)
    if isinstance(exc, CheckpointError):
        return str(exc)
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
