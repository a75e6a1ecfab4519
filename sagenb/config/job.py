"""What to train: the cell body or a Python callable, checked before any engine runs it.

A job travels to every engine and is executed there after seeding, so every engine builds the
same model and data. The check here is static (the cell's top-level bindings), so a cell that
forgets to define `model` fails in the notebook, not on the engines.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sagenb.config import cell_module

__all__ = ["REQUIRED_NAMES", "OPTIONAL_NAMES", "CELL_FILE", "Job", "JobError", "defined_names"]

REQUIRED_NAMES = ("model", "dataset")
#: the file name a cell's code is compiled under (its frames in tracebacks and stacks)
CELL_FILE = "<smp_train cell>"
#: loss_fn may be left out when batches are dicts with labels (the samples', or those the cell's
#: collate_fn builds): the model's own loss is used
OPTIONAL_NAMES = ("loss_fn", "make_optimizer", "make_scheduler", "eval_dataset", "collate_fn")


class JobError(ValueError):
    """The job is unusable (missing names, wrong types, a dataset too small): fix the cell."""


@dataclass(frozen=True)
class Job:
    """A cell's source, or a cloudpickled callable returning a mapping of the same names."""

    source: str | None = None
    payload: bytes | None = None

    @classmethod
    def of(cls, job: str | Callable[[], Any] | Job) -> Job:
        """`job` as a Job: a Job as it is, a cell's source, or a callable; checked without
        running it (a cell that defines no model fails here)."""
        if isinstance(job, Job):
            return job
        return cls.from_cell(job) if isinstance(job, str) else cls.from_callable(job)

    @classmethod
    def from_cell(cls, source: str) -> Job:
        missing = [n for n in REQUIRED_NAMES if n not in defined_names(source)]
        if missing and "*" not in defined_names(source):
            raise JobError(
                f"the cell defines no {', '.join(missing)}: it must assign model (a "
                "torch.nn.Module) and dataset (a map-style Dataset of (input, target) tuples, or "
                "of dicts of model inputs), and loss_fn (loss_fn(output, target) -> scalar "
                "tensor) unless the model computes its own loss from dict samples' labels (or "
                "those a collate_fn(samples) -> batch builds)"
            )
        return cls(source=source)

    @classmethod
    def from_callable(cls, fn: Callable[[], Any]) -> Job:
        """`fn()` runs on every engine after seeding; returns {'model': ..., ...}."""
        if not callable(fn):
            raise JobError(f"a job is cell source (str) or a callable, not {type(fn).__name__}")
        import cloudpickle  # by value for functions defined in a script or notebook

        return cls(payload=cloudpickle.dumps(fn))

    def first_line(self) -> str:
        """What names the job to a person: the cell's first line of code (60 characters at
        most), or "a callable job"."""
        lines = [line.strip() for line in (self.source or "").splitlines()]
        first = next((line for line in lines if line and not line.startswith("#")), "")
        return (first[:60] + "...") if len(first) > 60 else first or "a callable job"

    def namespace(self) -> dict[str, Any]:
        """Run the job (on an engine) and return its namespace: a cell's is the dict of a fresh
        module registered in sys.modules (config/cell_module.py), removed when the
        `cell_module.scope()` around the run ends, or at once if the cell raises."""
        if self.source is not None:
            # dont_inherit: the cell's own compiler flags, not this module's `from __future__`
            code = compile(self.source, _remembered(self.source), "exec", dont_inherit=True)
            module = cell_module.new_module()
            try:
                exec(code, vars(module))
            except BaseException:
                cell_module.remove(module.__name__)
                raise
            return vars(module)
        import cloudpickle

        result = cloudpickle.loads(self.payload)()
        if not isinstance(result, dict):
            raise JobError(
                f"the job function must return a dict with {', '.join(REQUIRED_NAMES)}; "
                f"it returned {type(result).__name__}"
            )
        return result


def _remembered(source: str) -> str:
    """CELL_FILE, under which linecache now keeps this cell's source, as IPython keeps a
    cell's: tracebacks show the cell's lines, and `inspect.getsource` reads what the cell
    defines (the model's own loss is read from its forward's code, engine/model/own_loss.py). One
    name for every cell (run/stacks.py knows the cell's frames by it): the latest cell's source
    is the one kept, which is the one a run or an estimate reads right after running it."""
    linecache.cache[CELL_FILE] = (len(source), None, source.splitlines(keepends=True), CELL_FILE)
    return CELL_FILE


def defined_names(source: str) -> set[str]:
    """Names bound at the top level of `source` ('*' when a star import makes it unknowable).
    The cell is compiled here too, as the engines will: what only a kernel accepts (IPython's
    `%magic` and `!shell` lines, a top-level `await`) is refused in the notebook, saying so."""
    try:
        tree = ast.parse(source, CELL_FILE)
        compile(tree, CELL_FILE, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise JobError(_syntax(exc, source)) from None
    names: set[str] = set()
    _collect(tree.body, names)
    return names


def _syntax(exc: SyntaxError, source: str) -> str:
    """What is wrong with the cell, in a kernel user's words where the cause is IPython's."""
    lines = source.splitlines()
    line = lines[exc.lineno - 1].strip() if exc.lineno and exc.lineno <= len(lines) else ""
    where = f"line {exc.lineno}: `{line}`" if line else f"line {exc.lineno}"
    if line.startswith(("%", "!")):
        kind = "a magic" if line[0] == "%" else "a shell command"
        return (
            f"the cell's {where} is IPython syntax ({kind}), which the engines do not run: "
            f"they run the cell as plain Python. Move it to a cell of its own above this one"
        )
    if "outside" in exc.msg and "await" in line:
        return (
            f"the cell's {where} awaits at the top level, which only a kernel's own cells may: "
            f"the engines run the cell as plain Python, with no event loop. Wrap it in a "
            f"function and run it with asyncio.run(...)"
        )
    return f"the cell does not parse: {exc.msg}, at {where}"


def _collect(body: list[ast.stmt], names: set[str]) -> None:
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                names.add(alias.asname or alias.name.split(".")[0])
        else:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
            for field in ("body", "orelse", "finalbody", "handlers"):
                nested = getattr(stmt, field, None)
                if isinstance(nested, list) and nested and isinstance(nested[0], ast.stmt):
                    _collect(nested, names)
