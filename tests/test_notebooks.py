"""Notebooks are code: each runs top to bottom in a real kernel and must not raise, and the
documentation site shows each one as a page with its outputs (issue 18).

One run serves both: the session's `site` fixture builds the docs with MyST-NB executing every
notebook (docs/conf.py), once, whichever test asks first; the tests below assert on the executed
copies MyST-NB leaves beside the site (`jupyter_execute/`) and on the built pages. Running the
notebooks here with nbclient as well would double the suite's slowest part.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from sagenb.pool import cluster

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# the notebooks run one after another in the build: their sum, with room for a busy machine
pytestmark = pytest.mark.timeout(1800)


@dataclass
class Site:
    html: Path  # the built site
    executed: Path  # MyST-NB's executed copies of the notebooks, widget state included
    build: subprocess.CompletedProcess
    seconds: float

    def run_time(self, path: Path) -> str:
        """MyST-NB's "Executed notebook in N seconds" for this notebook, for the test log."""
        log = self.build.stdout + self.build.stderr
        found = re.search(rf"{re.escape(path.stem)}.*?Executed notebook in ([\d.]+) seconds", log)
        return f"{found.group(1)} s" if found else "unknown"


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Site:
    """The docs built with every notebook executed (`nb_execution_mode=force`: no cache from an
    earlier build), warnings as errors; a notebook's raising cell is such a warning."""
    cluster.stop_pool()  # each notebook's kernel starts its own pool; keep the cores for it
    out = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-b",
            "html",
            "-D",
            "nb_execution_mode=force",
            str(ROOT / "docs"),
            str(out / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=1700,
    )
    return Site(
        out / "html", out / "jupyter_execute" / "notebooks", build, time.monotonic() - start
    )


def test_site_builds_with_notebooks_executed(site):
    print(f"docs built with the notebooks executed in {site.seconds:.0f} s")
    assert site.build.returncode == 0, (
        f"sphinx failed:\n{site.build.stdout[-6000:]}\n{site.build.stderr[-6000:]}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, site):
    executed = site.executed / path.name
    assert executed.exists(), f"the docs build did not execute {path.name}:\n{site.build.stderr}"
    print(f"{path.name} ran in {site.run_time(path)}")
    nb = nbformat.read(executed, as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, f"{path.name} raised:\n" + "\n".join(
        "\n".join(o.get("traceback", [])) for o in errors
    )
    text = "".join(o.get("text", "") for o in outputs)
    assert "largest parameter difference" in text  # each notebook checks against a reference
    # the finished dashboard is a static copy, for viewers without a kernel or network, and
    # the saved notebook stays small: at most ~300 KB per dashboard (issue 17)
    boards = [o for o in outputs if "smp-static-copy" in o.get("data", {}).get("text/html", "")]
    assert boards, "no finished dashboard's static copy"
    size = len(nbformat.writes(nb).encode())
    print(f"{path.name} saved: {size / 1e3:.0f} KB, {len(boards)} dashboard(s)")
    assert size <= 300_000 * len(boards), f"{size / 1e3:.0f} KB for {len(boards)} dashboards"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_page_shows_outputs(path, site):
    """The notebook's page shows what the run printed and the dashboard's static copy (an
    inline SVG), without the widget state (MBs per dashboard) that only a kernel could use."""
    page = site.html / "notebooks" / f"{path.stem}.html"
    assert page.exists(), f"no page for {path.name}: is it in docs/index.md's toctree?"
    html = page.read_text()
    assert "largest parameter difference" in html
    assert "smp-static-copy" in html, "the dashboard's static copy is missing"
    assert "application/vnd.jupyter.widget-state+json" not in html
    assert len(html) < 2_000_000, f"{page.name} is {len(html) / 1e6:.1f} MB"
