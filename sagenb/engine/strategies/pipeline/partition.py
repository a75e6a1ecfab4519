"""Splitting a model into pipeline stages at block boundaries.

A model is split where its repeated blocks are (blocks.py: the children of an
`nn.Sequential`, the items of the largest `nn.ModuleList`, or the children of the top-most
Sequentials, as a ResNet's layer1..layer4). Two front ends cut it:

* torch.fx (first): the forward is traced symbolically, stepping only into the modules on the
  path to the blocks and keeping every other module whole, so the graph reads embeddings,
  block 0, block 1, ..., norm, head. Stage s gets the graph nodes from its first block's call
  up to the next stage's, and passes on every value that a later stage still needs.
* torch.export (export_split.py), when fx cannot trace the forward (library models
  such as transformers'), given an example microbatch.
Where neither can, the error names where each stopped.

Parameters used by more than one stage (an embedding tied to the output head) are found by
identity in the unsplit model, so their gradients can be summed across the stages that hold
them, as Megatron does.
"""

from __future__ import annotations

import os
import traceback
from functools import partial
from pathlib import Path

import torch
from torch import fx, nn

from sagenb.config.job import JobError
from sagenb.engine.model.blocks import Blocks, find_blocks, tied_groups

__all__ = ["Blocks", "find_blocks", "split_model", "tied_groups", "stage_of_pieces"]


class _BlockTracer(fx.Tracer):
    """Traces only the top-level forward: everything off the path to the blocks is a leaf."""

    def __init__(self, traced_through: set[str]) -> None:
        super().__init__()
        self.traced_through = traced_through

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname not in self.traced_through


def _trace(model: nn.Module, blocks: Blocks) -> fx.GraphModule:
    graph = _BlockTracer(blocks.through()).trace(model)
    gm = fx.GraphModule(model, graph)
    order = [i for n in gm.graph.nodes if (i := _block_index(n, blocks)) is not None]
    if order != sorted(order):
        raise JobError(
            f"model.forward calls its blocks out of order ({[blocks.qualified(i) for i in order]})"
            ": a pipeline runs them in the order the model registers them; register them in "
            "the order forward calls them"
        )
    return gm


def _block_index(node: fx.Node, blocks: Blocks) -> int | None:
    if node.op != "call_module":
        return None
    for i in range(len(blocks)):
        if node.target == blocks.qualified(i):
            return i
    return None


def stage_of_pieces(gm: fx.GraphModule, blocks: Blocks, starts: list[int]) -> dict[fx.Node, int]:
    """The stage of every graph node: a new stage begins at the call of block starts[s]."""
    stage, assignment = 0, {}
    for node in gm.graph.nodes:
        i = _block_index(node, blocks)
        while i is not None and stage + 1 < len(starts) and i >= starts[stage + 1]:
            stage += 1
        assignment[node] = stage
    return assignment


def split_model(
    model: nn.Module, starts: list[int], example: tuple[tuple, dict] | None = None
) -> tuple[list[nn.Module], Blocks]:
    """One module per stage; stage s begins at block starts[s] (starts[0] == 0).

    torch.fx first; where it cannot trace the forward, torch.export on `example` (one
    microbatch's positional and keyword inputs, of the size the schedule runs: its shapes may
    be specialised)."""
    blocks = find_blocks(model)
    try:
        gm = _trace(model, blocks)
    except JobError:
        raise
    except Exception as fx_exc:  # noqa: BLE001 - fx raises many kinds; all mean "not traceable"
        if any(p.is_meta for p in model.parameters()):
            raise JobError(
                f"--delay-init: torch.fx cannot trace model.forward ({_where(fx_exc)}), and the "
                "torch.export front end needs real parameters; leave --delay-init off for this "
                "model, or make its forward traceable by torch.fx"
            ) from None
        if example is None:
            raise JobError(
                f"model.forward could not be traced by torch.fx to split it into stages: "
                f"{_where(fx_exc)}; write the forward without Python branches on tensor values, "
                "or use an nn.Sequential"
            ) from None
        return _export_or_explain(model, blocks, starts, example, fx_exc), blocks
    return _fx_stages(gm, blocks, starts), blocks


