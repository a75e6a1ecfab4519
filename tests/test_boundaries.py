"""The engine side stays free of notebook libraries."""

from __future__ import annotations

import subprocess
import sys


def test_engine_side_imports_no_notebook_libraries():
    code = (
        "import sys, sagenb.engine.entry, sagenb.engine.loop, sagenb.engine.strategies; "
        "print(sorted(m for m in ('IPython', 'ipywidgets', 'plotly') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
