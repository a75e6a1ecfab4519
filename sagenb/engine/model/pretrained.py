"""Pretrained weights a cell names, read by each engine for only what it keeps.

A cell names its checkpoint in one of two ways:

- `model = AutoModelForCausalLM.from_pretrained(folder)` (any `transformers.PreTrainedModel`,
  also inside a wrapper or a peft model): under `--delay-init` the values it loads are dropped to
  the meta device as they arrive (`delayed.meta_parameters`), so sagenb reads them again from
  the model's `name_or_path`, after the split;
- a cell variable `pretrained = "folder"` (or a path to one `.safetensors` file), for any model:
  a folder holding `model.safetensors`, or shards with their `model.safetensors.index.json`, whose
  keys are those of `model.state_dict()` (a peft model's `base_model.model.` prefix and its
  `.base_layer` are looked through). A `pretrained` that is not a str or path is left alone.

Files are opened lazily with safetensors' `safe_open` and each engine reads through
`get_slice` only the rows and columns it keeps: its FSDP2 shard, its tensor-parallel slice, the
whole tensors of its pipeline stages (accelerate's `load_checkpoint_and_dispatch` and
torchtitan's meta-device loading do the same on one process or with DCP). Parameters the files
lack (a new head, LoRA adapters) keep sagenb's seeded initial values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from sagenb.config.files import read_small
from sagenb.config.job import JobError
from sagenb.engine.torch_private import direct_parameters

__all__ = [
    "Checkpoint",
    "check_matches",
    "find_checkpoint",
    "load_local",
    "load_whole",
    "local_index",
    "name_aliases",
]

INDEX = "model.safetensors.index.json"


def _safe_open(path: str) -> Any:
    """safetensors' lazy reader of `path` (tensors and slices read on demand). Imported here:
    safetensors comes with transformers, and a run that names no checkpoint needs neither."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise JobError(
            f"reading the pretrained checkpoint {path} needs safetensors, which is not installed "
            "on this engine: pip install safetensors (transformers brings it)"
        ) from exc
    return safe_open(path, framework="pt")


SINGLE = "model.safetensors"


