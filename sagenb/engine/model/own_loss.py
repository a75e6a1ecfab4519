"""The model's own loss, by the model's own convention: where its targets go in, where its loss
comes out, and which target value its loss leaves out.

Models compute their loss in more than one way. transformers' heads take `labels` and return
an output whose `loss` is set; the GPTs people copy (nanoGPT and its descendants) take
`forward(idx, targets=None)` and return `(logits, loss)`, with `ignore_index=-1`. sagenb reads
each model's convention from the model rather than from a list of names:

- the targets' keyword is read from forward's signature: `labels` when the batch has it (the
  contract's name for dict samples); else the one optional parameter of forward, other than
  its first (the input), that the batch supplies. Tuple samples `(input, target)` go in as
  `model(input, target)` when forward takes exactly two parameters.
- the loss is the output's `loss` (a `ModelOutput` or dict), or, for a tuple, its one scalar
  floating-point tensor: what the forward returns when it is given the targets, whatever the
  position.
- the value the loss leaves out of its mean is the `ignore_index` that forward's code passes
  to its loss, where its source can be read (torch's default -100 otherwise).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "LABELS",
    "IGNORE_INDEX",
    "target_key",
    "takes_target",
    "parameter_names",
    "loss_in",
    "ignore_index",
]

#: the contract's key for the targets of dict samples (transformers' convention)
LABELS = "labels"
#: the target value a mean-reduced loss leaves out (torch.nn.functional.cross_entropy's default)
IGNORE_INDEX = -100


def _parameters(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin forward: nothing can be read
        return []


def parameter_names(model: nn.Module, *, most: int = 8) -> str:
    """forward's parameters as an error names them, without annotations: "(idx,
    targets=None)"; the first `most` of a long list, then "..."."""
    shown = []
    for p in _parameters(model):
        star = "*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else ""
        default = "" if p.default is inspect.Parameter.empty else f"={p.default!r}"
        shown.append(f"{star}{p.name}{default if len(default) <= 12 else '=...'}")
    return f"({', '.join(shown[:most] + (['...'] if len(shown) > most else []))})"


def takes_target(model: nn.Module) -> bool:
    """Whether forward takes exactly two parameters, (input, target): tuple samples then go in
    as model(input, target)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = _parameters(model)
    return len(params) == 2 and all(p.kind in positional for p in params)


def target_key(model: nn.Module, keys: list[str]) -> tuple[str | None, str]:
    """The key of a dict batch (with `keys`) that the model takes as its targets, and, when
    there is none, what was looked for and what was found instead."""
    if LABELS in keys:
        return LABELS, ""
    params = _parameters(model)
    named = {p.name: p for p in params if p.kind != inspect.Parameter.VAR_KEYWORD}
    first = params[0].name if params else None
    empty = inspect.Parameter.empty
    optional = [k for k in keys if k in named and k != first and named[k].default is not empty]
    if len(optional) == 1 and LABELS not in named:
        return optional[0], ""
    forward = f"{type(model).__name__}.forward{parameter_names(model)}"
    if LABELS in named or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        found = f"none is '{LABELS}', which {forward} takes"
    elif not optional:
        found = f"none is an optional parameter of {forward} but its first"
    else:
        found = (
            f"{' and '.join(optional)} are all optional parameters of {forward}, so which one "
            f"holds the targets is not known"
        )
    looked = f"sagenb looks for '{LABELS}', else for the one key forward takes as an option"
    return None, f"{looked}, and of their keys ({', '.join(keys)}) {found}"


def loss_in(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries: its `loss` (a ModelOutput, a dict, an object), or a
    tuple's one scalar floating-point tensor; None when there is none, or no single one."""
    if isinstance(output, Mapping):  # transformers' ModelOutput is an OrderedDict too
        return output.get("loss")
    if isinstance(output, (tuple, list)):
        scalars = [
            t
            for t in output
            if torch.is_tensor(t) and t.dim() == 0 and (t.is_floating_point() or t.is_complex())
        ]
        return scalars[0] if len(scalars) == 1 else None
    return getattr(output, "loss", None) if not torch.is_tensor(output) else None


def ignore_index(model: nn.Module) -> int:
    """The target value the model's own loss leaves out: the one integer constant that its
    forward's code passes as `ignore_index=` (nanoGPT's -1), or torch's default -100 when the
    source cannot be read or says none (or several)."""
    forward = next(
        (c.__dict__["forward"] for c in type(model).__mro__ if "forward" in c.__dict__), None
    )
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):  # a builtin, or source nobody kept
        return IGNORE_INDEX
    found = {
        value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "ignore_index" and (value := _integer(k.value)) is not None
    }
    return found.pop() if len(found) == 1 else IGNORE_INDEX


def _integer(node: ast.expr) -> int | None:
    """An integer literal, `-1` (a unary minus on 1) included; None for anything else."""
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        sign, node = -1, node.operand
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return sign * node.value
    return None
