"""Delayed parameter initialisation (`--delay-init`): build a model too big for one engine.

While the cell runs, every parameter a module registers is replaced by a meta-device twin
(buffers stay real, as in accelerate's `init_empty_weights`), so building the model allocates
no parameter memory. Each engine then materialises only the parameters of its own pipeline
stage(s).

Initial values: each module that owns parameters is re-initialised on its own, under a
generator seeded from (--seed, the module's name in the model): its parameters are first drawn
from N(0, 0.02) (GPT-2's convention; what a raw `nn.Parameter` keeps), then the module's own
`reset_parameters()` runs when it has one. So every engine, and a single process that
materialises the whole model with `materialize`, start from the same values, whatever the
split; they differ from an eager run's initial values, as with torchtitan's meta-device init.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from sagenb.engine.model.pretrained import Checkpoint, name_aliases
from sagenb.engine.torch_private import direct_parameters

__all__ = ["meta_parameters", "materialize", "release_others", "HUB_KERNELS"]

#: transformers' switch for Hugging Face hub kernels (transformers/integrations/hub_kernels.py)
HUB_KERNELS = "USE_HUB_KERNELS"


@contextmanager
def meta_parameters() -> Iterator[set[int]]:
    """Parameters registered inside are created on the meta device.

    Yields the ids of the modules whose parameters were given values after they were built
    (a real parameter set where a meta one was: how transformers' `from_pretrained` loads):
    those values are dropped too, and `pretrained.find_checkpoint` reads them again."""
    original = nn.Module.register_parameter
    loaded: set[int] = set()

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            held = direct_parameters(self).get(name)
            if held is not None and held.is_meta:
                loaded.add(id(self))
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    # a patch of the class for the duration of the block, on purpose
    nn.Module.register_parameter = register  # type: ignore[method-assign]
    kernels = os.environ.get(HUB_KERNELS)
    # transformers 5.25's from_pretrained swaps layers for the `kernels` package's by
    # default, which refuses modules on the meta device ("Unsupported device type 'meta'"):
    # off while the cell builds its model here, as transformers' own tests turn them off
    os.environ[HUB_KERNELS] = "NO"
    try:
        yield loaded
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        if kernels is None:
            os.environ.pop(HUB_KERNELS, None)
        else:
            os.environ[HUB_KERNELS] = kernels


def materialize(
    model: nn.Module,
    parts: Sequence[nn.Module],
    *,
    seed: int,
    device: torch.device,
    checkpoint: Checkpoint | None = None,
    defer: bool = False,
) -> None:
    """Give real values to the meta parameters that `parts` use: the checkpoint's where it
    holds them, else sagenb's seeded initial values.

    `parts` are the unsplit `model` itself or stage modules cut from it (they share its
    submodules). A tied parameter is materialised (and read) once and stays shared. With
    `defer`, parameters the checkpoint holds stay on the meta device, for the strategy to
    split them first and read only its part (`pretrained.load_local`).
    """
    # keyed by id(), holding the objects: a freed meta parameter's id could be reused
    wanted = {
        id(p): p
        for part in parts
        for _, p in part.named_parameters(remove_duplicate=False)
        if p.is_meta
    }
    aliases = name_aliases(model)
    fresh: dict[int, nn.Parameter] = {}
    for name, owner in model.named_modules(remove_duplicate=False):
        own = direct_parameters(owner)
        direct = {key: p for key, p in own.items() if p is not None and id(p) in wanted}
        direct = {key: p for key, p in direct.items() if id(p) not in fresh}
        keys = {key: _file_key(checkpoint, aliases[id(p)]) for key, p in direct.items()}
        if defer:
            direct = {key: p for key, p in direct.items() if keys[key] is None}
        if not direct:
            continue
        for key, p in direct.items():
            fresh[id(p)] = nn.Parameter(
                torch.empty_like(p, device=device), requires_grad=p.requires_grad
            )
            own[key] = fresh[id(p)]
        if any(keys[key] is None for key in direct):  # seeded values for what no file holds
            _initialise(owner, name, seed)
        _read(own, {key: keys[key] for key in direct}, checkpoint, name)
    for module in [*model.modules(), *(m for part in parts for m in part.modules())]:
        own = direct_parameters(module)
        for key, held in own.items():
            if held is not None and id(held) in fresh:
                own[key] = fresh[id(held)]


def _file_key(checkpoint: Checkpoint | None, names: list[str]) -> str | None:
    return checkpoint.key_of(names) if checkpoint is not None else None


@torch.no_grad()
def _read(
    own: dict, keys: dict[str, str | None], checkpoint: Checkpoint | None, owner: str
) -> None:
    for key, file_key in keys.items():
        if file_key is not None and checkpoint is not None:
            name = f"{owner}.{key}" if owner else key
            own[key].copy_(checkpoint.read(file_key, own[key].shape, name=name))


@torch.no_grad()
def _initialise(owner: nn.Module, name: str, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        for p in direct_parameters(owner).values():
            if p is not None and not p.is_meta:
                nn.init.normal_(p, std=0.02)
        # getattr: nn.Module.__getattr__ is typed Tensor | Module, which mypy cannot call
        reset = getattr(owner, "reset_parameters", None)
        if reset is not None:
            reset()


def release_others(model: nn.Module, parts: Sequence[nn.Module]) -> None:
    """Move to the meta device every parameter of `model` that `parts` do not use.

    The cell's namespace keeps the unsplit model alive (its functions' globals refer to it),
    so without this an engine would hold every stage's parameters, not just its own.
    """
    keep = {id(p): p for part in parts for _, p in part.named_parameters(remove_duplicate=False)}
    gone: dict[int, nn.Parameter] = {}
    for module in model.modules():
        own = direct_parameters(module)
        for key, p in own.items():
            if p is None or id(p) in keep or p.is_meta:
                continue
            if id(p) not in gone:
                gone[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            own[key] = gone[id(p)]