@dataclass
class Checkpoint:
    """A checkpoint's tensors by key, opened lazily; `bytes_read` counts what was read."""

    #: checkpoint key -> the file holding it
    files: dict[str, str]
    #: prefixes of the cell's model keys the checkpoint's keys leave out ("base_model.model.")
    prefixes: tuple[str, ...] = ("",)
    where: str = ""
    bytes_read: int = field(default=0, init=False)

    @classmethod
    def open(cls, path: str | os.PathLike, *, prefixes: tuple[str, ...] = ("",)) -> Checkpoint:
        return cls(_files(Path(path)), prefixes=prefixes, where=str(path))

    def key_of(self, names: Iterable[str]) -> str | None:
        """The checkpoint key of a tensor the model calls by any of `names`, or None."""
        for name in names:
            for prefix in self.prefixes:
                if not name.startswith(prefix):
                    continue
                key = name[len(prefix) :]
                for candidate in (key, key.replace(".base_layer.", ".")):
                    if candidate in self.files:
                        return candidate
        return None

    def read(
        self, key: str, shape: Iterable[int], index: tuple[slice, ...] | None = None, *, name: str
    ) -> torch.Tensor:
        """The tensor `key`, or only its `index` box: nothing else of the file is read. Its
        shape in the file must be `shape`, the model's parameter `name`'s, exactly (as
        load_state_dict requires): a (1, 8) tensor would broadcast into a (16, 8) weight, and
        the box of a larger one is a crop of it. JobError naming both, and the file."""
        # opened for each read, so the file's pages it mapped are let go straight after
        with _safe_open(self.files[key]) as f:
            part = f.get_slice(key)
            found, wanted = list(part.get_shape()), list(shape)
            if found != wanted:
                raise JobError(
                    f"pretrained: {key} in {self.files[key]} is {found}, the model's {name} is "
                    f"{wanted}: shapes must match exactly, as load_state_dict requires; load "
                    "a checkpoint saved from this model's architecture, or build the model with "
                    "the checkpoint's config"
                )
            tensor = part[index] if index is not None else part[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _files(path: Path) -> dict[str, str]:
    """The checkpoint's files by key: the one file where the folder has it, else its index's,
    in transformers' order (a sharded save_pretrained, then a one-file one into the same
    folder, leaves the index of shards that transformers removed; it reads the one file)."""
    if path.is_file() and path.suffix == ".safetensors":
        return _keys_of(path)
    if (path / SINGLE).is_file():
        return _keys_of(path / SINGLE)
    if (path / INDEX).is_file():
        return _indexed(path)
    raise JobError(
        f"pretrained checkpoint {str(path)!r}: no {SINGLE} or {INDEX} there (a folder of "
        "safetensors files as save_pretrained writes them, or one .safetensors file)"
    )


#: the largest index read: a 405B-parameter model's is about 100 KiB
MAX_INDEX_BYTES = 16 * 2**20


def _indexed(folder: Path) -> dict[str, str]:
    """Checkpoint key -> file, from the folder's index (transformers' sharded save_pretrained).
    The index may name only files directly in `folder`, as DCP metadata may
    (checkpoint/reader.py): `../elsewhere/x.safetensors` or an absolute path was read."""
    index = folder / INDEX
    try:
        weight_map = json.loads(read_small(index, MAX_INDEX_BYTES))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JobError(
            f"pretrained index {index} cannot be read ({type(exc).__name__}: {exc}): it must be "
            f'JSON with a "weight_map" of tensor names to file names, as save_pretrained writes'
        ) from None
    if not isinstance(weight_map, dict):
        raise JobError(f'pretrained index {index}: its "weight_map" is not an object')
    for name in weight_map.values():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise JobError(
                f"pretrained index {index} names a file outside {folder}: {name!r} (it may "
                "name only files in its own folder, as save_pretrained writes them)"
            )
    return {key: str(folder / name) for key, name in weight_map.items()}


def _keys_of(file: Path) -> dict[str, str]:
    with _safe_open(str(file)) as f:
        return dict.fromkeys(f.keys(), str(file))


def find_checkpoint(
    ns: Mapping[str, Any], model: nn.Module, loaded: set[int] | None
) -> Checkpoint | None:
    """The checkpoint the cell names: its `pretrained` variable, else the folder a
    `from_pretrained` loaded (`loaded`: ids of modules whose parameters received values while
    the cell ran under `--delay-init`; None without it, when from_pretrained's values stay)."""
    named = ns.get("pretrained")
    if isinstance(named, (str, os.PathLike)):
        return Checkpoint.open(named, prefixes=("", "base_model.model."))
    if not loaded:
        return None
    return _from_pretrained(model, loaded)


def _from_pretrained(model: nn.Module, loaded: set[int]) -> Checkpoint:
    # the outermost module that transformers gave a name_or_path (PreTrainedModel.__init__
    # sets it on the instance, its inner base model's too; a peft model only forwards the
    # attribute to its base)
    holders = [
        (prefix, module)
        for prefix, module in model.named_modules()
        if vars(module).get("name_or_path") and any(id(m) in loaded for m in module.modules())
    ]
    if not holders:
        raise JobError(
            "--delay-init: the cell gave its parameters values (a load_state_dict(assign=True), "
            "a Parameter set by hand, a loader other than transformers' from_pretrained), which "
            "delayed initialisation would replace by its own: name the weights' file with a "
            'cell variable `pretrained = "folder/or/file.safetensors"`, or leave --delay-init off'
        )
    prefix, module = holders[0]
    folder = str(vars(module)["name_or_path"])
    if not Path(folder).is_dir():
        raise JobError(
            f"--delay-init: {type(module).__name__} was loaded from {folder!r}, not a local "
            "folder: save it with save_pretrained and load that folder, or leave --delay-init off"
        )
    return Checkpoint.open(folder, prefixes=(f"{prefix}." if prefix else "",))


def name_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every state_dict name of each parameter (a tied one has several), by id."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def check_matches(model: nn.Module, checkpoint: Checkpoint) -> None:
    """A checkpoint none of whose keys the model has is a mistake, never a silent no-op."""
    names = name_aliases(model).values()
    if any(checkpoint.key_of(n) is not None for n in names):
        return
    ours = [n[0] for n in list(names)[:3]]
    theirs = sorted(checkpoint.files)[:3]
    raise JobError(
        f"pretrained checkpoint {checkpoint.where!r} holds none of the model's parameters: the "
        f"model has {ours}..., the files {theirs}...; its keys must be model.state_dict()'s"
    )


def local_index(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The box of the full tensor this engine holds of `param`: None for a plain tensor (all
    of it), else the rows/columns of each Shard placement, in torch.chunk's pieces as DTensor
    (and FSDP2, on dim 0) cut them."""
    if not isinstance(param, DTensor):
        return None
    box = [slice(0, n) for n in param.shape]
    coordinate = list(param.device_mesh.get_coordinate() or ())
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # Partial, or a strided shard of FSDP x TP
            raise JobError(f"pretrained: cannot read a {placement} parameter slice by slice")
        dim, pieces = placement.dim, param.device_mesh.size(mesh_dim)
        start, stop = box[dim].start, box[dim].stop
        size = -(-(stop - start) // pieces)  # torch.chunk: ceil(n / pieces) each, the last less
        first = min(start + coordinate[mesh_dim] * size, stop)
        box[dim] = slice(first, min(first + size, stop))
    return tuple(box)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def load_local(model: nn.Module, checkpoint: Checkpoint, *, device: torch.device) -> None:
    """Allocate every meta parameter of `model` on `device` (plain, or a DTensor: an FSDP2
    shard, a tensor-parallel slice) and fill what this engine holds of it from `checkpoint`.

    Parameters and buffers that already hold values keep them (`to_empty` reallocates
    everything, as torchtitan's meta-device init does, so they are copied back)."""
    aliases = name_aliases(model)
    pending = [aliases[id(p)] for _, p in model.named_parameters() if p.is_meta]
    if not pending:
        return
    kept: list[tuple[str, torch.Tensor]] = [
        (n, t) for n, t in model.named_parameters() if not t.is_meta
    ]
    kept += [(n, b) for n, b in model.named_buffers() if not b.is_meta]
    model.to_empty(device=device)
    now = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, old in kept:
        _local(now[name]).copy_(_local(old))
    for names in pending:
        _tie(model, names)
        key = checkpoint.key_of(names)
        if key is None:
            raise JobError(f"pretrained: {names[0]} is not in {checkpoint.where!r}")
        param = model.get_parameter(names[0])
        _local(param).copy_(checkpoint.read(key, param.shape, local_index(param), name=names[0]))


def _tie(model: nn.Module, names: list[str]) -> None:
    """Share `names[0]`'s parameter under its other names again: `to_empty` gives a tied meta
    parameter a new tensor in each module that holds it."""
    first = model.get_parameter(names[0])
    for name in names[1:]:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if direct_parameters(module)[leaf] is not first:
            direct_parameters(module)[leaf] = first


@torch.no_grad()
def load_whole(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copy every parameter the checkpoint holds into `model`'s (real) parameters, whole."""
    for names in name_aliases(model).values():
        key = checkpoint.key_of(names)
        if key is not None:
            param = model.get_parameter(names[0])
            param.copy_(checkpoint.read(key, param.shape, name=names[0]))
