"""Which Linear layers tensor parallel splits, and how (Megatron-LM's recipe).

A pair of Linear layers with an elementwise function between them (an MLP's up and down
projections) is split column-wise then row-wise: the first layer's output features are divided
among the T engines, each engine applies the function to its own columns, and the second
layer's input features are divided the same way, so one all-reduce of the second layer's
output completes the pair. Attention is split by heads: query, key and value projections
column-wise, the output projection row-wise, and the module's head count divided by T on each
engine (its forward must size its views from that count and its tensors, e.g.
`q.view(B, L, self.n_head, -1)` and `y.view(B, L, -1)`, as torchtitan's models do).

Found automatically: in every module, Linear children named like q/k/v projections (q, k, v,
query, key, value, wq, wk, wv, q_proj, k_proj, v_proj) beside an output projection (o, out,
wo, proj, out_proj, o_proj, c_proj, dense) and a head count (n_head, n_heads, num_heads,
nhead); otherwise consecutive Linear children where the first's outputs feed the second's
inputs. Layers whose weight is tied to another parameter are left whole.

By hand: define `tp_plan` in the cell, a dict from module path (fnmatch `*` allowed, as
parallelize_module takes it) to "colwise", "rowwise" or a torch ParallelStyle, e.g.
`tp_plan = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}`.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from sagenb.job import JobError

__all__ = ["derive_plan", "check_plan", "to_styles", "split_heads", "HEAD_ATTRS"]

QKV = re.compile(r"^(q|k|v|query|key|value|wq|wk|wv|[qkv]_proj)$")
OUT = re.compile(r"^(o|out|wo|proj|out_proj|o_proj|c_proj|dense)$")
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "nhead")
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def derive_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """{module path: "colwise" | "rowwise"} for `model` split `tp` ways."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise JobError(
            f"--strategy tensor splits nn.Linear layers, and model ({type(model).__name__}) has "
            "none; use --strategy data or sharded"
        )
    tied = _tied_ids(model)
    plan: dict[str, str] = {}
    for path, module in model.named_modules():
        children = [
            (name, child)
            for name, child in module.named_children()
            if isinstance(child, nn.Linear) and id(child.weight) not in tied
        ]
        prefix = f"{path}." if path else ""
        found = _attention(module, children, tp) or _pairs(children, tp)
        plan.update({prefix + name: style for name, style in found.items()})
    if not plan:
        shapes = ", ".join(f"{m.in_features}->{m.out_features}" for m in linears[:6])
        raise JobError(
            f"--tensor-parallel {tp}: found no Linear layers to split (no attention projections, "
            f"no Linear pair whose hidden width divides by {tp}; Linear shapes: {shapes}); "
            "give the plan by hand with tp_plan = {'path.to.linear': 'colwise', ...} in the cell"
        )
    return plan


def _attention(module: nn.Module, children: list, tp: int) -> dict[str, str]:
    counts = (getattr(module, attr, None) for attr in HEAD_ATTRS)
    heads = next((n for n in counts if isinstance(n, int)), None)
    qkv = [name for name, _ in children if QKV.match(name)]
    out = [name for name, _ in children if OUT.match(name)]
    if heads is None or len(qkv) < 3 or len(out) != 1 or heads % tp:
        return {}
    return {**dict.fromkeys(qkv, "colwise"), out[0]: "rowwise"}


def _pairs(children: list, tp: int) -> dict[str, str]:
    if any(QKV.match(name) for name, _ in children):
        return {}  # attention whose heads we cannot find: q -> k is no MLP pair
    found: dict[str, str] = {}
    i = 0
    while i + 1 < len(children):
        (a_name, a), (b_name, b) = children[i], children[i + 1]
        if a.out_features == b.in_features and a.out_features % tp == 0:
            found[a_name], found[b_name] = "colwise", "rowwise"
            i += 2
        else:
            i += 1
    return found


def _tied_ids(model: nn.Module) -> set[int]:
    """Parameters held by more than one module (an embedding tied to the output head)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


def check_plan(model: nn.Module, plan: dict[str, Any]) -> None:
    """Raise a JobError for a key of a hand-written plan that names no module of `model`.

    parallelize_module only warns about such a key, on the engine where nobody sees it, and
    splits nothing for it: a typo would train every layer whole without a word."""
    paths = [name.split(".") for name, _ in model.named_modules() if name]
    for key in plan:
        pattern = key.split(".")
        if key and not any(_path_matches(path, pattern) for path in paths):
            linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
            more = ", ..." if len(linears) > 6 else ""
            raise JobError(
                f"tp_plan[{key!r}] matches no module of the model, so nothing would be split "
                f"for it; its Linear layers are {', '.join(linears[:6])}{more} ('*' stands for "
                "one name, e.g. 'blocks.*.mlp.0')"
            )


def _path_matches(path: list[str], pattern: list[str]) -> bool:
    """parallelize_module's matching: name by name, fnmatch within each."""
    return len(path) == len(pattern) and all(map(fnmatch.fnmatchcase, path, pattern))


def to_styles(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with "colwise"/"rowwise" replaced by torch's ParallelStyle objects."""
    out = {}
    for path, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise JobError(
                    f"tp_plan[{path!r}] = {style!r}: must be 'colwise', 'rowwise' or a "
                    "torch.distributed.tensor.parallel ParallelStyle"
                )
            style = STYLES[style]()
        out[path] = style
    return out


def split_heads(model: nn.Module, plan: dict[str, Any], tp: int) -> None:
    """Divide by `tp` the head count of every module whose q/k/v projections are split
    column-wise: each engine then computes its own heads."""
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        split = [
            name
            for name, _ in module.named_children()
            if QKV.match(name) and _is_colwise(_style_at(plan, prefix + name))
        ]
        if not split:
            continue
        for attr in HEAD_ATTRS:
            heads = getattr(module, attr, None)
            if isinstance(heads, int):
                if heads % tp:
                    raise JobError(f"{prefix}{attr} = {heads} heads cannot be split {tp} ways")
                setattr(module, attr, heads // tp)


def _style_at(plan: dict[str, Any], path: str) -> Any:
    """The style the plan gives the module at `path`, matched as parallelize_module matches
    (name by name), so heads are divided exactly where torch splits the projections."""
    names = path.split(".")
    return next((s for key, s in plan.items() if _path_matches(names, key.split("."))), None)


def _is_colwise(style: Any) -> bool:
    return style == "colwise" or isinstance(style, ColwiseParallel)
