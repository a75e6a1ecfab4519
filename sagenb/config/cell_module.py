"""The module a cell runs in: a real one, registered in `sys.modules`, as a kernel's `__main__` is.

A class defined by `exec(code, namespace)` gets `__module__ = namespace["__name__"]`, and
`dataclasses` (`_is_type`, for string annotations), `pickle`, `typing.get_type_hints` and
`enum` look that name up in `sys.modules`. A name no module is registered under breaks all of
them: a `@dataclass` in the cell crashed every rank. So each run of a cell gets a fresh
`types.ModuleType` of its own, registered while the run lasts:

- on an engine (and under torchrun), the run's `scope()` (engine/entry.py's train_rank)
  removes it when the run ends, however it ends, with the rest of the run's state;
- in the notebook's process, the estimate's scope removes it once its figures are made; the
  model `result.model()` rebuilds (run/trained.py) keeps its module for as long as the kernel
  runs, as `__main__` keeps a kernel's classes: the model pickles (`torch.save(model)`), and
  each rebuild has a module of its own, so an older model still pickles after a newer one.

The name is `__smp_cell_<pid>_<n>__`, n counting the cells this process ran:

- a valid identifier without dots, so pickle's by-reference lookup (`import` by name, then
  `getattr` by qualname) finds it, and nothing reads it as a package path;
- dunder, as `__main__` is, so it cannot be a file a user's import would pick up;
- unique per run and per process: an object pickled by reference in one run (a checkpoint
  holding a cell's object, a class kept from an earlier run) never unpickles silently as
  another run's class of the same name, here or in another process: it fails naming its module.

That name is what `cls.__module__` and errors show (`<class '__smp_cell_4242_3__.GPTConfig'>`).

cloudpickle pickles a cell module's classes and functions by value, as it does `__main__`'s
(`register_pickle_by_value`): a process that does not have the module (a DataLoader worker
spawned rather than forked, engine/data/loader.py) gets them with the object that needs them.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

__all__ = ["PREFIX", "new_module", "remove", "scope", "live", "install"]

#: every cell module's name starts with it (and ends with "__")
PREFIX = "__smp_cell_"

_count = itertools.count(1)
#: per thread, the names registered inside each open scope(), innermost last
_scopes = threading.local()


def new_module() -> ModuleType:
    """A fresh, empty module, registered in sys.modules under a name of its own; inside a
    `scope()` it is removed when the scope ends."""
    name = f"{PREFIX}{os.getpid()}_{next(_count)}__"
    module = ModuleType(name, "the namespace of a %%smp_train cell (sagenb)")
    _register(module)
    opened: list[list[str]] = getattr(_scopes, "stack", [])
    if opened:
        opened[-1].append(name)
    return module


def remove(name: str) -> None:
    """Unregister the cell module `name` (from sys.modules and cloudpickle's by-value list)."""
    module = sys.modules.pop(name, None)
    if module is not None:
        import cloudpickle

        try:
            cloudpickle.unregister_pickle_by_value(module)
        except ValueError:  # not registered by value (install's stand-ins are not)
            pass


@contextmanager
def scope() -> Iterator[list[str]]:
    """Every cell module made inside (in this thread) is removed when the block exits; it
    yields their names, and a name taken out of that list is kept (a run's state kept for
    --continue keeps its cell's module: engine/live/kept.py removes it)."""
    stack: list[list[str]] = _scopes.__dict__.setdefault("stack", [])
    made: list[str] = []
    stack.append(made)
    try:
        yield made
    finally:
        for name in stack.pop():
            remove(name)


def live() -> dict[str, dict[str, type]]:
    """The cell modules registered now, each with the classes defined at its top level: what a
    process without them needs to pickle a cell's objects by reference (install)."""
    return {
        name: {
            k: v
            for k, v in vars(module).items()
            if isinstance(v, type) and v.__module__ == name and v.__qualname__ == k
        }
        for name, module in list(sys.modules.items())
        if name.startswith(PREFIX) and module is not None
    }


def install(modules: dict[str, dict[str, type]]) -> None:
    """Register stand-ins of `live()`'s modules in this process (a spawned DataLoader worker):
    each holds the classes given, so pickling their instances by reference (a batch of a
    cell's dataclass going back to the engine) finds them by name, as the engine will."""
    for name, classes in modules.items():
        module = sys.modules.get(name) or ModuleType(name)
        vars(module).update(classes)
        sys.modules[name] = module


def _register(module: ModuleType) -> None:
    sys.modules[module.__name__] = module
    import cloudpickle  # ipyparallel's dependency; imported when a cell first runs

    cloudpickle.register_pickle_by_value(module)
