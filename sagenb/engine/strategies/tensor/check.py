"""Checks a tensor-parallel plan before training: a plan that cannot work is a JobError naming
the layer, not a shape error inside the first step (sagenb issue 15).

Two checks, both before the first step: an analytic one of every split layer (its kind, the
divisibility of the features it splits, tied weights), then a trial forward of the split
model on one sample of the dataset, which catches what shapes alone cannot (a view sized by a
head count that is now wrong, a gated product of a split and a whole tensor). The trial runs
in eval mode under no_grad with the RNG forked, so training starts from exactly the state it
would have had without it; every engine runs it, as the split forward is a collective.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sagenb.config.job import JobError
from sagenb.engine.data.order import fetch, to_device
from sagenb.engine.objective import Objective
from sagenb.engine.strategies.tensor.adapters import qualified_name, refuse
from sagenb.engine.strategies.tensor.dataflow import features, is_splittable
from sagenb.engine.strategies.tensor.styles import splits

__all__ = ["check_shapes", "example", "trial_forward", "matches", "path_matches"]


def path_matches(path: str, key: str) -> bool:
    """parallelize_module's matching: name by name, fnmatch within each."""
    names, pattern = path.split("."), key.split(".")
    return len(names) == len(pattern) and all(map(fnmatch.fnmatchcase, names, pattern))


def matches(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if p and path_matches(p, key)]


def check_shapes(model: nn.Module, styles: dict[str, Any], tp: int, tied: set[int]) -> None:
    """Each module a plan entry splits: a kind torch's styles split, features dividing by
    `tp`, no weight shared with another module."""
    for key, style in styles.items():
        kind = splits(style)
        if kind is None:
            continue  # another ParallelStyle (SequenceParallel, ...): the trial forward tells
        for path, module in matches(model, key):
            _check_layer(path, module, kind, tp, tied)


def _check_layer(path: str, module: nn.Module, kind: str, tp: int, tied: set[int]) -> None:
    refuse(path, module, kind)  # a peft layer other than LoRA on a Linear
    if isinstance(module, nn.Embedding):
        # row-wise splits the vocabulary, column-wise the width
        size = module.num_embeddings if kind == "rowwise" else module.embedding_dim
        what = "num_embeddings" if kind == "rowwise" else "embedding_dim"
    elif is_splittable(module):
        size = features(module)[0 if kind == "rowwise" else 1]
        what = "in_features" if kind == "rowwise" else "out_features"
    else:
        raise JobError(
            f"tp plan: {path!r} is a {qualified_name(module)}; {kind} splits only "
            "torch.nn.Linear, torch.nn.Embedding, transformers' Conv1D and peft's LoRA layers "
            "wrapping them; leave it out of tp_plan to keep it whole"
        )
    if size % tp:
        raise JobError(
            f"tp plan: {path!r} ({qualified_name(module)}) split {kind} {tp} ways, but its "
            f"{what} = {size} does not divide by {tp}; use a --tensor-parallel that divides "
            f"it or leave {path!r} whole"
        )
    if any(id(p) in tied for p in module.parameters(recurse=False)):
        raise JobError(
            f"tp plan: {path!r} shares its weight with another module (tied embeddings); "
            "splitting it would untie them: leave it out of tp_plan"
        )


def example(
    module: nn.Module, dataset: Any, objective: Objective, device: torch.device
) -> Callable[[], Any]:
    """A forward of `module` on the dataset's first sample that leaves no trace: eval mode,
    no gradients, the RNG forked (training starts from the state it would have had)."""

    def run() -> Any:
        was_training = module.training
        devices = [device] if device.type != "cpu" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=device.type):
                module.eval()
                first = fetch(dataset, torch.arange(1), objective.collate_fn)
                args, kwargs, _ = objective.split(to_device(first, device))
                return module(*args, **kwargs)
        finally:
            module.train(was_training)

    return run


def trial_forward(
    module: nn.Module, dataset: Any, objective: Objective, device: torch.device
) -> None:
    """Run the split model on the dataset's first sample; a failure names the innermost
    module that was running."""
    running: list[str] = []
    names = {id(m): p or "<model>" for p, m in module.named_modules()}
    handles = []

    def enter(m: nn.Module, args: Any) -> None:
        running.append(names[id(m)])

    def leave(m: nn.Module, args: Any, out: Any) -> None:  # None: the output stays as it is
        running.pop()

    for m in module.modules():
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        example(module, dataset, objective, device)()
    except Exception as exc:
        where = running[-1] if running else "<model>"
        raise JobError(
            f"--strategy tensor: a trial forward of the split model on one sample failed in "
            f"{where!r}: {type(exc).__name__}: {str(exc)[:300]}; the plan splits layers that "
            "this forward cannot use split: give tp_plan by hand in the cell leaving them whole"
        ) from exc
    finally:
        for h in handles:
            h.remove()
