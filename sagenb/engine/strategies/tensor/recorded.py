"""Column/row groups found in one recorded forward, for modules torch.fx cannot trace (BERT's
and ViT's blocks: `hidden_states.shape[:-1]` unpacked, attention behind a dispatch table).

The model runs once on one sample under a TorchFunctionMode that records every torch function
and Tensor method called (https://pytorch.org/docs/stable/notes/extending.html#extending-all-
torch-api-with-modes), each splittable layer (dataflow.is_splittable) recorded as one call.
The recorded values are real, so shapes are known and control flow was taken.

A group is Megatron-LM's (arXiv:1909.08053, section 3): the layers whose outputs reach a
consumer layer's input only through the recorded calls between them, split column-wise, the
consumer row-wise. It is exact when each engine can compute its own slice of everything in
between, which is checked by following, call by call, which axis of each value holds the
engines' slices (`_RULES`), from the last axis of the producers' outputs:

- elementwise functions keep the axis; a tensor from outside the group (a mask, a scale, the
  residual) may join only broadcast along it (size 1 there), else it would meet split values
  at full width (`A(x) + x`, `A(x) * per_feature_scale`);
- `view`/`reshape` move it: splitting the features into (heads, head size) moves it to the
  heads axis when the heads divide by T; the shape must say -1 there, so that each engine's
  view sizes itself from its own slice (transformers writes `view(*shape, -1, head_size)`);
- `transpose`/`permute` move it; `softmax` over another axis keeps it; `matmul` and
  `scaled_dot_product_attention` keep it when it is a batch axis of both operands (heads);
- anything else (layer norms, slicing, concatenation, a matmul over the split axis) ends the
  search: the layers stay whole.

It must end on the consumer's input as its last axis, and no value in between may be read by
anything else (or be an output of the model): they are one engine's slices.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from sagenb.engine.strategies.tensor.dataflow import is_splittable

__all__ = ["recorded_pairs"]


class _Call:
    def __init__(self, name: str, args: Any, kwargs: dict, out: Any, layer: str | None = None):
        self.name, self.args, self.kwargs, self.layer = name, args, kwargs, layer
        self.inputs = list(_tensors((args, kwargs)))
        self.outputs = [t for t in _tensors(out) if not any(t is i for i in self.inputs)]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class _Recorder(TorchFunctionMode):
    """Every torch call outside the layers, and each layer as one call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0:
            call = _Call(getattr(func, "__name__", str(func)), args, kwargs, out)
            if call.outputs or call.inputs:
                self.calls.append(call)
        return out


def _record(model: nn.Module, layers: dict[nn.Module, str], run: Callable[[], Any]):
    recorder = _Recorder()

    def enter(m: nn.Module, args: Any) -> None:
        recorder.depth += 1

    def leave(m: nn.Module, args: Any, out: Any) -> None:  # None: the output stays as it is
        recorder.depth -= 1
        if recorder.depth == 0:
            recorder.calls.append(_Call("layer", args, {}, out, layer=layers[m]))

    handles = []
    for m in layers:
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with recorder:
            out = run()
    finally:
        for h in handles:
            h.remove()
    return recorder.calls, list(_tensors(out))


def recorded_pairs(
    model: nn.Module, run: Callable[[], Any], tp: int, *, whole: Callable[[str, nn.Module], bool]
) -> dict[str, str]:
    """{path: "colwise" | "rowwise"} for the groups found in one forward of `model` (`run`
    calls it on a sample), leaving whole the layers for which `whole(path, module)`."""
    layers = _outermost_layers(model, whole)
    if len(layers) < 2:
        return {}
    try:
        calls, final = _record(model, layers, run)
    except Exception:  # noqa: BLE001 - a forward the recorder disturbs: the fx plan stands
        return {}
    graph = _Graph(calls, final)
    # a layer called twice (shared) would need the same split at both calls: left whole
    called = Counter(c.layer for c in calls if c.layer is not None)
    plan: dict[str, str] = {}
    for call in calls:
        if call.layer is None or call.layer in plan or called[call.layer] > 1:
            continue
        sources = graph.group(call, tp)
        if sources and not any(s in plan or called[s] > 1 for s in sources):
            plan.update(dict.fromkeys(sources, "colwise"))
            plan[call.layer] = "rowwise"
    return plan


