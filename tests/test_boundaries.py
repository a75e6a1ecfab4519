"""The engine side stays free of notebook libraries."""

from __future__ import annotations

import subprocess
import sys


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
