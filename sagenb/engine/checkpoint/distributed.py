"""Checkpoints every strategy can write and resume from, with torch.distributed.checkpoint.

A checkpoint holds the model (keys of the unsplit model, whatever the split), the optimizer
state (keyed by parameter name, so a pipeline stage's state lands on the same names), the
scheduler, the step reached (the sample order is a function of the seed, so the step is the
sampler's position), every rank's torch RNG state and the options it was written with
(resume.py). Each rank writes its own part; replicated entries are written once (DCP's
de-duplication).

Writes are atomic: all ranks write into `.step-N.tmp`, then rank 0 renames it to `step-N` and
points `latest` at it (write, then rename), so a crash mid-write leaves the last good
checkpoint untouched; a failed write removes its temporary directory, and a crash's leftover
in a temporary's name is removed by the next write. The two newest checkpoints are kept, and
--resume falls back to the older one when the newest cannot be read (a disk that filled up, a
copy cut short, a file damaged since) or was written on fewer engines than the run has:
`choose` skips it, saying why and which steps are trained again.

Nothing in a checkpoint is unpickled beyond tensors, DCP's metadata and plain values
(checkpoint_reader.py): resuming from a checkpoint runs no code it holds.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from sagenb.engine.checkpoint.reader import (
    CheckpointError,
    SafePlanner,
    SafeReader,
    check,
    read_entry,
    reason,
)
from sagenb.engine.checkpoint.resume import (
    RECORD,
    check_model,
    check_options,
    layout_problem,
    saved_options,
)

__all__ = ["save", "load", "latest", "candidates", "choose", "load_newest", "KEEP"]

KEEP = 2
LATEST = "latest"
RESUME = "--resume"
T = TypeVar("T")


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path if path.is_dir() else None


def candidates(directory: str | os.PathLike) -> list[Path]:
    """The checkpoints in `directory`, newest first: any finished after `latest` was last
    written (renamed into place by a save that crashed before it replaced the pointer), the
    one `latest` names, then the others (kept for when the newest cannot be read). A step
    number alone does not say which is newest: a run without --resume may write into a
    directory holding a longer run's checkpoints."""
    found = sorted((p for p in Path(directory).glob("step-*") if p.is_dir()), reverse=True)
    newest = latest(directory)
    if newest is None:
        return found
    written = (Path(directory) / LATEST).stat().st_mtime
    unpublished = sorted(
        (p for p in found if p != newest and p.stat().st_mtime > written),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    return [*unpublished, newest, *(p for p in found if p != newest and p not in unpublished)]


def choose(
    directory: str | os.PathLike, *, by: str = RESUME, world_size: int | None = None
) -> tuple[Path, Metadata, list[str]]:
    """The newest checkpoint in `directory` readable on `world_size` engines, its metadata,
    and one note for each newer one skipped (which, and why); CheckpointError naming what was
    found when none is readable. The notebook calls it before the engines start (engines
    find the same)."""
    skipped: list[tuple[Path, str]] = []
    path, metadata = _first_readable(directory, candidates(directory), skipped, by, world_size)
    return path, metadata, [_skip_note(p, why, path, by) for p, why in skipped]


def load_newest(
    directory: str | os.PathLike,
    read: Callable[[Path, Metadata], T],
    *,
    by: str = RESUME,
    world_size: int | None = None,
) -> tuple[T, list[str]]:
    """`read(path, metadata)` of the newest checkpoint that `check` passes and whose data
    loads, and one note for each newer one skipped. A failure inside dcp.load reaches every
    rank (DCP gathers them), so in a collective all ranks skip the same checkpoint."""
    skipped: list[tuple[Path, str]] = []
    paths = candidates(directory)
    while True:
        path, metadata = _first_readable(directory, paths, skipped, by, world_size)
        try:
            result = read(path, metadata)
            break
        except (CheckpointError, CheckpointException) as exc:  # the latter: a BaseException
            skipped.append((path, reason(exc)))
        paths = paths[paths.index(path) + 1 :]
    return result, [_skip_note(p, why, path, by) for p, why in skipped]


def _first_readable(
    directory: str | os.PathLike,
    paths: list[Path],
    skipped: list[tuple[Path, str]],
    by: str,
    world_size: int | None,
) -> tuple[Path, Metadata]:
    for path in paths:
        try:
            metadata = check(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        problem = layout_problem(metadata, world_size) if world_size else None
        if problem is None:
            return path, metadata
        skipped.append((path, problem))
    raise _none_readable(directory, skipped, by)


def _where(directory: str | os.PathLike, by: str) -> str:
    return f"--checkpoint-dir {directory}" if by == RESUME else str(directory)


def _skip_note(path: Path, why: str, chosen: Path, by: str) -> str:
    note = (
        f"{by}: skipped the checkpoint {path.name} in {_where(path.parent, by)}, which cannot "
        f"be read ({why}); {'resuming from' if by == RESUME else 'loaded'} the older {chosen.name}"
    )
    lost = _step_of(path) - _step_of(chosen)
    if by == RESUME and lost > 0:  # the run goes back in time: say by how much
        note += f": steps {_step_of(chosen) + 1}-{_step_of(path)} are trained again"
    return note


def _step_of(path: Path) -> int:
    digits = path.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else 0


def _none_readable(
    directory: str | os.PathLike, skipped: list[tuple[Path, str]], by: str
) -> CheckpointError:
    where = _where(directory, by)
    todo = "train without --resume" if by == RESUME else "train with --checkpoint-dir"
    if not skipped:
        return CheckpointError(f"{by}: {where} holds no checkpoint (no step-* directory): {todo}")
    found = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    return CheckpointError(f"{by}: no checkpoint in {where} can be read ({found}); {todo}")


def _state(strategy: Any, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    model = strategy.checkpoint_state()
    state: dict[str, Any] = {f"model/{k}": v for k, v in model.items()}
    names = [name for name, _ in strategy.named_parameters()]
    packed = optimizer.state_dict()
    for index, entries in packed["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                state[f"optim/{names[index]}/{key}"] = _saved_as(value, model.get(names[index]))
    state["optim_groups"] = [
        {k: v for k, v in group.items() if k != "params"} for group in packed["param_groups"]
    ]
    state[f"rng/{rank}"] = torch.get_rng_state()
    return state


def save(
    directory: str | os.PathLike,
    step: int,
    *,
    strategy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    options: str | None = None,
) -> str | None:
    """Write the checkpoint of `step` (a collective: every rank calls it), with `options`
    (resume.record) when given. Returns None, or why it could not be written: this rank's
    error, or "" where only another rank failed. Every rank learns of a failure at each
    phase, so all of them stop together and the run keeps what it trained (loop.py); none is
    left waiting in a collective, and no half-written directory is left behind."""
    root = Path(directory)
    name = f"step-{step:08d}"
    tmp = root / f".{name}.tmp"

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            _remove(tmp)  # a crash's leftover, directory or not

    def write() -> None:
        state = _state(strategy, optimizer, rank)
        state["step"] = step
        state["key_order"] = list(strategy.key_order)
        state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        if options is not None:
            state[RECORD] = options
        _write(state, tmp)

    def publish() -> None:
        if rank == 0:
            _publish(root, name, tmp)

    for phase in (prepare, write, publish):
        error = _agreed(_attempt(phase))
        if error is not None:
            if rank == 0:  # every rank is past dcp.save: the disk space goes back
                _remove(tmp)
            return error
    return None


def _publish(root: Path, name: str, tmp: Path) -> None:
    """The written checkpoint `tmp` becomes `root/name`, named the latest (each replace is
    atomic: a crash leaves the previous latest readable), and only the newest KEEP stay."""
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    _remove(pointer)  # a crash's leftover
    pointer.write_text(name)
    os.replace(pointer, root / LATEST)
    for old in sorted(root.glob("step-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def _write(state: dict[str, Any], tmp: Path) -> None:
    """dcp.save, a full disk said as one: torch's own message for it is "unexpected pos 704
    vs 598" (its zip writer's short write)."""
    try:
        dcp.save(state, checkpoint_id=tmp)
    except (Exception, CheckpointException) as err:
        root = tmp.parent
        if _disk_full(err, root):
            free = shutil.disk_usage(root).free
            raise OSError(
                errno.ENOSPC,
                f"disk full: no space left in {root} ({free} bytes free): free some space "
                "there or choose another --checkpoint-dir",
            ) from None
        raise


def _attempt(phase: Any) -> str | None:
    try:
        phase()
    except OSError as err:
        if err.errno == errno.ENOSPC:  # _write says it already, with the directory
            said = err.strerror or ""
            return said if said.startswith("disk full") else f"disk full: {err}"
        return f"{type(err).__name__}: {err}"
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        return f"{type(err).__name__}: {err}"
    return None


def _remove(path: Path) -> None:
    """Remove a file or directory at `path`, if there is one. Best effort: after a failed
    write the directory may itself be gone (or a file), and the cleanup must never hide the
    failure it cleans up after."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


#: below this much free space, a failed write is taken for a full disk: torch's zip writer
#: reports ENOSPC as a short write ("unexpected pos"), without the errno
_NEARLY_FULL = 1 << 20


def _disk_full(err: BaseException, root: Path) -> bool:
    seen: list[BaseException] = [err]
    while seen:
        exc = seen.pop()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if isinstance(exc, CheckpointException):
            for failure in exc.failures.values():
                seen.append(failure[0] if isinstance(failure, tuple) else failure)
        seen += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    try:
        return shutil.disk_usage(root).free < _NEARLY_FULL
    except OSError:
        return False


def _agreed(error: str | None) -> str | None:
    """`error` where this rank failed, "" where only another did, None where none did."""
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl() else None
    failed = torch.tensor([0 if error is None else 1], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() == 0:
        return None
    return error if error is not None else ""


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def load(
    directory: str | os.PathLike,
    *,
    strategy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    config: Any,
) -> tuple[int, list[str]]:
    """Restore the newest checkpoint this run can read into this rank's objects; returns its
    step and the notes the run's result shows (collective). One whose data fails to load is
    skipped for the next older one: every object a failed load may have half written is
    written again by the one that loads. An option that cannot be resumed with raises
    ConfigError, a model that differs from the checkpoint's JobError (resume.py)."""
    objects = dict(strategy=strategy, optimizer=optimizer, scheduler=scheduler, rank=rank)

    def read(path: Path, metadata: Metadata) -> tuple[int, list[str]]:
        notes = check_options(saved_options(path, metadata), config, path)
        check_model(path, metadata, read_entry(path, metadata, "key_order"), strategy)
        return _load_from(path, metadata, **objects), notes

    (step, notes), skips = load_newest(directory, read, world_size=dist.get_world_size())
    if rank == 0:  # for a script under torchrun; the notebook warned before the engines started
        for note in skips + notes:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    return step, skips + notes


def _load_from(
    path: Path,
    metadata: Metadata,
    *,
    strategy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
) -> int:
    target = _state(strategy, optimizer, rank)
    params = dict(strategy.named_parameters())
    names = list(params)
    state_metadata = metadata.state_dict_metadata
    for name, param in params.items():  # optimizer state that does not exist yet (no step taken)
        like = target[f"model/{name}"] if f"model/{name}" in target else param
        for key, meta in state_metadata.items():
            if key.startswith(f"optim/{name}/") and key not in target:
                target[key] = _empty(meta, like=like)
    target.update(step=0, key_order=None, scheduler=None)
    dcp.load(target, storage_reader=SafeReader(path), planner=SafePlanner())
    strategy.load_checkpoint_state(
        {k.removeprefix("model/"): v for k, v in target.items() if k.startswith("model/")}
    )
    _load_optimizer(optimizer, names, target)
    if scheduler is not None and target["scheduler"] is not None:
        scheduler.load_state_dict(target["scheduler"])
    torch.set_rng_state(target[f"rng/{rank}"])
    return int(target["step"])


def _saved_as(value: torch.Tensor, entry: torch.Tensor | None) -> torch.Tensor:
    """An optimizer state saved as its parameter is: where the strategy saves a plain local
    parameter as a DTensor view of the whole (expert parallel's experts), a state shaped like
    that local parameter (momentum, Adam's moments) is saved as the same view, so that DCP
    writes each engine's rows of the whole and reads them back on another layout."""
    if not isinstance(entry, DTensor) or isinstance(value, DTensor):
        return value
    if value.shape != entry.to_local().shape:
        return value  # Adam's step: one number, the same on every engine
    return DTensor.from_local(
        value, entry.device_mesh, entry.placements, run_check=False,
        shape=entry.shape, stride=entry.stride(),
    )  # fmt: skip


def _empty(meta: Any, *, like: torch.Tensor) -> torch.Tensor:
    """Room for one saved optimizer entry: shaped like its parameter (momentum, Adam's
    moments; a DTensor shard when the parameter is sharded, or saved as one), else as saved
    (Adam's step). `like`: the parameter's own entry in the checkpoint."""
    if not isinstance(meta, TensorStorageMetadata):
        raise TypeError(f"expected a tensor in the checkpoint, found {meta}")
    if tuple(meta.size) == tuple(like.shape) and meta.properties.dtype == like.dtype:
        return torch.empty_like(like.detach())
    return torch.empty(meta.size, dtype=meta.properties.dtype)


#: an optimizer's param-group entries that say how its step runs, not what it trains with
_HOW = ("fused", "foreach", "capturable")


def _load_optimizer(optimizer: torch.optim.Optimizer, names: list[str], state: dict) -> None:
    packed = optimizer.state_dict()
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(names):
        prefix = f"optim/{name}/"
        found = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if found:
            entries[index] = found
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, found in entries.items():  # saved as a view of the whole (_saved_as): its rows
        if not isinstance(params[index], DTensor):
            entries[index] = {
                k: v.to_local() if isinstance(v, DTensor) else v for k, v in found.items()
            }
    # the saved hyperparameters, but how the step runs from this layout's optimizer: a
    # checkpoint written where the default AdamW could fuse (engine/loop.py) may resume on
    # a layout where it cannot (plain tensors beside DTensors), and the reverse
    groups = [
        {**saved, "params": current["params"], **{k: current[k] for k in _HOW if k in current}}
        for saved, current in zip(state["optim_groups"], packed["param_groups"])
    ]
    optimizer.load_state_dict({"state": entries, "param_groups": groups})
