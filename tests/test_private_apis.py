"""torch's, ipyparallel's and ipykernel's private names: each one sagenb relies on still there, and
used only behind sagenb/engine/torch_private.py, sagenb/pool/ipyparallel_private.py and
sagenb/display/ipykernel_private.py (issue 34).

No pool: these run in the fast lane, so a new torch that drops a name fails here first, naming
the name and the sagenb code that needs it.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest
import torch
from torch import nn

from sagenb.display import ipykernel_private
from sagenb.engine import torch_private
from sagenb.pool import ipyparallel_private

SAGENB = Path(__file__).resolve().parent.parent / "sagenb"
TORCH_PRIVATE = SAGENB / "engine" / "torch_private.py"
IPYPARALLEL_PRIVATE = SAGENB / "pool" / "ipyparallel_private.py"
IPYKERNEL_PRIVATE = SAGENB / "display" / "ipykernel_private.py"


def _private(dotted: str) -> bool:
    """A component with a leading underscore (dunders such as __version__ are public)."""
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def resolve(module: str, attribute: str) -> object:
    """The object `attribute` (dotted; a part ending in "()" is called) names in `module`."""
    obj = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        obj = getattr(obj, part.removesuffix("()"))
        if part.endswith("()"):
            obj = obj()  # an instance attribute: set by __init__
    return obj


# -- every private name relied on is there -----------------------------------------------------


@pytest.mark.parametrize(
    "entry", torch_private.PRIVATE_NAMES, ids=lambda e: f"{e.module}:{e.attribute}"
)
def test_each_private_torch_name_resolves(entry: torch_private.PrivateName):
    if not _is_torch(entry.module):  # a torch type's subclass from a package cells bring
        pytest.importorskip(entry.module.split(".")[0])
    try:
        resolve(entry.module, entry.attribute)
    except (ImportError, AttributeError) as exc:
        pytest.fail(
            f"{entry.module} {entry.attribute!r} is gone from torch {torch.__version__} ({exc}): "
            f"sagenb's {entry.used_by} depends on it; replace it in "
            "sagenb/engine/torch_private.py, the only module that uses it"
        )


#: each other library's shim: its name, its private names, the module to fix
SHIMS = (
    ("ipyparallel", ipyparallel_private.PRIVATE_NAMES, "sagenb/pool/ipyparallel_private.py"),
    ("ipykernel", ipykernel_private.PRIVATE_NAMES, "sagenb/display/ipykernel_private.py"),
)


@pytest.mark.parametrize(
    "library, entry, shim",
    [(library, entry, shim) for library, names, shim in SHIMS for entry in names],
    ids=lambda e: e[1] if isinstance(e, tuple) else None,
)
def test_each_private_name_of_another_library_resolves(library, entry, shim):
    module, attribute, used_by = entry
    try:
        resolve(module, attribute)
    except (ImportError, AttributeError) as exc:
        pytest.fail(
            f"{module} {attribute!r} is gone from this {library} ({exc}): sagenb's {used_by} "
            f"depends on it; replace it in {shim}"
        )


def test_annotate_split_points_is_undone_by_clear_split_point():
    """The name getattr cannot check: the _orig_forward annotate_split_points sets."""
    from torch.distributed.pipelining import SplitPoint

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    torch_private.annotate_split_points(model, {"1": SplitPoint.BEGINNING})
    assert "forward" in vars(model[1])
    torch_private.clear_split_point(model[1])
    assert not {"forward", "_orig_forward"} & set(vars(model[1]))


@pytest.mark.parametrize("zero_bubble", [False, True])
@pytest.mark.parametrize(
    "ranks, chunks, microbatches", [(2, 2, 1), (2, 2, 8), (4, 2, 2), (4, 3, 8)]
)
def test_interleaved_order_is_torchs_own(ranks, chunks, microbatches, zero_bubble):
    """interleaved_order wires torch's two helpers as ScheduleInterleaved1F1B's (and, with
    zero_bubble, ScheduleInterleavedZeroBubble's) own per-rank calculation does: the same
    actions, in the same order, on every rank (the input's gradient of a split backward "I",
    the weights' "W")."""
    from torch.distributed.pipelining import schedules

    cls = (
        schedules.ScheduleInterleavedZeroBubble
        if zero_bubble
        else schedules.ScheduleInterleaved1F1B
    )
    names = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    for rank in range(ranks):
        schedule = object.__new__(cls)  # no stages, no process group
        rounds = max(1, microbatches // ranks)
        vars(schedule).update(
            pp_group_size=ranks, n_local_stages=chunks, _n_microbatches=microbatches,
            number_of_rounds=rounds, microbatches_per_round=microbatches // rounds, rank=rank,
        )  # fmt: skip
        own = [
            (names[a.computation_type.name], a.stage_index, a.microbatch_index or 0)
            for a in schedule._calculate_single_rank_operations(rank)
            if a is not None
        ]
        order = torch_private.interleaved_order(
            ranks, chunks, microbatches, rank, zero_bubble=zero_bubble
        )
        assert order == own


def test_the_flight_recorder_dumps_json():
    """engine/wire/tracing.py's in_flight parses the dump (here without a process group)."""
    dump = torch_private.dump_flight_recorder_json()
    assert dump is not None, f"torch {torch.__version__} has no flight recorder"
    assert isinstance(json.loads(dump), dict)


def test_importing_the_module_costs_nothing_beyond_torch():
    """The lazy names stay lazy: the data loader imports this module, and
    torch.distributed.pipelining would bring torch._dynamo, most of a second."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import sagenb.engine.torch_private\n"
        "print(sorted(m for m in set(sys.modules) - before if not m.startswith('sagenb')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- and used nowhere else ---------------------------------------------------------------------


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain from a name, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _names(entries) -> set[str]:
    """The private parts of the entries' modules and attributes: `_parameters`, `_IR`, ..."""
    return {
        part.removesuffix("()")
        for module, attribute, *_ in entries
        for part in f"{module}.{attribute}".split(".")
        if _private(part)
    }


TORCH_NAMES = _names(torch_private.PRIVATE_NAMES) | {"_orig_forward"}
IPYPARALLEL_NAMES = _names(ipyparallel_private.PRIVATE_NAMES)
IPYKERNEL_NAMES = _names(ipykernel_private.PRIVATE_NAMES)


def private_uses(source: str, names: AbstractSet[str], *, torch_paths: bool = True) -> list[str]:
    """Each use in `source` of one of `names` as an attribute or a string (getattr's), and with
    `torch_paths` of any private torch name: an import of a torch module path or name with a
    leading underscore, or an attribute chain from `torch` through one. "line: what" each."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import) and torch_paths:
            found |= {f"{line}: import {a.name}" for a in node.names if _private_torch(a.name)}
        elif isinstance(node, ast.ImportFrom) and torch_paths and not node.level:
            module, imported = node.module or "", [a.name for a in node.names]
            if _private_torch(module) or (_is_torch(module) and any(map(_private, imported))):
                found.add(f"{line}: from {module} import {', '.join(imported)}")
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if node.attr in names or (torch_paths and _private_torch(chain)):
                found.add(f"{line}: {chain or '...' + node.attr}")
        elif isinstance(node, ast.Constant) and node.value in names:
            found.add(f"{line}: {node.value!r}")
    return sorted(found, key=lambda use: int(use.split(":")[0]))


def _private_torch(dotted: str) -> bool:
    return _is_torch(dotted) and _private(dotted)


def test_the_scan_sees_each_kind_of_private_use():
    source = (
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_leaves\n"
        "from torch.nn.modules.batchnorm import _BatchNorm\n"
        "from torch.distributed.pipelining import _IR\n"
        "x = torch.distributed.pipelining._IR.Pipe\n"
        "it._shutdown_workers()\n"
        "client._config.get('location')\n"
        "getattr(module, '_parameters')\n"
        "import torch.nn, os._exit\n"  # public torch, and not torch at all
        "from sagenb.display.dashboard import _in_kernel\n"  # sagenb's own
        "print(torch.__version__, self._live)\n"
    )
    uses = private_uses(source, TORCH_NAMES | IPYPARALLEL_NAMES)
    assert sorted({int(use.split(":")[0]) for use in uses}) == list(range(1, 9)), uses
    assert private_uses(source, IPYPARALLEL_NAMES, torch_paths=False) == ["7: client._config"]


def _uses_outside(skip: Path, names: AbstractSet[str], *, torch_paths: bool) -> dict[str, list]:
    found = {
        path.relative_to(SAGENB.parent).as_posix(): private_uses(
            path.read_text(), names, torch_paths=torch_paths
        )
        for path in sorted(SAGENB.rglob("*.py"))
        if path != skip
    }
    return {path: uses for path, uses in found.items() if uses}


def test_no_other_module_uses_a_private_torch_name():
    assert _uses_outside(TORCH_PRIVATE, TORCH_NAMES, torch_paths=True) == {}, (
        "private torch names belong in sagenb/engine/torch_private.py, listed in PRIVATE_NAMES"
    )


def test_no_other_module_uses_a_private_ipyparallel_name():
    assert _uses_outside(IPYPARALLEL_PRIVATE, IPYPARALLEL_NAMES, torch_paths=False) == {}, (
        "private ipyparallel names belong in sagenb/pool/ipyparallel_private.py"
    )


def test_no_other_module_uses_a_private_ipykernel_name():
    assert _uses_outside(IPYKERNEL_PRIVATE, IPYKERNEL_NAMES, torch_paths=False) == {}, (
        "private ipykernel names belong in sagenb/display/ipykernel_private.py"
    )


def _unlisted(path: Path, entries) -> list[str]:
    """The private names `path` imports or reads that no entry names."""
    listed = {(module, attribute.split(".")[0]) for module, attribute, *_ in entries}
    names = _names(entries)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and _is_torch(node.module or ""):
            private_module = _private(node.module or "")
            out += [
                f"{node.module} {a.name}"
                for a in node.names
                if (private_module or _private(a.name)) and (node.module, a.name) not in listed
            ]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if _private(a.name) and (a.name, "") not in listed]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in names:
            out.append(f"line {node.lineno}: .{node.attr}")
    return out


def test_every_private_use_in_the_three_modules_is_listed():
    """What torch_private.py, ipyparallel_private.py and ipykernel_private.py import or read
    privately is in their PRIVATE_NAMES, so the names checked above are all the names relied
    on."""
    assert _unlisted(TORCH_PRIVATE, torch_private.PRIVATE_NAMES) == []
    assert _unlisted(IPYPARALLEL_PRIVATE, ipyparallel_private.PRIVATE_NAMES) == []
    assert _unlisted(IPYKERNEL_PRIVATE, ipykernel_private.PRIVATE_NAMES) == []
    on_first_use = set(torch_private._ON_FIRST_USE.values())
    listed = {(m, a.split(".")[0]) for m, a, _ in torch_private.PRIVATE_NAMES}
    assert on_first_use - listed == set()


# -- and no private attribute of another library reached, listed or not -----------------------
#
# The checks above find the names the three shims (torch_private.py, ...) list; a new
# private name (`module._x` on a torch module) is listed nowhere, and a static check cannot
# know `module`'s type. So the rule is stated the other way round: outside the shims, a
# private attribute (a leading underscore, not a dunder) may be reached on the object's own
# class (`self._x`, `cls._x`, `super()._x()`), or by a name sagenb itself defines: a function,
# class or global of its own, a class attribute, or an attribute its own code sets on
# `self`/`cls`, and that none of torch's, ipyparallel's and ipykernel's main types also has (a
# name both define is no proof the object is sagenb's). Marks sagenb puts on another library's
# objects start with `_sagenb_`. Anything else reaches some other library's private attribute,
# and fails: it belongs in a shim, named with the public API it stands in for.

OWN_MARK = "_sagenb_"
#: the types sagenb's code holds most of torch's and ipyparallel's objects as
FOREIGN_TYPES = (
    "torch:Tensor",
    "torch.nn:Module",
    "torch.optim:Optimizer",
    "torch.distributed:TCPStore",
    "ipyparallel:Client",
    "ipyparallel:Cluster",
    "ipyparallel:AsyncResult",
    "ipyparallel:DirectView",
    "ipyparallel:LoadBalancedView",
    "ipykernel.comm.comm:BaseComm",  # a widget's comm (the Stop button)
)
SHIMS = (TORCH_PRIVATE, IPYPARALLEL_PRIVATE, IPYKERNEL_PRIVATE)
#: the calls that reach an attribute by a string
BY_NAME = ("getattr", "setattr", "hasattr", "delattr")


def foreign_private_names() -> set[str]:
    found: set[str] = set()
    for entry in FOREIGN_TYPES:
        module, _, name = entry.partition(":")
        found |= {n for n in dir(getattr(importlib.import_module(module), name)) if _private(n)}
    return found


def own_private_names(sources: list[str]) -> set[str]:
    """The private names sagenb's own code defines (see above)."""
    own = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and _on_own_class(node.value)
            ):
                own.add(node.attr)
    return {name for name in own if _private(name)}


def _on_own_class(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def reached_privately(source: str, allowed: AbstractSet[str]) -> list[str]:
    """Each private attribute `source` reaches on something other than its own class, by a
    name not in `allowed` (nor a `_sagenb_` mark): "line: what"."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            target, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            target, name = node.args[0], node.args[1].value
        else:
            continue
        if not _private(name) or name.startswith(OWN_MARK) or _on_own_class(target):
            continue
        if name not in allowed:
            found.add(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return sorted(found, key=lambda use: int(use.split(":")[0]))


def _sagenb_sources() -> dict[str, str]:
    return {
        path.relative_to(SAGENB.parent).as_posix(): path.read_text()
        for path in sorted(SAGENB.rglob("*.py"))
        if path not in SHIMS
    }


#: public APIs whose names start with an underscore, as their documentation names them:
#: os._exit (docs.python.org/3/library/os.html#os._exit); a namedtuple's _replace, _asdict
#: and _fields (collections.namedtuple's documented methods)
PUBLIC_UNDERSCORED = {"_exit", "_replace", "_asdict", "_fields"}


def _allowed() -> set[str]:
    own = own_private_names(list(_sagenb_sources().values())) - foreign_private_names()
    return own | PUBLIC_UNDERSCORED


def test_the_fence_fails_a_planted_private_attribute_of_another_library():
    allowed = _allowed()
    planted = (
        "def f(module, pool, client):\n"
        "    module._x\n"  # a torch module's, listed nowhere
        "    getattr(module, '_y')\n"  # by name
        "    torch.nn.modules._utils\n"  # a chain from torch
        "    client._config\n"  # a name sagenb defines too, but so does ipyparallel's Client
        "    pool._remember()\n"  # sagenb's own EnginePool method
        "    module._sagenb_out_spec\n"  # a mark sagenb sets on another library's object
        "    self._x, cls._x, super()._x()\n"  # the object's own class
    )
    assert "_config" not in allowed and "_remember" in allowed
    assert reached_privately(planted, allowed) == [
        "2: module._x",
        "3: getattr(module, '_y')",
        "4: torch.nn.modules._utils",
        "5: client._config",
    ]


def test_no_module_reaches_another_librarys_private_attribute():
    allowed = _allowed()
    found = {
        path: uses
        for path, source in _sagenb_sources().items()
        if (uses := reached_privately(source, allowed))
    }
    assert found == {}, (
        "a private attribute of torch's, ipyparallel's or another library's: reach it in "
        "sagenb/engine/torch_private.py, sagenb/pool/ipyparallel_private.py or "
        "sagenb/display/ipykernel_private.py, listed in their "
        "PRIVATE_NAMES with the public API it stands in for (or use a public one)"
    )
