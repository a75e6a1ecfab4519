"""Which layers tensor parallel splits, and how (Megatron-LM's recipe), from three sources.

A group of layers with only elementwise functions between them (an MLP's up and down
projections; a gated MLP's gate and up, then down) is split column-wise then row-wise: the
first layers' output features are divided among the T engines, each engine applies the
functions to its own columns, and the last layer's input features are divided the same way,
so one all-reduce of its output completes the group. Attention is split by heads: query, key
and value projections column-wise, the output projection row-wise.

Where the plan comes from (`plan_for`), in order:

1. By hand: `tp_plan` in the cell, a dict from module path (fnmatch `*` for one name, as
   parallelize_module takes it) to a style name or a torch ParallelStyle, e.g.
   `tp_plan = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}`. Used as given.
2. Shipped: a transformers model, or one held by the cell's model as a submodule, brings its
   own `_tp_plan` (hf_plan.py); its style names are translated to torch styles
   (styles.py). Tied embedding/head entries are dropped (left whole). So are the entries of
   a mixture-of-experts layer's packed experts (a module holding 3-D weights, one slice per
   expert: transformers' `packed_colwise` and `moe_tp_experts` styles, and the `rowwise`
   of their down projection), which torch's styles cannot split: those experts stay whole
   on every engine, the run says so (`Plan.notes`), and the rest of the model is split.
3. Derived, for the rest of the model (`derive_plan`): attention from names (below), then
   column/row groups from the dataflow of each module torch.fx traces (dataflow.py), then
   the groups of one recorded forward on the dataset's first sample (recorded.py), which
   follows the split axis through the views of attention by the tensors' shapes: BERT's and
   ViT's encoders, whose blocks torch.fx cannot trace, get q/k/v column-wise and the
   attention output row-wise, their MLP's up column-wise and down row-wise.

Attention from names: in every module, Linear children named like q/k/v projections (q, k,
v, query, key, value, wq, wk, wv, q_proj, k_proj, v_proj) beside one output projection (o,
out, wo, proj, out_proj, o_proj, c_proj, dense) and a head count (n_head, n_heads, num_heads,
nhead), which `split_heads` divides by T on each engine (its forward must size its views from
that count and its tensors, e.g. `q.view(B, L, self.n_head, -1)`, as torchtitan's models do).
torch.fx's graph cannot see heads without shapes, hence names there; the recorded forward
has the shapes, and asks each view that splits the features into heads to say -1 for the
heads (transformers' `view(*shape, -1, head_dim)`), so that each engine's view counts its
own heads with no attribute changed, as transformers' own plans rely on. Fused projections
(GPT-2's Conv1D `c_attn`, torch's nn.MultiheadAttention) stay whole: a column split would
give each engine a slice of q, k, v side by side, not its own heads; GPT-2's MLP (Conv1D c_fc,
c_proj) is split. Layers whose weight is tied to another parameter stay whole.

A peft LoRA layer is planned as the Linear it wraps, then expanded into its base layer and
adapters (adapters.py): `Plan.layers` names the LoRA layer, `Plan.styles` its parts.

Every plan is checked before the first step (check.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from torch import nn

from sagenb.config.job import JobError
from sagenb.engine.strategies.tensor.adapters import expand, inner_layers, qualified_name
from sagenb.engine.strategies.tensor.check import check_shapes, matches, path_matches
from sagenb.engine.strategies.tensor.dataflow import dataflow_pairs, features, is_splittable
from sagenb.engine.strategies.tensor.hf_plan import shipped_plans
from sagenb.engine.strategies.tensor.recorded import recorded_pairs
from sagenb.engine.strategies.tensor.styles import splits, to_styles
from sagenb.engine.torch_private import direct_parameters

__all__ = ["Plan", "plan_for", "derive_plan", "check_plan", "to_styles", "split_heads"]
__all__ += ["HEAD_ATTRS"]

QKV = re.compile(r"^(q|k|v|query|key|value|wq|wk|wv|[qkv]_proj)$")
OUT = re.compile(r"^(o|out|wo|proj|out_proj|o_proj|c_proj|dense)$")
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "nhead")


class Plan:
    """What parallelize_module applies (`styles`: LoRA layers expanded into their base
    layers and adapters), the same by layer (`layers`: what `split_heads` reads), and what
    `split_heads` must leave alone (transformers subtrees, whose attention needs no head
    count changed)."""

    def __init__(self, layers: dict[str, Any], source: str, shipped_roots: set[str]):
        self.layers, self.source, self.shipped_roots = layers, source, shipped_roots
        self.styles = layers
        #: what the run is told: the shipped entries left out, and why
        self.notes: list[str] = []


def plan_for(
    model: nn.Module,
    tp: int,
    hand: dict[str, Any] | None,
    *,
    example: Callable[[], Any] | None = None,
) -> Plan:
    """The plan for `model` split `tp` ways: by hand, else shipped plus derived (`example`
    runs the model on one sample, for the recorded dataflow); checked against the model's
    shapes (a JobError naming the layer)."""
    tied = _tied_ids(model)
    if hand is not None:
        check_plan(model, hand)
        plan = Plan(to_styles(hand, "tp_plan"), "tp_plan", set())
    else:
        shipped, roots = shipped_plans(model, tp)
        shipped = {k: v for k, v in shipped.items() if not _holds_tied(model, k, tied)}
        experts = {k: v for k, v in shipped.items() if _packed_experts(model, k)}
        shipped = {k: v for k, v in shipped.items() if k not in experts}
        derived = derive_plan(model, tp, skip=roots, required=not shipped, example=example)
        styles = {**to_styles(shipped, "the model's own _tp_plan"), **to_styles(derived)}
        plan = Plan(styles, "derived", roots)
        if experts:
            entries = ", ".join(f"{k!r}: {v!r}" for k, v in experts.items())
            plan.notes.append(
                f"--strategy tensor: the model's own _tp_plan splits its mixture-of-experts "
                f"experts ({entries}), packed 3-D weights torch's tensor-parallel styles cannot "
                "split: the experts stay whole on every engine (each computes every expert's "
                "tokens) and the rest is split; --strategy data --expert-parallel E spreads the "
                "experts over groups of E engines (their tokens sent to them), --strategy "
                "sharded shards them"
            )
    check_shapes(model, plan.layers, tp, tied)
    plan.styles = expand(model, plan.layers, matches)
    return plan


def derive_plan(
    model: nn.Module,
    tp: int,
    *,
    skip: AbstractSet[str] = frozenset(),
    required: bool = True,
    example: Callable[[], Any] | None = None,
) -> dict[str, str]:
    """{module path: "colwise" | "rowwise"} for `model` split `tp` ways, leaving out the
    modules under the paths in `skip`; with `example` (a forward on one sample), the groups
    of one recorded forward are added where torch.fx found none; with `required`, finding
    nothing is a JobError."""
    layers = [m for m in model.modules() if is_splittable(m)]
    if not layers and required:
        raise JobError(
            f"--strategy tensor splits nn.Linear layers, and model ({qualified_name(model)}) has "
            "none; use --strategy data or sharded"
        )
    tied = _tied_ids(model)
    plan: dict[str, str] = {}
    for path, module in model.named_modules():
        if _under(path, skip):
            continue
        children = [
            (name, child)
            for name, child in module.named_children()
            if is_splittable(child) and id(child.weight) not in tied
        ]
        prefix = f"{path}." if path else ""
        found = _attention(module, children, tp)
        plan.update({prefix + name: style for name, style in found.items()})
    pairs = dataflow_pairs(model, tp, skip=set(skip), tied=tied)
    plan.update({k: v for k, v in pairs.items() if k not in plan})
    if example is not None:

        def whole(path: str, module: nn.Module) -> bool:
            return path in plan or _under(path, skip) or id(module.weight) in tied

        plan.update(recorded_pairs(model, example, tp, whole=whole))
    if not plan and required:
        shapes = ", ".join("{}->{}".format(*features(m)) for m in layers[:6])
        raise JobError(
            f"--tensor-parallel {tp}: found no Linear layers to split (no attention projections, "
            f"no Linear pair whose hidden width divides by {tp} with only elementwise ops "
            f"between them; Linear shapes: {shapes}); give the plan by hand with "
            "tp_plan = {'path.to.linear': 'colwise', ...} in the cell"
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


def _tied_ids(model: nn.Module) -> set[int]:
    """Parameters held by more than one module (an embedding tied to the output head)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in direct_parameters(module).values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


