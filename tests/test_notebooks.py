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
    # the finished dashboard is a static copy, for viewers without a kernel or network, and
    # the saved notebook stays small: at most ~300 KB per dashboard (issue 17)
    boards = [o for o in outputs if "smp-static-copy" in o.get("data", {}).get("text/html", "")]
    assert boards, "no finished dashboard's static copy"
    size = len(nbformat.writes(nb).encode())
    assert size <= 300_000 * len(boards), f"{size / 1e3:.0f} KB for {len(boards)} dashboards"
