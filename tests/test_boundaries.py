"""The engine side stays free of notebook libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_engine_side_imports_no_notebook_libraries():
    """The engines' code, and an exported torchrun script's (sagenb.engine.launch, which
    needs no ipyparallel either), import none of the notebook's libraries. One interpreter
    for both: a cold torch import costs seconds."""
    code = (
        "import sys, sagenb.engine.launch\n"
        "print(sorted(m for m in ('IPython', 'ipywidgets', 'plotly', 'ipyparallel') "
        "if m in sys.modules))\n"
        "import sagenb.engine.entry, sagenb.engine.loop, sagenb.engine.strategies\n"
        "print(sorted(m for m in ('IPython', 'ipywidgets', 'plotly') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "[]"]


# -- the layout: roles as folders, imports one way (docs/architecture.md) ------------------------

SAGENB = Path(__file__).resolve().parent.parent / "sagenb"
#: the notebook's roles, which the engine side never imports
NOTEBOOK_SIDE = ("notebook", "display", "pool", "run", "sizing")
#: strategies kept as folders: others reach them only through the folder's face (__init__.py)
STRATEGY_FOLDERS = (
    "sagenb.engine.strategies.pipeline",
    "sagenb.engine.strategies.tensor",
    "sagenb.engine.strategies.experts",
)
MAX_MODULES = 12  # in one folder, __init__.py not counted
MAX_MODULE_LINES = (
    600  # a module that grows past it holds two things (split by what changes together)
)
MAX_FUNCTION_LINES = 50  # from its def to its last line, docstring included


def _modules() -> dict[str, Path]:
    found = {}
    for path in SAGENB.rglob("*.py"):
        parts = list(path.relative_to(SAGENB.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the sagenb modules it imports, at its top, inside a function (a lazy import
    that breaks a cycle at run time is still a cycle) or under `if TYPE_CHECKING:` (a module
    that names another's types in its annotations knows it: a cycle closed through one is
    still a cycle, as config/options.py and the strategies' was); `from P import name` is an
    edge to P.name where that is a module, else to P."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: package.count(".") + 2 - node.level]
                    base = ".".join(up + [base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            graph[module] |= {t for t in targets if t in modules and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _edges(graph, source=lambda m: True, target=lambda t: True) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if source(m) for t in ts if target(t))


def test_the_checker_sees_a_cycle_and_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # function-level imports count: the description's registry once was one
    assert "sagenb.pool.cluster" in import_graph()["sagenb"]  # load_ipython_extension's
    # and annotation-only ones: the description names EngineConfig under TYPE_CHECKING
    assert "sagenb.config.options" in import_graph()["sagenb.engine.strategies.description"]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_option_spec_imports_only_the_error():
    """A strategy's module declares its options with sagenb.config's Option: importing it
    imports the error of a bad value and nothing of the options."""
    assert import_graph()["sagenb.config.spec"] == {"sagenb.config.errors"}


def test_the_config_imports_nothing_of_the_engine_side():
    """The ground floor stands on nothing above it: the config asks the strategies through its
    registry, which they fill as they load (config/registry.py), not even naming their types.
    Importing the options loads no strategy (nor torch); the first question does."""
    config_to_engine = _edges(
        import_graph(),
        lambda m: m.startswith("sagenb.config"),
        lambda t: t.startswith("sagenb.engine"),
    )
    assert config_to_engine == []
    code = (
        "import sys, sagenb.config.options as o\n"
        "print('sagenb.engine.strategies' in sys.modules, 'torch' in sys.modules)\n"
        "print(o.TrainConfig(strategy='model', partitions=2).partitions)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "2"]


def test_the_metrics_load_without_torch_or_the_options():
    """metrics/ stands one floor above the config: a result names torch's and the options'
    types in its annotations only, and asks the strategy through the config's seam."""
    code = (
        "import sys, sagenb.metrics.result, sagenb.metrics.stream\n"
        "print(sorted(m for m in ('torch', 'sagenb.config.options') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]"]


def test_the_engine_side_imports_none_of_the_notebook_roles():
    side = tuple(f"sagenb.{role}" for role in NOTEBOOK_SIDE)
    assert (
        _edges(
            import_graph(), lambda m: m.startswith("sagenb.engine"), lambda t: t.startswith(side)
        )
        == []
    )


#: which role may import which, as docs/architecture.md's table says (a role: a folder of sagenb/;
#: "sagenb" is the package's face, whose %load_ext registers the magics)
MAY_IMPORT = {
    "sagenb": {"config", "display", "engine", "notebook", "pool", "sizing"},
    "notebook": {"config", "display", "engine", "metrics", "pool", "run", "sizing"},
    "config": set(),
    "run": {"config", "display", "engine", "metrics", "pool", "sizing"},
    "pool": {"config", "engine"},
    "engine": {"config", "metrics"},
    "metrics": {"config"},
    "display": {"config", "metrics", "sizing"},
    "sizing": {"config", "engine", "metrics", "pool"},
    "teaching": {"metrics", "engine", "display", "run", "sizing"},
}


