"""Library output on an engine stays text for the length of a run: no widget leaves the engine.

An engine is an ipykernel, so tqdm.auto (transformers' from_pretrained, datasets.map, a cell's
own loops) picks its notebook bar there: ipywidgets, whose comm messages ipyparallel's client
forwards to the notebook's kernel. In a kernel that drew one bar per rank; in an IPython without
one (terminal ipython, a test's InteractiveShell) ipyparallel's IOPub handler raised
AttributeError on them and no later message of the run arrived ("rank 0 published N metric
messages but 0 arrived"). So, while a run trains on the engine:

- tqdm.auto and tqdm.autonotebook hand out tqdm's text bar, as they do outside a kernel: bars go
  to the engine's stderr, with the cell's prints, logging and warnings (the notebook shows rank
  0's: run/output.py);
- `comm.create_comm` makes the comm package's DummyComm, which sends nothing, so a widget
  made anyway (tqdm.notebook named outright, a library class bound to it before the run, a
  cell's ipywidgets) stays on the engine;
- the warning filters and the once-per-location memory are the run's own (catch_warnings): a
  cell's `simplefilter` does not outlive its run, and each run warns as a fresh process would.

All of it is undone when the run ends, however it ends: the engine is warm, and the next run,
or a `%px` cell, finds the engine as it was. This module imports none of IPython, ipywidgets
or comm: tqdm is imported when installed (in a kernel tqdm.auto brings ipywidgets along, as the
cell's own import of it would), comm only looked up where the kernel already imported it.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

__all__ = ["text_output"]


@contextmanager
def text_output(ignore: tuple[type[Warning], ...] = ()) -> Iterator[None]:
    """Text bars and no widgets until the block ends (see above); warnings of the `ignore`
    categories are not shown meanwhile."""
    patched: list[tuple[ModuleType, str, Any]] = []
    try:
        patched += _text_tqdm()
        patched += _silent_comms()
        with warnings.catch_warnings():
            for category in ignore:
                warnings.filterwarnings("ignore", category=category)
            yield
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _text_tqdm() -> list[tuple[ModuleType, str, Any]]:
    """Point tqdm.auto's and tqdm.autonotebook's names at the text bars; what was there before.
    Imported here when tqdm is installed (~40 ms, once per engine): the first import of
    tqdm.auto decides once for the process, and in a kernel it decides on widgets."""
    if importlib.util.find_spec("tqdm") is None:
        return []  # no tqdm, no bar to keep text
    import tqdm.asyncio
    import tqdm.auto
    import tqdm.autonotebook
    import tqdm.std

    # tqdm.auto's trange calls tqdm.auto.tqdm, so its tqdm is enough there
    text = [
        (tqdm.auto, "tqdm", tqdm.asyncio.tqdm),
        (tqdm.autonotebook, "tqdm", tqdm.std.tqdm),
        (tqdm.autonotebook, "trange", tqdm.std.trange),
    ]
    return _replace(text)


def _silent_comms() -> list[tuple[ModuleType, str, Any]]:
    """comm.create_comm making the comm package's DummyComm (what it makes until ipykernel
    replaces it: a comm that publishes nothing) instead of ipykernel's, which sends to the
    notebook."""
    comm = sys.modules.get("comm")
    silent = getattr(comm, "DummyComm", None)
    if comm is None or silent is None:
        return []  # no kernel imported comm: no widget can reach a notebook from here
    return _replace([(comm, "create_comm", silent)])


def _replace(changes: list[tuple[ModuleType, str, Any]]) -> list[tuple[ModuleType, str, Any]]:
    """Set each module attribute; the (module, name, previous value) to put back."""
    undo = []
    for module, name, value in changes:
        undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)
    return undo
