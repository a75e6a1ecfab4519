"""The trained model back in the kernel: the cell's model built again here, as the engines
built it, holding the run's parameters; and saved in the format its library loads.

Only the engines run the cell during training. To hand back a model rather than its
state_dict, the kernel runs the cell once more, under the run's seed (and `--delay-init`),
and loads the full state_dict the ranks returned into it. Saving goes through the model's own
library: transformers' `save_pretrained` (config.json, model.safetensors), peft's for a
`peft.PeftModel` (the adapter alone: adapter_config.json, adapter_model.safetensors), or,
merged, `merge_and_unload()` first (the base with the adapter folded in, as a plain
transformers model).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sagenb.config.job import Job, JobError
from sagenb.engine.data.collation import RandomStateKept
from sagenb.engine.model.delayed import meta_parameters
from sagenb.engine.workspace import seed_everything

__all__ = ["CellModel", "save_pretrained"]

#: what a cell's data may be called: dropped from the kernel's copy of the cell's namespace,
#: which the model's own methods keep alive (their globals) as long as the model lives
_DATA_NAMES = ("dataset", "eval_dataset")


@dataclass(frozen=True)
class CellModel:
    """How a run's job builds its model: enough to build it again in the kernel."""

    job: Job
    #: --seed: torch's, Python's and numpy's RNGs are seeded with it before the cell runs
    seed: int
    #: --delay-init: parameters are created on the meta device, never initialised here
    delay_init: bool = False

    def build(self) -> nn.Module:
        """The job's model as an engine builds it (on the meta device with --delay-init).

        The whole job runs here, in this process: its imports, its model and its dataset
        (sagenb's checks of the job and its first batch are skipped). The kernel's own random
        state is left as it was.
        """
        with RandomStateKept(), _one_rank():
            seed_everything(self.seed)
            with meta_parameters() if self.delay_init else nullcontext():
                ns = self.job.namespace()
        if "model" not in ns:
            raise JobError("the job defines no model")
        if not isinstance(ns["model"], nn.Module):
            raise JobError(f"model must be a torch.nn.Module, got {type(ns['model']).__name__}")
        for name in _DATA_NAMES:  # the model's methods hold ns: its data need not stay
            ns.pop(name, None)
        return ns["model"]

    def trained(self, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
        """The job's model holding `state_dict` (the run's, every key of model.state_dict()),
        on the CPU, in eval mode (as `from_pretrained` returns one)."""
        model = self.build()
        _allocate(model)
        model.load_state_dict(state_dict, strict=True)
        return model.eval()

    def save_pretrained(
        self,
        state_dict: Mapping[str, torch.Tensor],
        directory: str | Path,
        *,
        merge: bool = False,
        **kwargs: Any,
    ) -> Path:
        """`save_pretrained` of the job's model holding `state_dict`."""
        _check_merge(merge)
        return save_pretrained(self.trained(state_dict), directory, merge=merge, **kwargs)


@contextmanager
def _one_rank() -> Iterator[None]:
    """A process group of one rank while the cell runs here, where it has none: a cell that
    asks `dist.get_rank()` (to print on rank 0 only, say) failed with "Default process group
    has not been initialized". Here it is rank 0 of 1, as one process is; a group the kernel
    made itself is left as it is."""
    import torch.distributed as dist

    if dist.is_initialized() or not dist.is_available():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_pretrained(
    model: nn.Module, directory: str | Path, *, merge: bool = False, **kwargs: Any
) -> Path:
    """Write `model` in its library's own format to `directory`; returns it as a Path, only
    once something was written there (NotADirectoryError for a file, RuntimeError otherwise).

    A transformers model: its config and safetensors. A peft.PeftModel: its adapter, or, with
    `merge`, the base with the adapter merged in (merge_and_unload) as a transformers model.
    `kwargs` go to the library's save_pretrained (max_shard_size=..., for one).
    """
    _check_merge(merge)
    if _is_peft(model):
        if merge:
            model = model.merge_and_unload()  # type: ignore[operator]
        else:
            _check_adapter_saves_all(model)
    elif merge:
        raise ValueError(
            f"merge=True: needs a peft.PeftModel, whose adapter is merged into its base; the "
            f"model is {_class_path(model)}, which has no adapter: use merge=False"
        )
    elif not _is_transformers(model):
        raise TypeError(_not_pretrained(model))
    path = Path(directory)
    if path.exists() and not path.is_dir():
        # transformers only logs "should be a directory" and writes nothing
        raise NotADirectoryError(
            f"save_pretrained: {path} is a file, not a directory: name a directory (made if "
            "it is not there; files of the same names in it are replaced)"
        )
    before = _written(path)
    model.save_pretrained(directory, **kwargs)  # type: ignore[operator]
    if not path.is_dir() or _written(path) == before:
        raise RuntimeError(
            f"save_pretrained: {type(model).__name__}.save_pretrained wrote nothing to {path}: "
            "see what the library logged above"
        )
    return path


def _written(path: Path) -> dict[str, tuple[int, int]]:
    """Each file in `path` with its size and modification time (ns): what a save changes."""
    if not path.is_dir():
        return {}
    written = {}
    for entry in path.iterdir():
        info = entry.lstat()  # a link's own: one that leads nowhere is no error
        written[entry.name] = (info.st_size, info.st_mtime_ns)
    return written


def _check_merge(merge: object) -> None:
    if not isinstance(merge, bool):
        raise TypeError(f"merge={merge!r}: must be True or False")


def _is_peft(model: nn.Module) -> bool:
    # imported by whoever built the model: a model of a library never imported is not one
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _is_transformers(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _not_pretrained(model: nn.Module) -> str:
    """What to do with a model that is neither a transformers nor a peft model."""
    held = next(
        (
            name
            for name, m in model.named_modules()
            if name and (_is_peft(m) or _is_transformers(m))
        ),
        None,
    )
    inside = (
        f" It holds a {_class_path(model.get_submodule(held))} at .{held}: "
        f"`result.model().{held}.save_pretrained(directory)` saves that one."
        if held
        else ""
    )
    return (
        f"save_pretrained needs a transformers model (transformers.PreTrainedModel) or a "
        f"peft.PeftModel; the cell's model is {_class_path(model)}.{inside} For any model: "
        f"torch.save(result.state_dict(), path), loaded back with "
        f"model.load_state_dict(torch.load(path))"
    )


def _check_adapter_saves_all(model: nn.Module) -> None:
    """peft saves the adapter's parameters only: a trained parameter outside it (the base
    unfrozen by hand) would be lost from the files, so it is refused."""
    from peft import get_peft_model_state_dict  # the model is a PeftModel: peft is installed

    saved = {t.data_ptr() for t in get_peft_model_state_dict(model).values()}
    lost = [n for n, p in model.named_parameters() if p.requires_grad and p.data_ptr() not in saved]
    if lost:
        raise ValueError(
            f"the run trained {len(lost)} parameters outside the adapter ({', '.join(lost[:3])}"
            f"{', ...' if len(lost) > 3 else ''}), which the adapter's files would not hold: "
            f"save with merge=True (the whole model), or list those modules in the cell's "
            f"LoraConfig(modules_to_save=[...])"
        )


def _allocate(model: nn.Module) -> None:
    """Give meta parameters (--delay-init) uninitialised memory on the CPU, a tied parameter
    once, so the trained values are loaded into the model without initialising it first."""
    fresh: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not p.is_meta:
            continue
        if id(p) not in fresh:
            fresh[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, fresh[id(p)])
