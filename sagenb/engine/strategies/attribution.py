"""What the estimate asks a strategy: how the bytes of one traced step are held by each rank
and what each rank sends (sizing/footprint.py asks, a strategy's description answers).

The footprint builds the cell on fake tensors in the notebook's process and traces one
microbatch-shaped forward and backward (`Trace`); `Attribution.prepare` marks what the strategy
splits before the trace, and `Attribution.ranks` attributes the traced bytes to ranks after it.
Each strategy writes its own attribution beside its training code, from the functions training
uses (the tensor plan, the pipeline cuts), so that the estimate cannot drift from what runs.

Communication is counted as bytes each rank sends per optimizer step in ring collectives, where
each rank sends (N-1)/N of the buffer per all-gather or reduce-scatter and twice that per
all-reduce (Patarasuk and Yuan 2009; Rajbhandari et al., ZeRO, arXiv:1910.02054, section 7).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig
    from sagenb.engine.workspace import Workspace

__all__ = [
    "Attribution",
    "FakeModel",
    "Ranks",
    "Trace",
    "chunk_sizes",
    "grad_bytes",
    "param_bytes",
    "module_bytes",
    "ring",
]

MIB = 2**20


@dataclass
class Trace:
    """What one microbatch costs, before any attribution to ranks."""

    #: FLOPs of forward + backward (+ recompute) of the example
    flops: float = 0.0
    #: peak bytes saved for backward, as engine/memory.py counts them
    peak_activations: float = 0.0
    #: bytes saved for backward by forward position (a block index; len(blocks) after the
    #: last), split into [whole, split by tensor parallel]
    saved: dict[int, list[float]] = field(default_factory=dict)
    #: bytes of each block's output (the tensor a pipeline cut sends)
    block_out: dict[int, float] = field(default_factory=dict)
    #: storages saved again at a later position than the one that first saved them (and
    #: counted), as (storage, first position, later position, bytes): a block's output saved by its
    #: own last op and by the next block's first (a ResNet block's in-place ReLU, then a
    #: conv). A pipeline cut between the two holds it on both sides (the receiving stage
    #: saves the copy it received)
    resaved: list[tuple[int, int, int, float]] = field(default_factory=list)
    #: tensor parallel's all-reduced bytes: row-wise outputs (forward), column-wise inputs'
    #: gradients (backward)
    rowwise_out: float = 0.0
    colwise_in: float = 0.0


@dataclass
class FakeModel:
    """The cell's objects built on fake tensors, and what every attribution reads."""

    ws: Workspace
    config: EngineConfig
    world: int
    #: every parameter of the model, frozen ones too (only trained ones have gradients and
    #: optimizer state: grad_bytes, `state`)
    params: list[nn.Parameter]
    #: per parameter: (bytes of each optimizer state tensor, shaped like the parameter)
    state: dict[nn.Parameter, list[tuple[int, bool]]]
    example: Any
    #: samples in one slice (microbatch) of the run / samples in `example`
    scale: float
    blocks: list[nn.Module]
    #: the assumptions made, in words; an attribution adds its own
    notes: list[str]


@dataclass
class Ranks:
    """One strategy's answer: per rank, elements held of each parameter, activation bytes
    and bytes sent by collective kind ("all_reduce", "all_gather", "reduce_scatter", "p2p")."""

    held: list[dict[nn.Parameter, int]]
    activations: list[float]
    comm: list[dict[str, float]]
    #: per rank, gradient elements held of each parameter, where they are not `held`'s (None:
    #: each gradient is shaped as the elements held)
    grads: list[dict[nn.Parameter, int]] | None = None


class Attribution:
    """One strategy's rule: what to mark before the trace, and the ranks after it."""

    def prepare(self, m: FakeModel) -> tuple[dict[nn.Module, str], Any]:
        """Modules the trace attributes to a split ({module: "colwise" / "rowwise"}), and
        whatever `ranks` needs of the layout."""
        return {}, None

    def ranks(self, m: FakeModel, trace: Trace, layout: Any) -> Ranks:
        raise NotImplementedError


def chunk_sizes(size: int, parts: int) -> list[int]:
    """The sizes of torch.chunk(size, parts) along one dim, padded with zeros to `parts`:
    how FSDP2 and DTensor's Shard split a dim (the last pieces may be smaller or empty)."""
    step = -(-size // parts) if size else 0
    return [max(0, min(step, size - i * step)) for i in range(parts)]


def grad_bytes(held: dict[nn.Parameter, int]) -> float:
    """Bytes of the gradients of the elements `held`: of trained parameters only (a frozen
    one, a LoRA model's base, has no gradient to hold or reduce)."""
    return float(sum(p.element_size() * n for p, n in held.items() if p.requires_grad))


def param_bytes(held: dict[nn.Parameter, int]) -> float:
    """Bytes of the elements `held`, trained or frozen."""
    return float(sum(p.element_size() * n for p, n in held.items()))


def module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def ring(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective over `n` ranks of an `nbytes` buffer."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes
