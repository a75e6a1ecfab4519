"""Every private torch name sagenb relies on, and the only sagenb module that touches one.

A private name (a module path or a name with a leading underscore) carries no promise: torch
moves, renames or changes them between releases without a deprecation. pyproject.toml pins
torch>=2.13,<2.14, the release CI tests; moving to a new torch starts here. Each use below is
named with the public API it stands in for, or says why torch 2.13 has none.
`PRIVATE_NAMES` lists every private (module, attribute) relied on, and tests/test_private_apis.py
resolves each on the installed torch and checks that no other sagenb module imports or reads a
private torch name.

Only modules that `import torch` loads itself are imported at the top, so that importing this
module (the data loader does) costs nothing beyond torch. The pipelining and
distributed-checkpoint names are resolved on first use (module `__getattr__`, as
sagenb/config/__init__.py does): torch.distributed.pipelining imports torch._dynamo, most of a
second. torch._dynamo itself is imported only by `warm_dynamo`, and the flight recorder, which a
torch build may lack, only by `dump_flight_recorder_json`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from functools import partial
from importlib import import_module
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

# no public equivalent in torch 2.13: tensors with shapes and dtypes but no data, through which
# the cell's own code builds its model and data (torch.export uses the same mode inside); and a
# real tensor made while that mode is active (the indices of the estimate's example, whose
# values a map-style dataset's __getitem__ needs)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

# the base of BatchNorm1d/2d/3d, their lazy forms and SyncBatchNorm; public: those classes one
# by one for isinstance, none to subclass (engine/model/sync_batchnorm.py's GlobalBatchNorm)
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

# the base of Dropout, Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout (all have .p);
# public: those classes one by one
from torch.nn.modules.dropout import _DropoutNd as DropoutBase

# no public equivalent in torch 2.13: a mode that sees every aten op with its arguments
# (the __torch_dispatch__ modes of the "Extending PyTorch" notes are built on this class)
from torch.utils._python_dispatch import TorchDispatchMode

# no public equivalent in torch 2.13 (no torch.utils.pytree): every tensor in nested
# tuples, lists and dicts, as torch's own modes walk them; and a model's output put back
# together from the leaves torch.export flattened it into (public: ExportedProgram.module(),
# whose forward unflattens the same way, but runs the whole graph, not a pipeline's stage)
from torch.utils._pytree import tree_leaves, tree_unflatten

# no public equivalent in torch 2.13: the op transformers' mixture-of-experts layers compute
# their packed experts with (torch._grouped_mm), which the estimate's fake step must run on
# bf16 stand-ins (its fake kernel takes bf16 alone) and count FLOPs for (the counter has no
# formula for it): sizing/footprint_trace.py
GROUPED_MM = torch.ops.aten._grouped_mm

if TYPE_CHECKING:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.pipelining import Pipe
    from torch.distributed.pipelining._IR import annotate_split_points
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "PRIVATE_NAMES",
    "BatchNormBase",
    "DropoutBase",
    "FakeTensor",
    "FakeTensorMode",
    "shipped_tp_plan",
    "GROUPED_MM",
    "unset_fake_temporarily",
    "PrivateName",
    "TorchDispatchMode",
    "annotate_split_points",
    "apply_style",
    "begin_step",
    "check_batchnorm_input",
    "clear_split_point",
    "compute_loss",
    "direct_buffers",
    "direct_parameters",
    "dump_flight_recorder_json",
    "end_step",
    "exchange",
    "forget_dtensor_shardings",
    "forget_failed_init",
    "interleaved_order",
    "loss_of",
    "non_persistent_buffers",
    "pipe_from_traced",
    "set_element",
    "shutdown_workers",
    "style_redistribution",
    "tree_leaves",
    "tree_unflatten",
    "v_order",
    "view_base",
    "warm_dynamo",
]

_SCHEDULES = "torch.distributed.pipelining.schedules"

#: name here -> (torch module, private name): imported when first asked for
_ON_FIRST_USE = {
    # public: pipeline(model, mb_args, mb_kwargs, split_spec), which annotates the cell's
    # model in place and leaves it so; sagenb annotates, exports and undoes (export_split.py)
    "annotate_split_points": ("torch.distributed.pipelining._IR", "annotate_split_points"),
    # public: DefaultLoadPlanner.load_bytes, which places a loaded entry in the nested
    # state_dict the same way but unpickles it with weights_only=False
    "set_element": ("torch.distributed.checkpoint._traverse", "set_element"),
}


def __getattr__(name: str) -> Any:
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, private = _ON_FIRST_USE[name]
    value = getattr(import_module(module), private)
    globals()[name] = value  # once: later lookups find it as a plain global
    return value


# -- nn.Module's own dicts -------------------------------------------------------------------------


def direct_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The parameters `module` holds itself, the live dict: changing it changes the module."""
    # public: named_parameters(recurse=False) to read, register_parameter to change; the dict
    # swaps a parameter (meta -> real) past delayed.meta_parameters' patched register_parameter,
    # and reads real tensors where torch.fx tracing makes attribute access return proxies
    return module._parameters