def _export_or_explain(
    model: nn.Module, blocks: Blocks, starts: list[int], example: tuple, fx_exc: Exception
) -> list[nn.Module]:
    from sagenb.engine.strategies.pipeline.export_split import export_stages

    try:
        return export_stages(model, blocks, starts, example)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - export raises many kinds
        raise JobError(
            f"model ({type(model).__name__}) could not be split into pipeline stages: torch.fx "
            f"stopped at {_where(fx_exc)}; torch.export stopped at {_where(exc)}. Remove that "
            "construct from forward (a Python branch on a tensor's value, a data-dependent "
            "shape), move it into one block, or train with --strategy data or sharded"
        ) from None


#: sagenb/ itself (this module is sagenb/engine/strategies/pipeline/partition.py)
SAGENB_DIR = Path(__file__).resolve().parents[3]


def _where(exc: BaseException, limit: int = 240) -> str:
    """'file, line N, in fn (source): Error: message' for the innermost frame outside torch
    and sagenb (the code the tracer was running when it gave up), the message cut to its
    first line."""
    skip = (os.path.dirname(torch.__file__), str(SAGENB_DIR))
    frames: list[traceback.FrameSummary] = []
    cause: BaseException | None = exc
    while not frames and cause is not None:
        tb = traceback.extract_tb(cause.__traceback__)
        frames = [f for f in tb if not f.filename.startswith(skip)]
        cause = cause.__cause__
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > limit:
        message = message[: limit - 3] + "..."
    text = f"{type(exc).__name__}: {message}"
    if frames:
        f = frames[-1]
        source = f" ({f.line.strip()})" if f.line else ""
        text = f"{os.path.basename(f.filename)}, line {f.lineno}, in {f.name}{source}: {text}"
    return text


def _fx_stages(gm: fx.GraphModule, blocks: Blocks, starts: list[int]) -> list[nn.Module]:
    where = stage_of_pieces(gm, blocks, starts)
    nodes = list(gm.graph.nodes)
    last_use = {n: max((where[u] for u in n.users), default=where[n]) for n in nodes}
    stages: list[nn.Module] = []  # GraphModules, typed as split_model gives them
    carried: list[fx.Node] = [n for n in nodes if n.op == "placeholder"]
    for s in range(len(starts)):
        graph, env = fx.Graph(), {}
        for n in carried:
            env[n] = graph.placeholder(n.name)
        for n in nodes:
            if where[n] != s or n.op in ("placeholder", "output"):
                continue
            if n.op == "get_attr" and n in env:
                continue
            env[n] = graph.node_copy(n, partial(_lookup, env, graph=graph))
        if s == len(starts) - 1:
            out = next(n for n in nodes if n.op == "output")
            graph.output(fx.map_arg(out.args[0], partial(_lookup, env, graph=graph)))
        else:
            carried = [n for n in env if last_use[n] > s and n.op != "get_attr"]
            _check_tensors(carried, s)
            outputs = tuple(env[n] for n in carried)
            graph.output(outputs[0] if len(outputs) == 1 else outputs)
        graph.lint()
        stages.append(fx.GraphModule(gm, graph, class_name=f"Stage{s}"))
    return stages


def _lookup(env: dict, node: fx.Node, graph: fx.Graph) -> fx.Node:
    """A value for `node` in this stage's graph; get_attr nodes are re-created where used."""
    if node not in env:
        if node.op != "get_attr":
            raise JobError(f"the split model uses {node.name} before it is computed")
        assert isinstance(node.target, str)  # a get_attr node's target is the attribute's name
        env[node] = graph.get_attr(node.target)
    return env[node]


def _check_tensors(carried: list[fx.Node], s: int) -> None:
    if len(carried) == 0:
        raise JobError(f"nothing flows from pipeline stage {s} to stage {s + 1}")


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def check_split(stages: list[nn.Module], model: nn.Module, example: torch.Tensor) -> None:
    """Running the stages one after another gives the model's output (used in tests)."""
    value = example
    for st in stages:
        value = st(*value) if isinstance(value, tuple) else st(value)
    torch.testing.assert_close(value, model(example))
