"""Column-then-row pairs of layers found from how they feed each other (torch.fx dataflow).

Megatron-LM's MLP split (Shoeybi et al. 2019, arXiv:1909.08053, section 3) is exact when the
values between the column-wise layers and the row-wise one are computed feature by feature:
each engine then holds its own columns of everything in between, and one all-reduce after the
row-wise layer completes the sum. So a pair is not "two Linear layers in a row" but:

- a consumer layer B whose input is reached from the outputs of layers A1..An through
  elementwise operations only (activations, dropout, +, *, scalar arithmetic): a gated MLP's
  `down(act(gate(x)) * up(x))` gives gate and up column-wise, down row-wise;
- every operand of those operations comes from A1..An or is a constant: `A(x) + x` (a residual
  at full width) or `A(x) * self.scale` (a per-feature parameter) would mix split and whole
  tensors, and a LayerNorm or softmax over the features between them is no elementwise op;
- nothing else reads those values (they are partial, one engine's columns);
- each Ai's output width equals B's input width and divides by T.

Each module is traced with torch.fx's symbolic tracer, Linear and Conv1D as leaves
(https://pytorch.org/docs/stable/fx.html#torch.fx.Tracer.is_leaf_module); a module whose
forward cannot be traced (data-dependent control flow, unpacking shapes) is replaced by its
children, recursively, so blocks with attention still yield their MLPs; a transformers model
(or a module holding one) is never traced whole, only its blocks. Layers in modules no
trace reaches stay whole: a guess from names alone could put a LayerNorm between a pair.
"""

from __future__ import annotations

import operator
import sys
import warnings
from typing import cast

import torch
import torch.nn.functional as F
from torch import fx, nn

from sagenb.engine.strategies.tensor.adapters import base_layer
from sagenb.engine.strategies.tensor.styles import is_conv1d

__all__ = ["dataflow_pairs", "is_splittable", "features"]

_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.tanh,
    torch.sigmoid, torch.relu, torch.erf, torch.sqrt, torch.square, torch.abs, torch.clamp,
    F.relu, F.gelu, F.silu, F.tanh, F.sigmoid, F.dropout, F.leaky_relu, F.elu, F.mish,
    F.softplus, F.hardswish, F.relu6, F.selu, F.celu,
}  # fmt: skip
_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "exp", "tanh", "sigmoid", "relu", "sqrt",
    "square", "abs", "clamp", "float", "half", "bfloat16", "to", "type_as", "contiguous",
}  # fmt: skip
_MODULES = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.LeakyReLU, nn.ELU,
    nn.Mish, nn.Softplus, nn.Hardswish, nn.ReLU6, nn.SELU, nn.CELU, nn.Identity,
)  # fmt: skip


def is_splittable(module: nn.Module) -> bool:
    """A Linear or Conv1D, or a peft LoRA layer wrapping one (planned as the layer it wraps,
    its adapters split by adapters.expand)."""
    return isinstance(module, nn.Linear) or is_conv1d(module) or base_layer(module) is not None


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D (a LoRA layer's: its base layer's)."""
    base = base_layer(module)
    if base is not None:
        return features(base)
    if is_conv1d(module):  # ints; nn.Module's __getattr__ types them Tensor | Module
        return cast(int, module.nx), cast(int, module.nf)
    assert isinstance(module, nn.Linear)  # callers pass only what is_splittable accepts
    return module.in_features, module.out_features


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_splittable(m) or super().is_leaf_module(m, qualname)


def dataflow_pairs(model: nn.Module, tp: int, *, skip: set[str], tied: set[int]) -> dict[str, str]:
    """{path: "colwise" | "rowwise"} for the pairs found in `model`, leaving out the modules
    under the paths in `skip` and the layers whose weight id is in `tied`."""
    plan: dict[str, str] = {}

    def visit(path: str, module: nn.Module) -> None:
        if path in skip or sum(map(is_splittable, module.modules())) < 2:
            return
        graph = None if _holds_pretrained(module) else _trace(module)
        if graph is None:
            for name, child in module.named_children():
                visit(f"{path}.{name}" if path else name, child)
            return
        prefix = f"{path}." if path else ""
        found = _pairs(graph, dict(module.named_modules()), tp, tied, skip, prefix)
        plan.update({prefix + name: style for name, style in found.items()})

    visit("", model)
    return plan


def _holds_pretrained(module: nn.Module) -> bool:
    """Whether `module` is or holds a transformers model: its forward (caches, masks, rope
    updates) is not traced with proxies, its blocks are."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return any(isinstance(m, PreTrainedModel) for m in module.modules())


def _trace(module: nn.Module) -> fx.Graph | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _Tracer().trace(module)
    except Exception:  # untraceable forward: its children are tried instead
        return None


def _pairs(graph, modules, tp, tied, skip, prefix) -> dict[str, str]:
    def layer(node: fx.Node) -> nn.Module | None:
        if node.op != "call_module":
            return None
        m = modules.get(_path(node))
        if m is None or not is_splittable(m):
            return None
        whole = id(m.weight) in tied or _under(prefix + _path(node), skip)
        return None if whole else m

    found: dict[str, str] = {}
    for node in graph.nodes:
        consumer = layer(node)
        if consumer is None or node.target in found or not node.args:
            continue
        sources = _sources(node, layer, modules)
        if not sources or any(s.target in found for s in sources):
            continue
        width = features(consumer)[0]
        if width % tp or any(_out_features(layer(s)) != width for s in sources):
            continue
        found.update({_path(s): "colwise" for s in sources})
        found[_path(node)] = "rowwise"
    return found


def _path(node: fx.Node) -> str:
    """A call_module node's target: the module's qualified name, a str (torch.fx docs)."""
    assert isinstance(node.target, str), node.target
    return node.target


def _out_features(module: nn.Module | None) -> int:
    assert module is not None  # _sources keeps only the nodes that layer() maps to a layer
    return features(module)[1]


def _sources(consumer: fx.Node, layer, modules) -> list[fx.Node] | None:
    """The layers whose outputs reach `consumer`'s input through elementwise ops only, and
    are read by nothing else on the way; None when any path leaves that region."""
    start = consumer.args[0]
    if not isinstance(start, fx.Node):
        return None
    region: set[fx.Node] = set()
    sources: set[fx.Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in region or node in sources:
            continue
        if layer(node) is not None:
            sources.add(node)
            continue
        operands = node.all_input_nodes
        if not _elementwise(node, modules) or not operands:
            return None
        region.add(node)
        stack.extend(operands)
    inside = region | sources | {consumer}
    if any(user not in inside for node in region | sources for user in node.users):
        return None  # a partial (one engine's columns) value would escape the pair
    return sorted(sources, key=lambda n: n.name) or None


def _elementwise(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_function":
        return node.target in _FUNCTIONS and not _tensor_constant(node)
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op == "call_module":
        return isinstance(modules.get(_path(node)), _MODULES)
    return False


def _tensor_constant(node: fx.Node) -> bool:
    """An operand that is a tensor but no graph value (captured): it may be per-feature."""
    return any(isinstance(a, torch.Tensor) for a in (*node.args, *node.kwargs.values()))


def _under(path: str, roots: set[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots if r)
