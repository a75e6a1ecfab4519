"""A cell's `make_optimizer(params)`, checked against the parameters it was given.

The everyday `make_optimizer` of model code as people copy it ignores its argument:
`return model.configure_optimizers(...)` builds the model's own weight-decay groups over the
cell's `model`, and `torch.optim.SGD(params_list)` may use a list taken at the top of the cell.
Where the strategy trains the cell's own parameter objects (data parallel wraps them; sharded
and tensor parallel replace them in place, so a closure over `model` sees the new ones) that
is the same thing. Where it trains others (a pipeline's stages, a list taken before sharding
replaced them), such an optimizer would update nothing this engine trains, or another model,
and the run would finish all the same.

So the optimizer's parameters are compared with those it was given. Those of the cell's model
(known by their names in it, as it was built and as it is now) are mapped onto the strategy's
parameters of the same names, each group keeping its hyperparameters (weight decay, lr), and
the cell says so once: the mapping Accelerate makes for an optimizer created before FSDP
wrapped the model (accelerate's `Accelerator._prepare_fsdp`, params swapped by name in each
`param_group`). Parameters that are neither, or trainable ones the optimizer leaves out, are
refused before the first step, naming how many and which.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from sagenb.config.job import JobError

__all__ = ["cell_parameters", "checked"]

#: how many parameter names an error or a note lists
SHOWN = 4


def cell_parameters(model: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """id -> (name, parameter) of the cell's model as it was built, before any strategy
    wrapped or split it (the parameters are held, so their ids stay theirs)."""
    return {id(p): (name, p) for name, p in model.named_parameters()}


def checked(
    optimizer: torch.optim.Optimizer,
    given: Iterable[tuple[str, nn.Parameter]],
    known: Mapping[int, str],
) -> tuple[torch.optim.Optimizer, list[str]]:
    """`optimizer` (from the cell's make_optimizer over the parameters `given`, with their
    names in the unsplit model), as it is when it holds exactly those, else with its groups
    mapped onto them by name (`known`: id -> name of the cell's model's parameters), and
    what to say under the cell; a JobError where neither can be."""
    given = list(given)
    by_id = {id(p): name for name, p in given}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if {id(p) for p in held} == set(by_id):
        return optimizer, []
    name_of = {id(p): by_id.get(id(p)) or known.get(id(p)) for p in held}
    kind = type(optimizer).__name__
    _refuse_strangers(kind, [p for p in held if name_of[id(p)] is None])
    mine = dict(given)
    # each group's parameters by name, those this engine trains (another stage's are not here)
    mapped_groups = [
        [mine[n] for p in group["params"] if (n := name_of[id(p)]) in mine]
        for group in optimizer.param_groups
    ]
    updated = {id(p) for params in mapped_groups for p in params}
    missing = [name for name, p in given if p.requires_grad and id(p) not in updated]
    if missing:
        raise JobError(
            f"make_optimizer's {kind} leaves out {len(missing)} of the {len(given)} trainable "
            f"parameters it was given ({_listed(missing)}), which would get gradients and "
            f"never change: build it over the params argument, and set requires_grad=False "
            f"on the parameters you mean to freeze"
        )
    for group, params in zip(optimizer.param_groups, mapped_groups):
        group["params"] = params  # in place: each group keeps its hyperparameters
    mapped = sum(1 for p in held if id(p) not in by_id)
    named = [name_of[id(p)] for p in held]
    if not mapped:  # a subset of the given ones, the rest frozen
        return optimizer, []
    return optimizer, [
        f"make_optimizer's {kind} holds the cell's model's parameters, not the params it was "
        f"given: its {len(optimizer.param_groups)} parameter group(s) were mapped onto this "
        f"run's parameters by name ({mapped} parameter(s) on rank 0, e.g. {_listed(named)}), "
        f"each group keeping its hyperparameters"
    ]


def _refuse_strangers(kind: str, strangers: Sequence[nn.Parameter]) -> None:
    """A JobError naming the parameters an optimizer holds that no name maps."""
    if strangers:
        shapes = ", ".join(str(tuple(p.shape)) for p in strangers[:SHOWN])
        raise JobError(
            f"make_optimizer's {kind} holds {len(strangers)} parameters that are neither the "
            f"params it was given nor the cell's model's (shapes {shapes}"
            f"{', ...' if len(strangers) > SHOWN else ''}): build it over the params argument "
            f"(or over the model's named_parameters()), so it updates what this run trains"
        )


def _listed(names: Sequence[str | None]) -> str:
    shown = [str(n) for n in names[:SHOWN]]
    return ", ".join(shown) + (", ..." if len(names) > SHOWN else "")
