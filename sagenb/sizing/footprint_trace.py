"""One fake forward and backward of the cell's model: what footprint.py attributes to ranks.

Everything runs under torch's FakeTensorMode (torch._subclasses.fake_tensor): the cell's
model, its dataset and the optimizer's state are tensors with shapes, dtypes and no storage,
so a model of any size costs only its metadata. On one microbatch-shaped example:

- FLOPs are counted by torch.utils.flop_counter.FlopCounterMode over forward and backward
  (the recompute of --activation-checkpointing included, as it runs inside backward), with a
  formula of our own for torch._grouped_mm, which transformers' mixture-of-experts layers
  compute their experts with and torch 2.13's counter does not know; its fake kernel accepts
  bf16 alone, so `GroupedMatmulAnyDtype` hands it bf16 stand-ins of the inputs;
- activations saved for backward are counted by engine/memory.py's MemoryMeter, the hooks the
  engines count with (deduplicated by storage, parameters left out), keyed by the identity of
  each fake storage instead of its data pointer (fake storages have none);
- each new saved storage is also attributed to the pipeline stage whose blocks were running,
  and marked "split" when tensor parallel would hold only 1/T of it (below);
- the optimizer is the cell's `make_optimizer` (else AdamW, as engine/loop.py builds it),
  stepped once on fake gradients, so its state is what the engines would hold.

Split activations: a column-wise layer's output is divided among the T engines of a tensor-
parallel group, and so is everything computed from it until a row-wise layer's output, which
the all-reduce makes whole again (Megatron-LM, arXiv:1909.08053, section 3). A dispatch mode
propagates the mark from the inputs of every aten op to its outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from sagenb.engine.memory import MemoryMeter
from sagenb.engine.strategies.attribution import Trace
from sagenb.engine.torch_private import GROUPED_MM, TorchDispatchMode, tree_leaves

__all__ = ["GroupedMatmulAnyDtype", "Trace", "trace_step", "optimizer_state", "storage_key"]


def _grouped_mm_flop(
    a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **_: Any
) -> int:
    """FLOPs of torch._grouped_mm: 2 x M x K x N over the groups. 2-D x 2-D splits the inner
    dimension K by the offsets (the weight gradient, one (M, N) block per group); otherwise
    each output element is one dot product of length K."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * int(torch.Size(out_shape).numel()) * a_shape[-1]


class GroupedMatmulAnyDtype(TorchDispatchMode):
    """torch._grouped_mm on fake tensors of any float dtype: torch 2.13's fake (meta) kernel
    refuses all but bf16 ("Expected inputs of BF16 type"), though the CPU kernel takes fp32;
    the shapes are what the estimate needs, so the call is made on bf16 copies and its output
    given the inputs' dtype."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is GROUPED_MM and args[0].dtype != torch.bfloat16:
            dtype = kwargs.pop("out_dtype", None) or args[0].dtype
            bf16 = [a.to(torch.bfloat16) for a in args[:2]]
            return func(*bf16, *args[2:], **kwargs).to(dtype)
        return func(*args, **kwargs)


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(the identity of a fake or real tensor's storage, its bytes): views share the key."""
    try:
        storage = tensor.untyped_storage()
        return StorageWeakRef(storage).cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(tensor), tensor.numel() * tensor.element_size()


class _Meter(MemoryMeter):
    """engine/memory.py's counting, on fake storages, also attributing each new storage."""

    _storage_of = staticmethod(storage_key)

    def __init__(self, module: nn.Module, trace: Trace, tags: _Tags) -> None:
        super().__init__(module, None, torch.device("cpu"))  # type: ignore[arg-type]
        self.trace, self.tags, self.position = trace, tags, 0
        self.forward = True
        self._first: dict[int, int] = {}  # storage key -> the position that first saved it
        self._again: set[tuple[int, int]] = set()

    def _pack(self, tensor: torch.Tensor) -> Any:
        before = len(self._live)
        saved = super()._pack(tensor)
        if not self.forward or saved.key is None:
            return saved
        nbytes = self._live[saved.key][0]
        if len(self._live) > before:
            self._first[saved.key] = self.position
            entry = self.trace.saved.setdefault(self.position, [0.0, 0.0])
            entry[1 if self.tags.has(tensor) else 0] += nbytes
        elif (first := self._first.get(saved.key, self.position)) != self.position:
            if (saved.key, self.position) not in self._again:
                self._again.add((saved.key, self.position))
                self.trace.resaved.append((saved.key, first, self.position, float(nbytes)))
        return saved


class _Tags(TorchDispatchMode):
    """Storages tensor parallel would split: marked at column-wise outputs, spread through
    every op to its outputs, cleared at row-wise outputs."""

    def __init__(self) -> None:
        super().__init__()
        self._marked: dict[int, StorageWeakRef] = {}

    def has(self, tensor: torch.Tensor) -> bool:
        key = storage_key(tensor)[0]
        ref = self._marked.get(key)
        return ref is not None and not ref.expired()

    def mark(self, value: Any, on: bool = True) -> None:
        for t in tree_leaves(value):
            if torch.is_tensor(t):
                key = storage_key(t)[0]
                if on:
                    self._marked[key] = StorageWeakRef(t.untyped_storage())
                else:
                    self._marked.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._marked and any(
            self.has(t) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)
        ):
            self.mark(out)
        return out


def _nbytes(value: Any) -> float:
    return float(
        sum(t.numel() * t.element_size() for t in tree_leaves(value) if torch.is_tensor(t))
    )


def _hooks(
    blocks: Sequence[nn.Module],
    split: dict[nn.Module, str],
    meter: _Meter,
    trace: Trace,
    tags: _Tags,
) -> list[Any]:
    """Forward hooks: the position (block) running, each block's output bytes, and where
    tensor parallel splits and joins activations."""
    handles = []
    for i, block in enumerate(blocks):

        def enter(_m, _a, i=i):
            meter.position = i

        def leave(_m, _a, out, i=i):
            meter.position = i + 1
            trace.block_out[i] = _nbytes(out)

        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    for module, kind in split.items():

        def done(_m, args, out, kind=kind):
            if kind == "colwise":
                trace.colwise_in += _nbytes(args)
                tags.mark(out)
            else:
                trace.rowwise_out += _nbytes(out)
                tags.mark(out, on=False)

        handles.append(module.register_forward_hook(done))
    return handles


def trace_step(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    split: dict[nn.Module, str],
    run: Callable[[], torch.Tensor],
    autocast: Any,
) -> Trace:
    """Forward and backward of `run()` (the loss of one microbatch) under the counters; to be
    called inside FakeTensorMode."""
    trace, tags = Trace(), _Tags()
    meter = _Meter(model, trace, tags)
    handles = _hooks(blocks, split, meter, trace, tags)
    try:
        counter = FlopCounterMode(display=False, custom_mapping={GROUPED_MM: _grouped_mm_flop})
        with counter as flops, tags:
            with meter.track():
                with autocast:
                    loss = run()
                meter.forward = False
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    trace.flops = float(flops.get_total_flops())
    trace.peak_activations = float(meter.peak_activations)
    return trace


def optimizer_state(
    params: list[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> dict[nn.Parameter, list[tuple[int, bool]]]:
    """Per parameter, the optimizer state it gets after one step: (bytes, shaped like the
    parameter, so sharded with it). Call inside FakeTensorMode."""
    optimizer = make(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = {}
    for p in params:
        entries = optimizer.state.get(p, {})
        state[p] = [
            (v.numel() * v.element_size(), v.shape == p.shape)
            for v in entries.values()
            if torch.is_tensor(v)
        ]
        p.grad = None
    return state
