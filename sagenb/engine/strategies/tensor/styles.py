"""The ParallelStyles a tensor-parallel plan names, and the layers they can split.

torch's ColwiseParallel and RowwiseParallel split nn.Linear and nn.Embedding only (their
`_apply` raises NotImplementedError for anything else). GPT-2 and GPT (transformers'
`pytorch_utils.Conv1D`) compute `x @ weight + bias` with weight stored (in, out), the transpose
of nn.Linear's: the styles below shard that weight on dim 1 (column-wise: output features) or
dim 0 (row-wise: input features), bias with the outputs or whole, and otherwise run torch's own
input/output redistribution, so a Conv1D splits exactly as a Linear of the same shape.

A plan's strings are sagenb's "colwise"/"rowwise" and the style names transformers writes in a
model's `_tp_plan` (transformers/distributed/tensor_parallel.py registers them), translated to
torch styles here. Styles transformers implements with its own machinery (packed_colwise for
fused gate/up weights, MoE experts, sequence_parallel, ...) have no torch equivalent with the
same layout and are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from sagenb.config.job import JobError
from sagenb.engine.torch_private import apply_style, direct_parameters, style_redistribution

__all__ = ["Colwise", "Rowwise", "STYLES", "is_conv1d", "to_styles", "splits"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT, GPT-2): weight (nx, nf) = (in, out), recognised by shape so
    that transformers need not be imported (read from _parameters: under torch.fx tracing
    attribute access returns proxies)."""
    weight = direct_parameters(module).get("weight")
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and weight is not None
        and tuple(weight.shape) == (module.nx, module.nf)
    )


def _shard_conv1d(weight_dim: int, bias: Any, src_data_rank: int | None, name, module, mesh):
    for pname, placement in (("weight", Shard(weight_dim)), ("bias", bias)):
        param = getattr(module, pname, None)
        if param is None:
            continue
        whole = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(pname, nn.Parameter(whole, requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """torch's ColwiseParallel, also for Conv1D: weight Shard(1), bias Shard(0)."""

    # ParallelStyle's one method, which parallelize_module calls (engine/torch_private.py)
    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return apply_style(ColwiseParallel, self, module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            partial(_shard_conv1d, 1, Shard(0), self.src_data_rank),
            *style_redistribution(self),
        )


class Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, also for Conv1D: weight Shard(0), bias whole (added once,
    after the all-reduce of the partial sums, as torch does for Linear)."""

    # ParallelStyle's one method, which parallelize_module calls (engine/torch_private.py)
    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return apply_style(RowwiseParallel, self, module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            partial(_shard_conv1d, 0, Replicate(), self.src_data_rank),
            *style_redistribution(self),
        )


# name -> factory; transformers' names as its ALL_PARALLEL_STYLES registers them
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": Colwise,
    "rowwise": Rowwise,
    "colwise_gather_output": lambda: Colwise(output_layouts=Replicate()),
    "colwise_rep": lambda: Colwise(output_layouts=Replicate()),
    "rowwise_split_input": lambda: Rowwise(input_layouts=Replicate()),
    "rowwise_rep": lambda: Rowwise(input_layouts=Replicate()),
    # token ids come whole to every engine; the vocabulary (rows) or width (columns) is split
    "embedding_rowwise": lambda: Rowwise(input_layouts=Replicate()),
    "embedding_colwise": lambda: Colwise(output_layouts=Replicate()),
}


def to_styles(plan: dict[str, Any], source: str = "tp_plan") -> dict[str, Any]:
    """The plan with its style names replaced by torch ParallelStyle objects; `source` says
    where the plan came from, for the error naming an unknown style."""
    out = {}
    for path, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise JobError(
                    f"{source}[{path!r}] = {style!r}: sagenb's tensor parallel knows the styles "
                    f"{', '.join(STYLES)} or a torch.distributed.tensor.parallel ParallelStyle; "
                    f"give tp_plan by hand in the cell, leaving {path!r} out to keep it whole"
                )
            style = STYLES[style]()
        out[path] = style
    return out


def splits(style: Any) -> str | None:
    """How a style splits: "colwise", "rowwise", or None (not shape-checked here)."""
    if style in ("colwise", "rowwise"):
        return style
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None
