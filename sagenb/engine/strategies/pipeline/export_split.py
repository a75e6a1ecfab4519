"""The torch.export front end for pipeline splitting, for models torch.fx cannot trace.

torch.fx traces symbolically and stops at Python that inspects tensor values or dtypes, which
library models do throughout (transformers builds its attention masks with torch.finfo of the
input's dtype, and branches on cache objects). torch.export traces with fake tensors of an
example input and gets through them; torch.distributed.pipelining builds its `pipeline()` front
end on it: the blocks where stages begin are marked (SplitPoint.BEGINNING), the exported graph
is cut there and `Pipe.get_stage_module(i)` returns stage i, whose parameters keep the unsplit
model's qualified names (https://pytorch.org/docs/stable/distributed.pipelining.html).

The stages are specialised to the example's shapes: a batch of another size (an evaluation
batch) does not run through them. What is then tidied, so that the stages behave as fx's do:

* Pipe lets stage k read values made by any earlier stage (a Llama's rotary cos/sin and its
  mask, made before block 0, reach every stage); PipelineStage receives from the previous stage
  only, so each stage is rewrapped to pass on what later stages still need (_relay), the
  model's output leaves included (an encoder-decoder returns its encoder's output);

* a weight tied across stages (an embedding and its output head) is deep-copied into every
  stage that uses it (Pipe.__init__, "replicated params"): each copy starts equal and
  Pipeline._setup_tied sums their gradients. A stage reading it under two names (the
  encoder's and the decoder's embedding) is left one copy (_tie_within). A tied name that
  no stage holds after the tidy below is added to a stage holding the weight, so the
  stages' state_dicts name every key;
* other unused parameters and buffers are dropped, and buffers the model keeps out of its
  state_dict (persistent=False, e.g. rotary inv_freq) are made non-persistent again, so the
  stages' state_dict keys are the model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe, SplitPoint

from sagenb.config.job import JobError
from sagenb.engine.model.blocks import Blocks, tied_groups
from sagenb.engine.torch_private import (
    annotate_split_points,
    clear_split_point,
    direct_buffers,
    direct_parameters,
    non_persistent_buffers,
    pipe_from_traced,
    tree_unflatten,
)

__all__ = ["export_stages"]


def export_stages(
    model: nn.Module, blocks: Blocks, starts: list[int], example: tuple[tuple, dict]
) -> list[nn.Module]:
    """One module per stage; stage s begins at block starts[s] (starts[0] == 0)."""
    spec = {blocks.qualified(i): SplitPoint.BEGINNING for i in starts[1:]}
    with _annotated(model, spec):
        program = _export(model, example)
        pipe = pipe_from_traced(model, program)
    if pipe.num_stages != len(starts):
        raise JobError(
            f"torch.export cut the model into {pipe.num_stages} stages, not {len(starts)}: a "
            "block where a stage should begin is not called by model.forward in order"
        )
    stages = _relay(pipe, program.call_spec.out_spec)
    keys = set(model.state_dict().keys())
    for stage in stages:
        _tidy(stage, keys)
    _name_tied(model, stages)
    return stages


def _relay(pipe: Pipe, out_spec: Any) -> list[nn.Module]:
    """Stage modules that take only the previous stage's outputs and pass on, after their own
    outputs, every earlier value a later stage reads. The last returns what the model returns
    (`out_spec`: how export flattened it), a ModelOutput with its `loss` when given labels;
    its leaves may come from any stage (an encoder-decoder's `encoder_last_hidden_state` is
    the encoder's), so those are carried to the last stage too."""
    top = list(pipe.split_gm.graph.nodes)
    calls = [n for n in top if n.op == "call_module"]
    stage_of = {n: k for k, n in enumerate(calls)}

    def source(node: fx.Node) -> tuple:  # a value: a model input, or (stage, output index)
        if node.op == "call_function":  # getitem on a stage's tuple of outputs
            return (stage_of[node.args[0]], node.args[1])
        return (stage_of[node], None) if node in stage_of else ("input", node.name)

    returned = next(n for n in top if n.op == "output").args[0]
    leaves = [source(a) for a in (returned if isinstance(returned, (tuple, list)) else [returned])]
    needs = [[source(a) for a in call.args] for call in calls]
    last_use = {v: k for k, vs in enumerate([*needs, leaves]) for v in vs}
    carried = [("input", n.name) for n in top if n.op == "placeholder"]
    stages: list[nn.Module] = []  # GraphModules, typed as split_model gives them
    for k in range(len(calls)):
        module = pipe.get_stage_module(k)
        assert isinstance(module, fx.GraphModule)  # split_gm's submodules: the split graphs
        graph = fx.Graph()
        # the first stage takes the model's inputs under their own names (keyword inputs:
        # model(**batch)); later ones take what the stage before them sends, in order.
        # Values: fx Arguments (placeholders, and what graph_copy returns for the outputs)
        env: dict[tuple[Any, Any], Any] = {
            v: graph.placeholder(v[1] if k == 0 else f"in_{i}") for i, v in enumerate(carried)
        }
        inner = {p: env[v] for p, v in zip(_placeholders(module), needs[k])}
        result = graph.graph_copy(module.graph, inner)
        if isinstance(result, (tuple, list)):  # the stage's outputs, one key each
            env.update({(k, j): out for j, out in enumerate(result)})
        else:
            env[(k, None)] = result
        if k == len(calls) - 1:
            graph.output(_unflattened(graph, module, [env[v] for v in leaves], out_spec))
        else:
            carried = [v for v in env if last_use.get(v, -1) > k]
            # sent as they are: an expanded view (ViT's attention mask, strides of 0) is
            # refused by send, so each goes out contiguous (a no-op for the others)
            outs = tuple(graph.call_method("contiguous", (env[v],)) for v in carried)
            graph.output(outs[0] if len(outs) == 1 else outs)
        graph.lint()
        stages.append(fx.GraphModule(module, graph, class_name=f"ExportStage{k}"))
    return stages


def _unflattened(graph: fx.Graph, module: nn.Module, leaves: list, out_spec: Any) -> fx.Node:
    """The model's output structure from its leaves (export's flattened outputs, in order);
    the spec is kept on the stage as a plain attribute the graph reads."""
    module._sagenb_out_spec = out_spec  # copied onto the stage by fx.GraphModule (get_attr)
    spec = graph.get_attr("_sagenb_out_spec")
    return graph.call_function(tree_unflatten, (leaves, spec))


def _placeholders(module: fx.GraphModule) -> list[fx.Node]:
    return [n for n in module.graph.nodes if n.op == "placeholder"]


def _export(model: nn.Module, example: tuple[tuple, dict]) -> torch.export.ExportedProgram:
    """Static shapes: with a dynamic batch dimension export passes symbolic sizes between
    stages as ints, which PipelineStage cannot send (tried on torch 2.13)."""
    args, kwargs = example
    return torch.export.export(model, tuple(args), dict(kwargs))


@contextmanager
def _annotated(model: nn.Module, spec: dict[str, SplitPoint]) -> Iterator[None]:
    """annotate_split_points wraps each block's forward in place: undone afterwards, so the
    cell's model (and a later export of it, e.g. after profiling) is left as it was."""
    saved = {}
    for name in spec:
        module = model.get_submodule(name)
        saved[name] = (module, module.__dict__.get("forward"))
    annotate_split_points(model, spec)
    try:
        yield
    finally:
        for module, forward in saved.values():
            clear_split_point(module)
            if forward is not None:
                module.forward = forward


def _name_tied(model: nn.Module, stages: list[nn.Module]) -> None:
    """Every name of a tied weight held by some stage: the missing ones alias a holder's."""
    groups = tied_groups(model)
    for stage in stages:
        _tie_within(stage, groups)
    held = [dict(st.named_parameters(remove_duplicate=False)) for st in stages]
    for names in groups:
        missing = [n for n in names if not any(n in h for h in held)]
        holder = next(((s, h[n]) for s, h in enumerate(held) for n in names if n in h), None)
        if holder is None:
            continue
        for name in missing:
            owner, _, attr = name.rpartition(".")
            module = stages[holder[0]]
            for atom in owner.split(".") if owner else []:
                if not hasattr(module, atom):
                    module.add_module(atom, nn.Module())
                module = getattr(module, atom)
            module.register_parameter(attr, holder[1])


def _tie_within(stage: nn.Module, groups: list[tuple[str, ...]]) -> None:
    """One Parameter per tied weight in a stage. Pipe replicates a weight per name it is read
    by, so a stage reading it under two names (an encoder-decoder's first stage embeds both
    the encoder's and the decoder's tokens with the shared embedding) may hold two objects,
    each getting part of the gradient and stepped apart: the later names alias the first."""
    held = dict(stage.named_parameters(remove_duplicate=False))
    for names in groups:
        mine = [n for n in names if n in held]
        for name in mine[1:]:
            if held[name] is not held[mine[0]]:
                owner, _, attr = name.rpartition(".")
                stage.get_submodule(owner).register_parameter(attr, held[mine[0]])


def _used(stage: nn.Module) -> set[str]:
    """Qualified names of the tensors that the stage's graphs read (get_attr), and of the
    modules they call whole (whose tensors count as read)."""
    used: set[str] = set()
    for scope, module in stage.named_modules(remove_duplicate=False):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            if node.op in ("get_attr", "call_module"):
                used.add(f"{scope}.{node.target}" if scope else node.target)
    return used


def _tidy(stage: nn.Module, keys: set[str]) -> None:
    """Drop what the stage's graphs do not read; buffers the model keeps out of its state_dict
    stay out of the stage's."""
    used = _used(stage)

    def is_used(name: str) -> bool:
        return name in used or any(name.startswith(f"{u}.") for u in used)

    for name, _ in list(stage.named_parameters(remove_duplicate=False)):
        if not is_used(name):
            owner, _, attr = name.rpartition(".")
            direct_parameters(stage.get_submodule(owner)).pop(attr, None)
    for name, _ in list(stage.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        module = stage.get_submodule(owner)
        if not is_used(name):
            direct_buffers(module).pop(attr, None)
        elif name not in keys:
            non_persistent_buffers(module).add(attr)
    extra = set(stage.state_dict().keys()) - keys
    if extra:
        raise JobError(
            f"the stages torch.export cut hold tensors the model's state_dict does not name "
            f"({sorted(extra)[:3]}); split this model with an nn.Sequential or nn.ModuleList "
            "of blocks that torch.fx can trace"
        )
