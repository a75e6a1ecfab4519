"""Notebooks are code: each runs top to bottom in a real kernel and must not raise."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from sagenb import cluster

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    cluster.stop_pool()  # the notebook's kernel starts its own pool; keep the cores for it
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert "largest parameter difference" in text  # each notebook checks against a reference
    widgets = [
        o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, "the live dashboard was not displayed"
    # the finished dashboard also carries a static copy, for viewers without a kernel
    assert any("plotly" in o["data"].get("text/html", "") for o in widgets)
