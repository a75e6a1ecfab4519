"""Where a model's repeated blocks are: the places a pipeline may cut it, the units that
activation checkpointing recomputes and FSDP shards.

Found by walking the module tree, first rule that applies:
1. the root is an `nn.Sequential`: its children;
2. the model holds an `nn.ModuleList` of two or more modules: the items of the largest one,
   however deep it sits (a GPT's transformer blocks, `model.layers` of a transformers Llama),
   lists inside another list's items left out (a T5 block's list of sub-layers). An
   encoder-decoder holds two such stacks, one in each of two sibling modules under the same
   name (T5's `encoder.block` and `decoder.block`, BART's `model.encoder.layers` and
   `model.decoder.layers`): the blocks are then the first stack's, then the second's, in the
   order the modules were registered (the order their forward calls them);
3. otherwise the children of the top-most `nn.Sequential` containers (those inside no other
   Sequential), concatenated in the order the modules were registered: a torchvision-style
   ResNet gives layer1.0, layer1.1, layer2.0, ... (torchvision's `_make_layer` builds each
   stage as an nn.Sequential of residual blocks);
4. a one-item ModuleList, as a last resort.
Block names are qualified paths from the root ("layers.3", "layer2.0").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sagenb.config.job import JobError

__all__ = ["Blocks", "find_blocks", "tied_groups"]


@dataclass(frozen=True)
class Blocks:
    """The blocks' qualified names in order, and the containers that hold them."""

    names: tuple[str, ...]
    containers: tuple[str, ...]

    def qualified(self, i: int) -> str:
        return self.names[i]

    def through(self) -> set[str]:
        """The containers and all their ancestors ("" is the root): the modules a tracer
        must step into to see every block's call."""
        out = {""}
        for path in self.containers:
            parts = path.split(".") if path else []
            out.update(".".join(parts[:i]) for i in range(len(parts) + 1))
        return out

    def __len__(self) -> int:
        return len(self.names)


def _children(path: str, container: nn.Module) -> list[str]:
    return [f"{path}.{name}" if path else name for name, _ in container.named_children()]


def find_blocks(model: nn.Module) -> Blocks:
    if isinstance(model, nn.Sequential):
        return Blocks(tuple(_children("", model)), ("",))
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    stacks = _stacks(lists)
    if stacks:
        names = [name for path_, stack in stacks for name in _children(path_, stack)]
        return Blocks(tuple(names), tuple(path_ for path_, _ in stacks))
    path, largest = max(lists, key=lambda item: len(item[1]), default=("", None))
    if largest is not None and len(largest) > 1:
        return Blocks(tuple(_children(path, largest)), (path,))
    tops = _top_sequentials(model)
    names = [name for path_, seq in tops for name in _children(path_, seq)]
    if len(names) > 1:
        return Blocks(tuple(names), tuple(path_ for path_, _ in tops))
    if largest is not None:
        return Blocks(tuple(_children(path, largest)), (path,))
    raise JobError(
        f"model ({type(model).__name__}) cannot be split into pipeline stages: it is neither "
        "an nn.Sequential nor built around an nn.ModuleList of blocks or nn.Sequential "
        "stages of blocks (as a ResNet's layer1..layer4); hold the repeated blocks in one"
    )


def _stacks(lists: list[tuple[str, nn.ModuleList]]) -> list[tuple[str, nn.ModuleList]]:
    """The largest list of two or more modules inside no other list's items, with the lists
    of the same name in its holder's siblings (an encoder's and a decoder's stacks), in
    registration order; [] when the largest such list holds fewer than two."""
    top = [(p, m) for p, m in lists if not any(_inside(p, other) for other, _ in lists)]
    path, largest = max(top, key=lambda item: len(item[1]), default=("", None))
    if largest is None or len(largest) < 2:
        return []
    holder, _, attr = path.rpartition(".")
    if not holder:  # held by the root: no sibling can hold another stack
        return [(path, largest)]
    parent = holder.rpartition(".")[0]

    def sibling(p: str) -> bool:
        other, _, name = p.rpartition(".")
        return name == attr and bool(other) and other.rpartition(".")[0] == parent

    return [(p, m) for p, m in top if p == path or (sibling(p) and len(m) > 1)]


def _inside(path: str, other: str) -> bool:
    """Whether the module at `path` sits strictly inside the one at `other`."""
    return path != other and (other == "" or path.startswith(f"{other}."))


def _top_sequentials(model: nn.Module) -> list[tuple[str, nn.Sequential]]:
    """nn.Sequential modules with no nn.Sequential above them, in registration order."""
    tops: list[tuple[str, nn.Sequential]] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Sequential) or len(module) == 0:
            continue
        if any(path.startswith(f"{top}.") for top, _ in tops):
            continue
        tops.append((path, module))
    return tops


def tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Names that share one Parameter object in the unsplit model (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]
