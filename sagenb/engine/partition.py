"""Splitting a model into pipeline stages at block boundaries.

A model is split where its repeated blocks are: the children of an `nn.Sequential`, or the
items of the model's largest `nn.ModuleList` (a GPT's transformer blocks, however deeply the
list sits). The top-level forward is traced with torch.fx, every module that is not on the path
to the block list kept whole, so the graph reads embeddings, block 0, block 1, ..., norm, head.
Stage s gets the graph nodes from its first block's call up to the next stage's, and passes on
to the next stage every value that a later stage still needs.

Parameters used by more than one stage (an embedding tied to the output head) are found by
identity in the unsplit model, so their gradients can be summed across the stages that hold
them, as Megatron does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import fx, nn

from sagenb.job import JobError

__all__ = ["Blocks", "find_blocks", "split_model", "tied_groups", "stage_of_pieces"]


@dataclass(frozen=True)
class Blocks:
    """Where the repeated blocks are: `path` of the container, and their names in order."""

    path: str
    names: tuple[str, ...]

    def qualified(self, i: int) -> str:
        return f"{self.path}.{self.names[i]}" if self.path else self.names[i]

    def __len__(self) -> int:
        return len(self.names)


def find_blocks(model: nn.Module) -> Blocks:
    if isinstance(model, nn.Sequential):
        return Blocks("", tuple(name for name, _ in model.named_children()))
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise JobError(
            f"model ({type(model).__name__}) cannot be split into pipeline stages: it is neither "
            "an nn.Sequential nor built around an nn.ModuleList of blocks"
        )
    path, blocks = max(lists, key=lambda item: len(item[1]))
    return Blocks(path, tuple(name for name, _ in blocks.named_children()))


class _BlockTracer(fx.Tracer):
    """Traces only the top-level forward: everything off the path to the blocks is a leaf."""

    def __init__(self, traced_through: set[str]) -> None:
        super().__init__()
        self.traced_through = traced_through

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname not in self.traced_through


def _trace(model: nn.Module, blocks: Blocks) -> fx.GraphModule:
    parts = blocks.path.split(".") if blocks.path else []
    through = {".".join(parts[:i]) for i in range(len(parts) + 1)}  # "" is the root
    try:
        graph = _BlockTracer(through).trace(model)
    except Exception as exc:  # noqa: BLE001 - fx raises many kinds; all mean "not traceable"
        raise JobError(
            f"model.forward could not be traced to split it into stages ({type(exc).__name__}: "
            f"{exc}); write the top-level forward without Python branches on tensor values "
            "(e.g. asserts on shapes), or use an nn.Sequential"
        ) from None
    return fx.GraphModule(model, graph)


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


def split_model(model: nn.Module, starts: list[int]) -> tuple[list[fx.GraphModule], Blocks]:
    """One module per stage; stage s begins at block starts[s] (starts[0] == 0)."""
    blocks = find_blocks(model)
    gm = _trace(model, blocks)
    where = stage_of_pieces(gm, blocks, starts)
    nodes = list(gm.graph.nodes)
    last_use = {n: max((where[u] for u in n.users), default=where[n]) for n in nodes}
    stages = []
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
    return stages, blocks


def _lookup(env: dict, node: fx.Node, graph: fx.Graph) -> fx.Node:
    """A value for `node` in this stage's graph; get_attr nodes are re-created where used."""
    if node not in env:
        if node.op != "get_attr":
            raise JobError(f"the split model uses {node.name} before it is computed")
        env[node] = graph.get_attr(node.target)
    return env[node]


def _check_tensors(carried: list[fx.Node], s: int) -> None:
    if len(carried) == 0:
        raise JobError(f"nothing flows from pipeline stage {s} to stage {s + 1}")


def tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Names that share one Parameter object in the unsplit model (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def check_split(stages: list[nn.Module], model: nn.Module, example: torch.Tensor) -> None:
    """Running the stages one after another gives the model's output (used in tests)."""
    value = example
    for st in stages:
        value = st(*value) if isinstance(value, tuple) else st(value)
    torch.testing.assert_close(value, model(example))