def direct_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The buffers `module` holds itself, the live dict."""
    # public: named_buffers(recurse=False) to read, delattr to drop (which fails when absent)
    return module._buffers


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of `module`'s buffers that its state_dict leaves out, the live set."""
    # public: register_buffer(name, tensor, persistent=False), which registers the tensor anew
    return module._non_persistent_buffers_set


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of, or None."""
    # no public equivalent in torch 2.13: the base of a view (linear saves weight.t(), a view
    # of the parameter, for backward)
    return tensor._base


def check_batchnorm_input(module: BatchNormBase, input: torch.Tensor) -> None:
    """The shape check BatchNorm1d/2d/3d make before their forward (ValueError)."""
    # no public equivalent in torch 2.13: each BatchNorm class's own check of input.dim()
    module._check_input_dim(input)


# -- data loading ----------------------------------------------------------------------------------


def shutdown_workers(iterator: Iterator[Any]) -> None:
    """Stop the worker processes of a DataLoader iterator (num_workers > 0) now."""
    # public: dropping the last reference to the iterator (its __del__ does this), which a
    # traceback holding the frame delays; torch types iter(loader) as the base iterator
    iterator._shutdown_workers()  # type: ignore[attr-defined]


# -- pipelining ------------------------------------------------------------------------------------


def pipe_from_traced(model: nn.Module, program: torch.export.ExportedProgram) -> Pipe:
    """torch's Pipe of an exported `model` whose split points are annotated, a weight used by
    several stages replicated into each."""
    # public: pipeline(model, mb_args, mb_kwargs, split_spec), which runs torch.export itself
    # (sagenb exports with static shapes) and leaves the annotations on the cell's model
    from torch.distributed.pipelining import Pipe
    from torch.distributed.pipelining._IR import MultiUseParameterConfig

    return Pipe._from_traced(model, program, MultiUseParameterConfig.REPLICATE)


def clear_split_point(module: nn.Module) -> None:
    """Take off `module` what annotate_split_points set on it: its forward wrapper and the
    _orig_forward it keeps."""
    # no public equivalent in torch 2.13: annotate_split_points is not undone by torch
    del module.forward
    module.__dict__.pop("_orig_forward", None)


def begin_step(
    schedule: Any,
    arg_mbs: list | None,
    kwarg_mbs: list | None,
    target_mbs: list | None,
    losses: list | None,
    loss_kwargs: dict[str, Any] | None,
) -> tuple[list, list]:
    """What torch's one-stage schedules do before a step's first microbatch: the microbatches'
    arguments checked (None made empty), and on the first step the stage's receive buffers and
    shapes set up. Returns the checked arguments."""
    # public: PipelineScheduleSingle, whose subclasses (ScheduleGPipe, Schedule1F1B) write
    # their _step_microbatches with these methods; torch 2.13 has no public hooks for a
    # schedule of one's own to call
    arg_mbs, kwarg_mbs = schedule._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
    first_target = target_mbs[0] if target_mbs is not None else None
    schedule._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
    return arg_mbs, kwarg_mbs


def compute_loss(
    schedule: Any, stage: Any, output: Any, target_mbs: list | None, i: int, loss_kwargs: Any
) -> None:
    """The schedule's loss on microbatch `i`'s output, kept for its backward (last stage only)."""
    # as begin_step: what ScheduleGPipe calls after each forward
    schedule._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)


def loss_of(schedule: Any, stage: Any, i: int) -> torch.Tensor | None:
    """The loss compute_loss kept for microbatch `i` (None before the last stage)."""
    # as begin_step: what ScheduleGPipe calls before each backward
    return schedule._maybe_get_loss(stage, i)


def end_step(schedule: Any, stage: Any, losses: list | None) -> None:
    """The step's losses handed to `losses` (last stage), the schedule's own list cleared."""
    # as begin_step: what ScheduleGPipe calls once its backwards are done
    schedule._update_losses(stage, losses)


def interleaved_order(
    ranks: int, chunks: int, microbatches: int, rank: int, *, zero_bubble: bool = False
) -> list[tuple[str, int, int]]:
    """("F" | "B", stage, microbatch) in the order torch's ScheduleInterleaved1F1B runs them on
    `rank` of `ranks`, holding `chunks` stages each; with `zero_bubble`, ("F" | "I" | "W", ...)
    in the order of
    ScheduleInterleavedZeroBubble, whose backwards are split into "I" (the input's gradient)
    and "W" (the weights'), the W of a microbatch run later to fill the bubble."""
    # public: ScheduleInterleaved1F1B(stages, n).pipeline_order, which needs built
    # PipelineStages in a process group (the estimate has neither). Its per-rank calculation
    # (_calculate_single_rank_operations, torch 2.13) is these two module functions, wired
    # with the stage of each step as below (ScheduleInterleavedZeroBubble's: a warm-up one
    # op per hop, `rank` 1F1B microbatches, enable_zero_bubble)
    from torch.distributed.pipelining import schedules

    rounds = max(1, microbatches // ranks)
    per_round = microbatches // rounds
    factor = 1 if zero_bubble else 2
    warmup = schedules._get_warmup_ops(rank, chunks, per_round, ranks, microbatches, factor)
    steady = chunks * microbatches - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % chunks * ranks + rank

    def backward_stage(step: int) -> int:
        return (chunks - 1 - ((step - warmup) // per_round) % chunks) * ranks + rank

    extra = dict(num_1f1b_microbatches=rank, enable_zero_bubble=True) if zero_bubble else {}
    ops = schedules._get_1f1b_rank_ops(
        chunks, ranks, warmup, steady, chunks * microbatches - steady, rank,
        forward_stage, backward_stage, **extra,
    )  # fmt: skip
    return _compute_ops(ops)


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _compute_ops(ops: list[Any]) -> list[tuple[str, int, int]]:
    """torch's actions as ("F" | "B" | "I" | "W", stage, microbatch); an overlapped forward
    and backward (DualPipeV's OVERLAP_F_B) as its two parts, forward first."""
    out = []
    for a in ops:
        if a is None:
            continue
        for part in a.sub_actions or (a,):
            kind = _KINDS.get(part.computation_type.name)
            if kind is not None:
                out.append((kind, part.stage_index, part.microbatch_index or 0))
    return out


def v_order(schedule: str, ranks: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """("F" | "B" | "I" | "W", stage, microbatch) in the order torch's ScheduleZBVZeroBubble
    (`schedule` "zbv") or ScheduleDualPipeV ("dualpipev") runs them on `rank` of `ranks`, each
    holding stages rank and 2 ranks - 1 - rank."""
    # public: the schedule's pipeline_order, which needs built PipelineStages in a process
    # group (the estimate has neither). Each class computes it in its method
    # _calculate_single_rank_operations(rank) (torch 2.13), which reads only these attributes
    from torch.distributed.pipelining import schedules

    cls: dict[str, Any] = {
        "zbv": schedules.ScheduleZBVZeroBubble,
        "dualpipev": schedules.ScheduleDualPipeV,
    }
    state = SimpleNamespace(pp_group_size=ranks, num_stages=2 * ranks, _n_microbatches=microbatches)
    return _compute_ops(cls[schedule]._calculate_single_rank_operations(state, rank))


# -- tensor parallel -------------------------------------------------------------------------------


def apply_style(
    kind: type[ParallelStyle], style: ParallelStyle, module: nn.Module, mesh: Any
) -> nn.Module:
    """`kind`'s own splitting of `module` by `style`, for a subclass that extends it."""
    # public: parallelize_module(module, mesh, style), which calls the style's _apply: a
    # subclass overriding _apply (ParallelStyle's one method) reaches its base's through here
    return kind._apply(style, module, mesh)


def style_redistribution(style: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The input and output functions ColwiseParallel's or RowwiseParallel's _apply hands
    distribute_module: the module's inputs and outputs redistributed to the style's layouts."""
    # no public equivalent in torch 2.13: the styles' static _prepare_input_fn and
    # _prepare_output_fn, bound as their _apply binds them
    return (
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


# -- the process -----------------------------------------------------------------------------------


def dump_flight_recorder_json() -> bytes | None:
    """torch's flight recorder as JSON (every collective, not only the active ones, without
    stack traces), or None where this torch build has none."""
    # no public equivalent in torch 2.13: the public route dumps to files, on a watchdog timeout
    try:
        # absent from torch's stubs (torch/_C/_distributed_c10d.pyi)
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _dump_fr_trace_json(True, False)


def forget_failed_init() -> None:
    """Number the next default process group as a fresh process would (0), unless one exists.

    init_process_group names the default group from a counter before it connects (its store
    keys are prefixed "0/", "1/"...), so one that raised left the counter at 1 with no group to
    destroy, and the engine's next run used other keys than its peers and hung until the
    timeout (pytorch/pytorch#46561)."""
    # public: destroy_process_group(), which resets the counter ("to allow consistent value to
    # be generated when we re-create process groups after some trainers recover from failure",
    # distributed_c10d.py) but only when there is a default group to destroy
    from torch.distributed import distributed_c10d

    if not distributed_c10d.is_initialized():
        distributed_c10d._world.group_count = 0


def exchange(tensor: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    """all_to_all_single with uneven splits and autograd: rows `send[i]` of `tensor` go to
    rank i of `group`, `receive[i]` rows come from it; backward sends the gradients back."""
    # public: torch.distributed.nn.functional.all_to_all_single, deprecated in torch 2.13 (a
    # FutureWarning on every call) for this one
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(tensor, receive, send, group))


def shipped_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan a transformers model (an nn.Module) carries: its public
    `PreTrainedModel.tp_plan` (transformers 5), else, on the older releases sagenb admits
    (transformers>=4.46), which have no such property, the attribute it reads, `_tp_plan`
    (set in post_init). None for a model that ships none."""
    plan = getattr(model, "tp_plan", None)
    return plan if plan is not None else getattr(model, "_tp_plan", None)


def forget_dtensor_shardings() -> None:
    """Empty DTensor's caches of sharding decisions (the C++ dispatch's and the Python
    propagator's), as a fresh process has them, when DTensor was imported.

    The caches are per process and outlive a run. An engine that had run a tensor-parallel
    model kept them, and a replaced engine beside it started empty: the two ranks then took
    different decisions for the same ops of the next tensor-parallel run and computed wrong
    gradients, silently (the loss was right). Their keys leave some arguments out
    (pytorch/pytorch#178301, #183021)."""
    # no public equivalent in torch 2.13: the caches are an implementation detail of dispatch
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return
    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = dtensor.DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


def warm_dynamo() -> None:
    """Import torch._dynamo, which DDP's constructor would otherwise import on the first run."""
    # no public equivalent in torch 2.13: torch.compile imports it on its first call too
    import torch._dynamo  # noqa: F401


# -- what the test resolves ------------------------------------------------------------------------


class PrivateName(NamedTuple):
    """One private torch name: `attribute` is a dotted path from the imported `module` ("" for
    the module itself); a component ending in "()" is called with no arguments (an instance
    attribute, set in __init__)."""

    module: str
    attribute: str
    #: the sagenb code that stops working without it
    used_by: str


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("torch._subclasses.fake_tensor", "FakeTensorMode", "sizing.footprint.footprint"),
    PrivateName(
        "torch._subclasses.fake_tensor",
        "FakeTensor",
        "sizing.footprint (a fake tensor deep-copied by clone)",
    ),
    PrivateName(
        "torch._subclasses.fake_tensor", "unset_fake_temporarily", "sizing.footprint._build"
    ),
    PrivateName(
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "sizing.footprint_trace (the tensor-parallel marks of trace_step, grouped matmuls in "
        "any dtype)",
    ),
    PrivateName("torch.utils._pytree", "tree_leaves", "sizing.footprint_trace.trace_step"),
    PrivateName(
        "torch",
        "ops.aten._grouped_mm",
        "sizing.footprint_trace (estimates of transformers' mixture-of-experts layers)",
    ),
    PrivateName(
        "torch.utils._pytree",
        "tree_unflatten",
        "engine.strategies.pipeline.export_split (the last stage's output)",
    ),
    PrivateName(
        "torch.nn.modules.batchnorm",
        "_BatchNorm",
        "engine.model.sync_batchnorm (GlobalBatchNorm, sync_batchnorm, batchnorm_layers), "
        "engine.model.equivalence.equivalence_warnings",
    ),
    PrivateName(
        "torch.nn", "BatchNorm1d._check_input_dim", "engine.model.sync_batchnorm.GlobalBatchNorm"
    ),
    PrivateName(
        "torch.nn.modules.dropout", "_DropoutNd", "engine.model.equivalence.equivalence_warnings"
    ),
    PrivateName(
        "torch.nn",
        "Module()._parameters",
        "engine.model.delayed (materialize, release_others), pipeline.export_split, "
        "tensor.plan, tensor.styles.is_conv1d, sizing.footprint",
    ),
    PrivateName("torch.nn", "Module()._buffers", "engine.strategies.pipeline.export_split"),
    PrivateName(
        "torch.nn",
        "Module()._non_persistent_buffers_set",
        "engine.strategies.pipeline.export_split",
    ),
    PrivateName("torch", "Tensor._base", "engine.memory.MemoryMeter (activation memory)"),
    PrivateName(
        "torch.distributed.pipelining.schedules",
        "_get_warmup_ops",
        "engine.strategies.pipeline.attribution (interleaved microbatches in flight)",
    ),
    PrivateName(
        "torch.distributed.pipelining.schedules",
        "_get_1f1b_rank_ops",
        "engine.strategies.pipeline.attribution (interleaved microbatches in flight)",
    ),
    *(
        PrivateName(_SCHEDULES, f"{cls}._calculate_single_rank_operations", "pipeline v_order")
        for cls in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    ),
    PrivateName(
        "torch.distributed._functional_collectives",
        "all_to_all_single_autograd",
        "engine.strategies.experts.dispatch (expert parallel's token exchange)",
    ),
    PrivateName(
        "torch.distributed._functional_collectives",
        "wait_tensor",
        "engine.strategies.experts.dispatch (expert parallel's token exchange)",
    ),
    PrivateName(
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter._shutdown_workers",
        "engine.loader.batches_of (--data-workers)",
    ),
    *(
        PrivateName(module, name, "engine.strategies.pipeline.export_split.export_stages")
        for module, name in (
            ("torch.distributed.pipelining._IR", "annotate_split_points"),
            ("torch.distributed.pipelining._IR", "MultiUseParameterConfig.REPLICATE"),
            ("torch.distributed.pipelining", "Pipe._from_traced"),
        )
    ),
    *(
        PrivateName("torch.distributed.tensor.parallel", name, "engine.strategies.tensor.styles")
        for name in (
            "ParallelStyle._apply",
            "ColwiseParallel._prepare_input_fn",
            "ColwiseParallel._prepare_output_fn",
            "RowwiseParallel._prepare_input_fn",
            "RowwiseParallel._prepare_output_fn",
        )
    ),
    *(
        PrivateName(_SCHEDULES, f"PipelineScheduleSingle.{name}", "pipeline PrefetchingSchedule")
        for name in (
            "_check_inputs",
            "_initialize_stage",
            "_maybe_compute_loss",
            "_maybe_get_loss",
            "_update_losses",
        )
    ),
    PrivateName(
        "torch._C._distributed_c10d",
        "_dump_fr_trace_json",
        "engine.wire.tracing.in_flight (a stalled run's collectives)",
    ),
    PrivateName(
        "torch.distributed.checkpoint._traverse",
        "set_element",
        "engine.checkpoint.reader.SafePlanner (resuming a checkpoint)",
    ),
    PrivateName("torch._dynamo", "", "engine.entry.warm (the pool's warm-up)"),
    *(
        PrivateName(module, name, "engine.clean_slate.restore (the ranks decide shardings alike)")
        for module, name in (
            ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
            (
                "torch.distributed.tensor",
                "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear",
            ),
            (
                "torch.distributed.tensor",
                "DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached",
            ),
        )
    ),
    PrivateName(
        "transformers.modeling_utils",
        "PreTrainedModel._tp_plan",
        "engine.strategies.tensor.hf_plan (a transformers model's own plan, before 5.0's "
        "public tp_plan)",
    ),
    PrivateName(
        "torch.distributed.distributed_c10d",
        "_world.group_count",
        "engine.wire.process_group (a run after a failed rendezvous)",
    ),
)