def _outermost_layers(model: nn.Module, whole) -> dict[nn.Module, str]:
    layers: dict[nn.Module, str] = {}
    inside: set[int] = set()
    for path, m in model.named_modules():
        if id(m) in inside or not is_splittable(m):
            continue
        inside.update(id(sub) for sub in m.modules())
        if not whole(path, m):
            layers[m] = path
    return layers


class _Graph:
    def __init__(self, calls: list[_Call], final: list[torch.Tensor]):
        self.order = {id(c): i for i, c in enumerate(calls)}
        self.producer: dict[int, _Call] = {}
        self.users: dict[int, list[_Call]] = defaultdict(list)
        self.tainted: set[int] = set()  # values computed from some layer's output
        for call in calls:
            for t in call.inputs:
                self.users[id(t)].append(call)
            from_layer = call.layer is not None or any(id(t) in self.tainted for t in call.inputs)
            for t in call.outputs:
                self.producer[id(t)] = call
                if from_layer:
                    self.tainted.add(id(t))
        self.final = {id(t) for t in final}

    def group(self, consumer: _Call, tp: int) -> list[str] | None:
        """The layers to split column-wise for `consumer` row-wise, or None."""
        start = consumer.inputs[0] if consumer.inputs else None
        if start is None or id(start) not in self.tainted:
            return None
        found = self._region(start)
        if found is None:
            return None
        region, sources = found
        if self._escapes(region | sources, consumer):
            return None
        axes = {id(s.outputs[0]): -1 for s in sources if len(s.outputs) == 1}
        if len(axes) != len(sources) or any(_width(s) % tp for s in sources):
            return None
        for call in sorted(region, key=lambda c: self.order[id(c)]):
            axis = _RULES[call.name](call, axes, tp)
            if axis is None:
                return None
            axes[id(call.outputs[0])] = axis
        if axes.get(id(start)) != -1 or features_in(consumer) % tp:
            return None
        return sorted(s.layer for s in sources if s.layer is not None)

    def _region(self, start: torch.Tensor) -> tuple[set[_Call], set[_Call]] | None:
        region: set[_Call] = set()
        sources: set[_Call] = set()
        stack, seen = [start], set()
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            call = self.producer.get(id(t))
            if call is None:
                return None
            if call.layer is not None:
                sources.add(call)
                continue
            if call.name not in _RULES or len(call.outputs) != 1:
                return None
            region.add(call)
            stack.extend(i for i in call.inputs if id(i) in self.tainted)
        return (region, sources) if sources else None

    def _escapes(self, inside: set[_Call], consumer: _Call) -> bool:
        for call in inside:
            for t in call.outputs:
                if id(t) in self.final:
                    return True
                for user in self.users[id(t)]:
                    if user is not consumer and user not in inside and user.outputs:
                        return True
        return False


def _width(call: _Call) -> int:
    return call.outputs[0].shape[-1]


def features_in(call: _Call) -> int:
    return call.inputs[0].shape[-1]


def _split(call: _Call, axes: dict[int, int]) -> list[tuple[torch.Tensor, int]]:
    return [(t, axes[id(t)]) for t in call.inputs if id(t) in axes]


def _broadcasts(t: torch.Tensor, axis: int) -> bool:
    """Whether `t`, from outside the group, meets the split values whole along `axis`."""
    return t.dim() < -axis or t.shape[axis] == 1


