"""Exact memory per engine: parameters, gradients, optimizer state and saved activations.

torch keeps no allocator statistics on the CPU, so the bytes are counted from the tensors
themselves; the peak of activations saved for backward is tracked with saved-tensor hooks,
deduplicated by storage and leaving parameters out, and autocast's copies of them.
On CUDA the allocator's own peak is reported beside it.

With --offload-activations the same hooks also move each saved activation (not a parameter,
nor a view of one) from the CUDA device to pinned host memory, and back when backward needs
it, as torch.autograd.graph.save_on_cpu(pin_memory=True) does (SageMaker's activation
offloading); those count apart, as offloaded. The hooks then run every step.

The hooks cost about 1% of a small model's step, so activations are counted on the first three
steps of a run (resumed or not), every COUNT_EVERY-th and the last; in between the last count
stands (a job's shapes, and so its activations, are the same every step). Parameters,
gradients and optimizer state are summed on the same steps: walking every tensor each step
took ~0.3 ms under cProfile, on a 20-30 ms data-parallel step (issue 31). Process RSS, secondary, is
read at most every RSS_EVERY_S.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from sagenb.config.errors import ConfigError
from sagenb.engine.strategies.dtensors import local
from sagenb.engine.torch_private import view_base
from sagenb.metrics import keys

__all__ = ["MemoryMeter", "check_offload"]

MIB = 1024 * 1024
COUNT_EVERY = 10
RSS_EVERY_S = 1.0


def _tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    # a DTensor counts its local shard: what this engine holds
    return sum(local(t).numel() * t.element_size() for t in tensors if t is not None)


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(a key identifying the memory, its bytes). Tensor subclasses without a storage of
    their own (tensor parallel's in-flight all-reduce results) count by their own size."""
    try:
        storage = local(tensor).untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(tensor), tensor.numel() * tensor.element_size()