def _holds_tied(model: nn.Module, key: str, tied: set[int]) -> bool:
    return any(id(p) in tied for _, m in matches(model, key) for p in m.parameters(recurse=False))


def _packed_experts(model: nn.Module, key: str) -> bool:
    """Whether plan entry `key` names a module holding packed expert weights (3-D: one
    matrix per expert, as transformers' MoE experts keep them) or one of its weights."""
    owner = key.rpartition(".")[0]
    for path in (key, owner):
        for _, module in matches(model, path) if path else []:
            if any(p.dim() >= 3 for p in module.parameters(recurse=False)):
                return True
    return False


def _under(path: str, roots: AbstractSet[str]) -> bool:
    return any(r == "" or path == r or path.startswith(r + ".") for r in roots)


def check_plan(model: nn.Module, plan: dict[str, Any]) -> None:
    """Raise a JobError for a key of a hand-written plan that names no module of `model`.

    parallelize_module only warns about such a key, on the engine where nobody sees it, and
    splits nothing for it: a typo would train every layer whole without a word. A key naming
    the base layer or an adapter inside a LoRA layer is refused too: split alone, it would
    leave the others a shape they cannot meet."""
    inside = inner_layers(model)
    for key in plan:
        for path, module in matches(model, key):
            if id(module) in inside:
                lora = inside[id(module)]
                raise JobError(
                    f"tp_plan[{key!r}] names {path!r}, part of the LoRA layer {lora!r} "
                    f"({qualified_name(model.get_submodule(lora))}); name {lora!r} instead: "
                    "its base layer and adapters are split together"
                )
        if key and not matches(model, key):
            linears = [name for name, m in model.named_modules() if is_splittable(m)]
            more = ", ..." if len(linears) > 6 else ""
            raise JobError(
                f"tp_plan[{key!r}] matches no module of the model, so nothing would be split "
                f"for it; its Linear layers are {', '.join(linears[:6])}{more} ('*' stands for "
                "one name, e.g. 'blocks.*.mlp.0')"
            )


def split_heads(
    model: nn.Module, plan: dict[str, Any], tp: int, skip: AbstractSet[str] = frozenset()
) -> None:
    """Divide by `tp` the head count of every module whose q/k/v projections are split
    column-wise: each engine then computes its own heads. Modules under `skip` (transformers
    models with their own plan: views sized with -1 heads) are left alone."""
    for path, module in model.named_modules():
        if _under(path, skip):
            continue
        prefix = f"{path}." if path else ""
        split = [
            name
            for name, _ in module.named_children()
            if QKV.match(name) and splits(_style_at(plan, prefix + name)) == "colwise"
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
    return next((s for key, s in plan.items() if path_matches(path, key)), None)