def _role(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_each_role_imports_only_what_the_architecture_allows():
    graph = import_graph()
    assert {_role(m) for m in graph} == set(MAY_IMPORT)  # a new folder needs its row
    crossing = _edges(graph)
    assert [
        edge
        for edge in crossing
        if (a := _role(edge.split(" -> ")[0])) != (b := _role(edge.split(" -> ")[1]))
        and b not in MAY_IMPORT[a]
    ] == []


def test_each_allowance_is_an_edge_and_the_roles_stand_in_floors():
    """MAY_IMPORT allows no import that no module makes (a row is dropped when its last edge
    goes), and the roles import each other in no circle: every role stands above all those it
    may import, so no arrow between folders runs back up."""
    graph = import_graph()
    used: dict[str, set[str]] = {role: set() for role in MAY_IMPORT}
    for module, targets in graph.items():
        used[_role(module)] |= {_role(t) for t in targets} - {_role(module)}
    unused = {role: allowed - used[role] for role, allowed in MAY_IMPORT.items()}
    assert {role: roles for role, roles in unused.items() if roles} == {}
    assert cycles(MAY_IMPORT) == []


def test_the_display_never_imports_a_strategy():
    assert (
        _edges(
            import_graph(),
            lambda m: m.startswith("sagenb.display"),
            lambda t: t.startswith("sagenb.engine.strategies"),
        )
        == []
    )


#: the engine's folders the strategies build on, which never import a strategy back
BELOW_THE_STRATEGIES = ("model", "data", "wire", "checkpoint")


def test_what_the_strategies_build_on_imports_no_strategy():
    """The strategies import the model, data, wire and checkpoint folders: these ask a
    strategy through the config's seam (config/registry.py), as engine/model/equivalence.py
    does, so no arrow inside the engine runs back up."""
    below = tuple(f"sagenb.engine.{folder}" for folder in BELOW_THE_STRATEGIES)
    assert (
        _edges(
            import_graph(),
            lambda m: m.startswith(below),
            lambda t: t.startswith("sagenb.engine.strategies"),
        )
        == []
    )


def test_a_strategy_folder_is_reached_only_through_its_face():
    for folder in STRATEGY_FOLDERS:
        inside = lambda m, folder=folder: m == folder or m.startswith(folder + ".")  # noqa: E731
        helpers = lambda t, folder=folder: t.startswith(folder + ".")  # noqa: E731
        assert _edges(import_graph(), lambda m, inside=inside: not inside(m), helpers) == []


def test_no_module_or_function_outgrows_its_limit():
    """Modules under MAX_MODULE_LINES lines, functions (methods and nested ones too) under
    MAX_FUNCTION_LINES: each listed with its length where it is over."""
    over = []
    for path in sorted(SAGENB.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(SAGENB.parent).as_posix()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            over.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert over == []


def test_each_folder_holds_a_handful_of_modules():
    counts: dict[str, int] = {}
    for path in SAGENB.rglob("*.py"):
        if path.name != "__init__.py":
            folder = path.parent.relative_to(SAGENB.parent).as_posix()
            counts[folder] = counts.get(folder, 0) + 1
    assert {f: n for f, n in counts.items() if n > MAX_MODULES} == {}


def test_the_paths_exported_scripts_import_still_work():
    """Scripts `%%smp_export` wrote before the folders were laid out import these two."""
    code = "from sagenb.config import EngineConfig; from sagenb.engine.launch import main; print(1)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


#: what a user's cell may bring, which sagenb's dependencies do not include (pyproject.toml): no
#: module of sagenb imports them when it is imported, only when a cell uses them
OPTIONAL = ("transformers", "peft", "datasets", "safetensors", "accelerate", "tensorboard")


def test_no_module_imports_what_only_a_cell_brings():
    """Every module of sagenb imports with the optional packages missing, as in a Binder image
    or a user's venv without them (pretrained.py imported safetensors at the top: notebook 1
    failed in a fresh environment without transformers)."""
    modules = sorted(import_graph())
    code = (
        "import importlib, sys\n"
        f"blocked = {OPTIONAL!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_each_role_has_its_row_in_the_architecture_table():
    """docs/architecture.md's table has a row for each role MAY_IMPORT has: the package's face
    as `sagenb/__init__.py`, a folder as `folder/`."""
    page = (SAGENB.parent / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| `")}
    wanted = {"sagenb": "`sagenb/__init__.py` (the package's face)"}
    missing = [r for r in MAY_IMPORT if wanted.get(r, f"`{r}/`") not in rows]
    assert missing == []