def _elementwise(call: _Call, axes: dict[int, int], tp: int) -> int | None:
    split = _split(call, axes)
    axis = split[0][1]
    out = call.outputs[0]
    if out.dim() < -axis or any(a != axis or t.shape[a] != out.shape[a] for t, a in split):
        return None
    outside = [t for t in call.inputs if id(t) not in axes]
    return axis if all(_broadcasts(t, axis) for t in outside) else None


def _view(call: _Call, axes: dict[int, int], tp: int) -> int | None:
    (src, axis), out = _split(call, axes)[0], call.outputs[0]
    if call.inputs[0] is not src or len(call.inputs) != 1:
        return None
    shape = call.args[1:] if len(call.args) > 2 else call.args[1] if len(call.args) > 1 else ()
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    pos = src.dim() + axis
    pre, size, post = math.prod(src.shape[:pos]), src.shape[pos], math.prod(src.shape[pos + 1 :])
    for k in range(out.dim()):
        tail = math.prod(out.shape[k + 1 :])
        if math.prod(out.shape[:k]) != pre or out.shape[k] * tail != size * post:
            continue
        if (size * post // tp) % tail or out.shape[k] % tp:
            continue  # an engine's slice would not be whole units of this axis
        return k - out.dim() if len(shape) == out.dim() and shape[k] == -1 else None
    return None


def _dims(call: _Call) -> list[int]:
    args = [a for a in call.args[1:] if not isinstance(a, torch.Tensor)]
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = list(args[0])
    return [int(a) for a in args] + [int(v) for k, v in call.kwargs.items() if k.startswith("dim")]


def _transpose(call: _Call, axes: dict[int, int], tp: int) -> int | None:
    axis, n = _split(call, axes)[0][1], call.outputs[0].dim()
    dims = [d % n for d in _dims(call)]
    pos = n + axis
    if call.name == "permute":
        return dims.index(pos) - n if sorted(dims) == list(range(n)) else None
    if len(dims) != 2:
        return None
    a, b = dims
    return (b if pos == a else a if pos == b else pos) - n


def _softmax(call: _Call, axes: dict[int, int], tp: int) -> int | None:
    (src, axis), dims = _split(call, axes)[0], _dims(call)
    if len(call.inputs) != 1 or len(dims) != 1 or dims[0] % src.dim() == src.dim() + axis:
        return None
    return axis


def _matmul(call: _Call, axes: dict[int, int], tp: int) -> int | None:
    if len(call.inputs) != 2 or call.outputs[0].dim() < 3:
        return None
    split = {id(t): a for t, a in _split(call, axes)}
    axis = next(iter(split.values()))
    if axis > -3 or any(split.get(id(t), axis) != axis for t in call.inputs):
        return None  # the split axis is summed over or is a row/column: not per head
    return axis if all(id(t) in split or _broadcasts(t, axis) for t in call.inputs) else None


def _attention(call: _Call, axes: dict[int, int], tp: int) -> int | None:
    q, k, v = call.args[:3]
    if any(axes.get(id(t)) != -3 for t in (q, k, v)) or call.kwargs.get("enable_gqa"):
        return None
    mask = call.kwargs.get("attn_mask", call.args[3] if len(call.args) > 3 else None)
    if isinstance(mask, torch.Tensor) and not _broadcasts(mask, -3):
        return None
    return -3


_ELEMENTWISE = """add sub mul div true_divide __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__
__truediv__ __rtruediv__ __neg__ neg pow __pow__ exp tanh sigmoid relu gelu silu elu leaky_relu
mish softplus hardswish relu6 selu celu erf sqrt rsqrt square abs clamp dropout contiguous to
float half bfloat16 type_as clone""".split()
_RULES: dict[str, Callable[[_Call, dict[int, int], int], int | None]] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(["view", "reshape"], _view),
    **dict.fromkeys(["transpose", "swapaxes", "swapdims", "permute"], _transpose),
    **dict.fromkeys(["softmax", "log_softmax"], _softmax),
    **dict.fromkeys(["matmul", "__matmul__", "bmm"], _matmul),
    "scaled_dot_product_attention": _attention,
}
