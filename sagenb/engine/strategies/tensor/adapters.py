"""peft's LoRA layers in a tensor-parallel plan: the layer is planned as the Linear it wraps,
then split as base layer plus adapters.

peft's `lora.Linear` (https://huggingface.co/docs/peft/developer_guides/lora) holds the model's
own layer as `base_layer` and adds `lora_B(lora_A(dropout(x))) * scaling` to its output, with
`lora_A` (in -> r) and `lora_B` (r -> out) in ModuleDicts keyed by adapter name. A plan entry
naming the LoRA layer (`q_proj`, as the model's plan names it) is expanded (`expand`) so that
the adapter path computes what the base computes on each engine:

- column-wise base (output features split): `lora_A` stays whole (every engine has the whole
  input), `lora_B` is split column-wise like the base, so each engine adds its own columns;
- row-wise base (input features split, partial outputs summed): `lora_A` is split row-wise
  like the base, its partial r-wide outputs summed across the engines, and `lora_B` stays
  whole, its output added once to the base's summed output.

The parameters keep their names (`q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`),
so the gathered state_dict has the model's own keys. Other peft layers (Embedding and Conv
LoRA, DoRA and other variants, which read the base weight's norm) are refused by their
module path when a plan would split them.
"""

from __future__ import annotations

import copy
from typing import Any, cast

from torch import nn
from torch.distributed.tensor import Replicate

from sagenb.config.job import JobError
from sagenb.engine.strategies.tensor.styles import is_conv1d, splits

__all__ = ["base_layer", "is_peft", "expand", "inner_layers", "qualified_name", "refuse"]


def qualified_name(module: nn.Module) -> str:
    """The class by its module path (`peft.tuners.lora.layer.Linear`), as errors name it."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_peft(module: nn.Module) -> bool:
    """A peft tuner layer: it wraps the model's own layer as `base_layer`."""
    return type(module).__module__.startswith("peft.") and hasattr(module, "base_layer")


def base_layer(module: nn.Module) -> nn.Module | None:
    """The Linear or Conv1D a plain LoRA layer wraps; None for anything else."""
    if not is_peft(module) or _refusal(module) is not None:
        return None
    return module.base_layer if isinstance(module.base_layer, nn.Module) else None


def inner_layers(model: nn.Module) -> dict[int, str]:
    """{id of a base layer or adapter: path of the LoRA layer holding it}."""
    inside: dict[int, str] = {}
    for path, module in model.named_modules():
        if base_layer(module) is not None:
            parts = [module.base_layer, *module.lora_A.values(), *module.lora_B.values()]
            inside.update({id(part): path for part in parts})
    return inside


def _refusal(module: nn.Module) -> str | None:
    """Why a peft layer cannot be split, or None."""
    adapters = [getattr(module, "lora_A", None), getattr(module, "lora_B", None)]
    dicts = [a for a in adapters if isinstance(a, nn.ModuleDict)]
    if len(dicts) != 2 or not all(isinstance(m, nn.Linear) for a in dicts for m in a.values()):
        return "sagenb splits only LoRA layers whose lora_A and lora_B are nn.Linear"
    variants = getattr(module, "lora_variant", None)
    if variants:  # DoRA and others read the base weight whole (its norm)
        return f"it uses a LoRA variant ({', '.join(map(str, variants))}, e.g. DoRA)"
    base = getattr(module, "base_layer", None)
    if not (isinstance(base, nn.Linear) or (base is not None and is_conv1d(base))):
        return f"its base layer is a {qualified_name(base) if base is not None else None}"
    return None


def refuse(path: str, module: nn.Module, kind: str) -> None:
    """A JobError for a peft layer a plan splits `kind` and that cannot be split."""
    why = _refusal(module) if is_peft(module) else None
    if why is None:
        return
    raise JobError(
        f"tp plan: {path!r} is a {qualified_name(module)} and {kind} cannot split it: {why}; "
        f"leave {path.rsplit('.', 1)[-1]!r} out of the LoRA config's target_modules, or give "
        f"tp_plan by hand in the cell leaving {path!r} whole"
    )


def expand(model: nn.Module, styles: dict[str, Any], matches: Any) -> dict[str, Any]:
    """`styles` with each entry that names LoRA layers replaced by entries for their base
    layers and adapters (see the module's docstring); `matches(model, key)` lists the modules
    a key names. A key naming LoRA and plain layers alike (LoRA on some blocks only) is
    replaced by one entry per layer."""
    out: dict[str, Any] = {}
    for key, style in styles.items():
        found = matches(model, key)
        kind = splits(style)
        lora = [path for path, m in found if base_layer(m) is not None]
        if kind is None or not lora:
            out[key] = style
        elif len(lora) == len(found):
            out.update(_parts(key, style, kind, [m for _, m in found]))
        else:
            for path, m in found:
                out.update(_parts(path, style, kind, [m]) if path in lora else {path: style})
    return out


def _parts(key: str, style: Any, kind: str, layers: list[nn.Module]) -> dict[str, Any]:
    parts = {f"{key}.base_layer": style}
    # lora_A: a ModuleDict by adapter name (nn.Module's __getattr__ types it Tensor | Module)
    adapters: set[str] = {name for m in layers for name in cast(nn.ModuleDict, m.lora_A)}
    for name in sorted(adapters):
        if kind == "colwise":  # lora_A's r-wide output comes whole to every engine
            parts[f"{key}.lora_B.{name}"] = _with_input(style, Replicate())
        else:  # lora_A's input comes as the base's does; its partial sum is reduced
            parts[f"{key}.lora_A.{name}"] = copy.deepcopy(style)
    return parts


def _with_input(style: Any, layout: Any) -> Any:
    style = copy.deepcopy(style)
    style.input_layouts = (layout,)
    style.desired_input_layouts = (layout,)
    return style