class _Saved:
    """A tensor autograd saved for backward, as the meter packed it. It stops counting when
    backward unpacks it, or, if no backward ever does, when autograd drops it: PipelineStage's
    metadata inference (at a pipeline's first step) runs the first stage forward with grad and
    then drops that graph unused, which a count kept only by unpacking took for one more
    microbatch held all step (issue 31)."""

    __slots__ = ("tensor", "key", "meter", "generation", "device")

    def __init__(
        self,
        tensor: torch.Tensor,
        key: int | None,
        meter: MemoryMeter | None = None,
        generation: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.tensor, self.key, self.meter, self.generation = tensor, key, meter, generation
        self.device = device  # where an offloaded tensor goes back to for backward

    def __del__(self) -> None:
        if self.key is not None and self.meter is not None:
            self.meter._release(self)


def check_offload(offload: bool, device_type: str) -> None:
    """--offload-activations moves activations from CUDA memory to the host's: refused on
    engines of any other kind, where there is no device memory to save."""
    if offload and device_type != "cuda":
        raise ConfigError(
            "offload_activations",
            True,
            f"the engines run on {device_type}: offloading moves the activations saved for "
            f"backward from a CUDA device's memory to the host's, and on {device_type} there is "
            f"no device memory to save; leave it off (--activation-checkpointing saves memory "
            f"on any device)",
        )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor in pinned host memory (save_on_cpu's pack, torch 2.13)."""
    packed = torch.empty(
        tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=not tensor.is_sparse
    )
    packed.copy_(tensor)
    return packed


#: the dtypes autocast computes in (--precision bf16, fp16)
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def _weight_copy(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or the tensor it views: linear saves weight.t()) is autocast's cast of
    a parameter to the compute dtype, which it keeps for backward as FSDP keeps a block's
    gathered weights: a copy of the weights, not an activation, so neither counts as one. Its
    grad_fn is the cast (ToCopyBackward0) of a parameter's gradient accumulator; a frozen
    parameter's cast has no grad_fn and still counts."""
    if tensor.dtype not in COMPUTE_DTYPES:  # an fp32 run's tensors: no hook work per tensor
        return False
    base = view_base(tensor)
    fn = (base if base is not None else tensor).grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]
    return isinstance(getattr(source, "variable", None), nn.Parameter)


class MemoryMeter:
    """Counts one engine's training memory; `track()` wraps each forward+backward.

    The estimate (sizing/footprint_trace.py) counts fake tensors with the same hooks, keyed
    by a storage identity that fake storages have (they have no data pointer)."""

    #: (a key identifying a tensor's memory, its bytes); key 0 is memory that is not counted
    _storage_of = staticmethod(_storage_of)

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        offload: bool = False,
    ):
        self.module, self.optimizer, self.device = module, optimizer, device
        self.offload = offload  # --offload-activations
        self._params = list(module.parameters())  # final: the strategy has wrapped the model
        self._param_storages = {self._storage_of(p)[0] for p in self._params}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references, offloaded]
        self._current = 0
        self._offloaded = 0  # of _current, the bytes held on the host
        self.peak_offloaded = 0
        self._generation = 0  # the count a saved tensor was packed in (start_step begins one)
        self.peak_activations = 0
        self.counting = True
        self._started = 0  # steps begun in this run (a resumed run starts past step 1)
        self._rss_mib, self._rss_read = 0.0, -RSS_EVERY_S
        self._held: dict[str, float] = {}  # parameters, gradients, optimizer: the last count
        try:
            import psutil

            self._process = psutil.Process(os.getpid())
        except ImportError:  # psutil is a dependency; RSS is secondary
            self._process = None

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        # a parameter, or a view of one (linear saves weight.t()): not an activation. This also
        # catches the weights FSDP gathers for a block, whose storages are not the shards'
        if isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):
            return _Saved(tensor, None)
        if _weight_copy(tensor):  # autocast's: a copy of a weight, not an activation
            return _Saved(tensor, None)
        key, nbytes = self._storage_of(tensor)
        if key in self._param_storages or key == 0:
            return _Saved(tensor, None)
        # detached: the live tensor of a saved output refers to its grad_fn, which owns this
        # object, a cycle no collector breaks when backward never runs (torch's docs on saved
        # tensor hooks, pytorch/pytorch#189025); autograd restores the grad_fn on unpack
        kept, device = tensor.detach(), None
        if self.offload and tensor.device.type == "cuda":
            kept, device = _to_host(kept), tensor.device
        if not self.counting:
            return _Saved(kept, None, device=device)
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1, device is not None]
            self._current += nbytes
            self._offloaded += nbytes if device is not None else 0
            self.peak_activations = max(self.peak_activations, self._current - self._offloaded)
            self.peak_offloaded = max(self.peak_offloaded, self._offloaded)
        else:
            entry[1] += 1
        return _Saved(kept, key, self, self._generation, device)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        self._release(saved)
        if saved.device is not None:  # back from the host, for backward
            return saved.tensor.to(saved.device, non_blocking=True)
        return saved.tensor

    def _release(self, saved: _Saved) -> None:
        """`saved` no longer counts: unpacked (a second unpack, under retain_graph, counts
        nothing), or dropped unpacked; one packed before the step's count began, nothing."""
        key, saved.key = saved.key, None
        if key is None or saved.generation != self._generation:
            return
        if (entry := self._live.get(key)) is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self._current -= entry[0]
                self._offloaded -= entry[0] if entry[2] else 0
                del self._live[key]

    def track(self) -> AbstractContextManager:
        """Wraps each forward+backward of the step; counts saved activations when counting,
        and offloads them with --offload-activations."""
        if not (self.counting or self.offload):
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def start_step(self, step: int, last: int | None) -> None:
        """Step `step` of the run's `last` begins."""
        self._started += 1
        self.counting = self._started <= 3 or step % COUNT_EVERY == 0 or step == last
        if self.counting:
            self._generation += 1
            self._live.clear()
            self._current = self._offloaded = 0
            self.peak_activations = self.peak_offloaded = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def snapshot(self) -> dict[str, float]:
        """MiB per kind, taken after backward and before gradients are cleared."""
        if self.counting or not self._held:
            state = (
                v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            )
            self._held = {
                keys.MEMORY_PARAMS: _tensor_bytes(self._params) / MIB,
                keys.MEMORY_GRADS: _tensor_bytes(p.grad for p in self._params) / MIB,
                keys.MEMORY_OPTIMIZER: _tensor_bytes(state) / MIB,
            }
        out = {**self._held, keys.MEMORY_ACTIVATIONS: self.peak_activations / MIB}
        if self.offload:
            out[keys.MEMORY_OFFLOADED] = self.peak_offloaded / MIB
        if self._process is not None:
            now = time.monotonic()
            if now - self._rss_read >= RSS_EVERY_S:
                self._rss_mib, self._rss_read = self._process.memory_info().rss / MIB, now
            out[keys.MEMORY_RSS] = self._rss_mib
        if self.device.type == "cuda":
            out[keys.MEMORY_DEVICE_PEAK] = torch.cuda.max_memory_allocated(self.device) / MIB
            out[keys.MEMORY_DEVICE_CAPACITY] = (
                torch.cuda.get_device_properties(self.device).total_memory / MIB
            )
        return out
