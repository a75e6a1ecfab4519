"""Notebooks are code: each runs top to bottom in a real kernel and must not raise, its
exercises are proved solvable, and the documentation site shows each one as a page with its
outputs, and its prose quotes only figures its cells printed (issues 18 and 35).

One run serves all three. The session's `site` fixture runs each notebook once with nbclient,
as shipped (its answers blank: each check prints "not answered yet"); then, in the same kernel,
it runs the notebook's solution file (notebooks/solutions/) and its check cells again, which
must pass. The checks reuse the runs the notebook made, so a notebook is never run twice. The
executed notebooks, as shipped, go into a jupyter-cache from which the site's build (MyST-NB's
"cache" mode, docs/conf.py) takes their outputs instead of running them again.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from sagenb.pool import cluster
from sagenb.teaching.exercises import NOT_ANSWERED

from .prose import contradictions

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = ROOT / "notebooks" / "solutions"
TAMPER = Path(__file__).resolve().parent / "tamper.py"
# the cell tags of the exercises: an answer, its check, the one extra run a notebook may make
ANSWER, CHECK, RUN = "exercise-answer", "exercise-check", "exercise-run"
# the notebooks run one after another: their sum, with room for a busy machine
pytestmark = pytest.mark.timeout(1800)
CELL_TIMEOUT_S = 300  # per cell, as docs/conf.py's nb_execution_timeout


@dataclass
class Executed:
    """One notebook run by the fixture."""

    #: executed as shipped (answers blank), widget state included: what the site shows
    shipped: nbformat.NotebookNode
    seconds: float  # the shipped notebook's cells, start-up of its kernel included
    error: str | None = None  # the traceback of the cell that raised
    #: what each check printed after the solution ran (a traceback where one raised)
    graded: list[str] = field(default_factory=list)
    solve_seconds: float = 0.0  # the solution and the checks again
    #: what the checks accepted of tampered answers (tests/tamper.py); None where not run
    tampered: list[str] | None = None


@dataclass
class Site:
    html: Path  # the built site
    build: subprocess.CompletedProcess
    seconds: float
    notebooks: dict[str, Executed]


def _cells(nb: nbformat.NotebookNode, tag: str) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


def _text(cell: nbformat.NotebookNode) -> str:
    """What a code cell printed, its traceback included."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
        else:
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def _run(client: NotebookClient, cells: list[nbformat.NotebookNode], first: int) -> str | None:
    """Execute cells on the client's live kernel; the traceback of the first that raises."""
    for index, cell in enumerate(cells, start=first):
        try:
            client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
        except CellExecutionError:
            return traceback.format_exc()
    return None


def execute(path: Path, cwd: Path) -> Executed:
    """Run the notebook as shipped, then its solution and its checks in the same kernel.

    nbclient's own `execute()` shuts the kernel down at the end; this does what it does
    (kernel info into the metadata, every cell, the widgets' state) with the kernel kept for
    the solution (https://nbclient.readthedocs.io/en/latest/client.html)."""
    nb = nbformat.read(path, as_version=4)
    # record_timing=False as MyST-NB executes: timings in the cells' metadata would change the
    # hash by which its cache matches a notebook to its executed copy
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False)
    start = time.monotonic()
    with client.setup_kernel(cwd=str(cwd)):
        info = client.wait_for_reply(client.kc.kernel_info())
        nb.metadata["language_info"] = info["content"]["language_info"]
        error = _run(client, nb.cells, 0)
        client.set_widgets_metadata()
        done = Executed(copy.deepcopy(nb), time.monotonic() - start, error)
        if error is None:
            start = time.monotonic()
            solution = nbformat.v4.new_code_cell(f"%run -i {SOLUTIONS / (path.stem + '.py')}")
            checks = [nbformat.v4.new_code_cell(c.source) for c in _cells(nb, CHECK)]
            extra = [solution, *checks]
            nb.cells.extend(extra)
            failed = _run(client, extra, len(nb.cells) - len(extra))
            done.graded = [_text(c) for c in checks]
            if failed:
                done.graded.append(failed)
            else:
                done.tampered = _tamper(client, nb, checks)
            done.solve_seconds = time.monotonic() - start
    return done


def _tamper(
    client: NotebookClient, nb: nbformat.NotebookNode, checks: list[nbformat.NotebookNode]
) -> list[str] | None:
    """Every check again on tampered answers, in the kernel (tests/tamper.py): what it accepted."""
    sources = json.dumps([c.source for c in checks])
    cell = nbformat.v4.new_code_cell(f"_tamper_checks = {sources}\n%run -i {TAMPER}")
    nb.cells.append(cell)
    if _run(client, [cell], len(nb.cells) - 1):
        return None
    found = re.search(r"^tamper report: (.*)$", _text(cell), re.M)
    return json.loads(found.group(1)) if found else None


def _cache(executed: dict[str, Executed], folder: Path) -> Path:
    """A jupyter-cache holding each executed notebook, as MyST-NB's cache mode reads it: a
    notebook whose code cells match one here is rendered with its outputs, not executed."""
    cache = get_cache(str(folder))
    for name, run in executed.items():
        path = ROOT / "notebooks" / name
        bundle = CacheBundleIn(run.shipped, str(path))
        cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
        # the build would run a notebook the cache does not match: say so now, not after it
        cache.match_cache_notebook(nbformat.read(path, as_version=4))
    return folder


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Site:
    """Every notebook executed (and its exercises solved), then the docs built from them,
    warnings as errors."""
    cluster.stop_pool()  # each notebook's kernel starts its own pool; keep the cores for it
    out = tmp_path_factory.mktemp("site")
    notebooks = {}
    for path in NOTEBOOKS:
        cwd = out / "run" / path.stem  # notebook 05 writes checkpoints beside itself
        cwd.mkdir(parents=True)
        for beside in path.parent.glob("*.py"):  # the files beside it (06 imports one)
            shutil.copy(beside, cwd)
        notebooks[path.name] = execute(path, cwd)
    cache = _cache(notebooks, out / "jupyter_cache")
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
            "nb_execution_mode=cache",
            "-D",
            f"nb_execution_cache_path={cache}",
            str(ROOT / "docs"),
            str(out / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return Site(
        out / "html",
        build,
        time.monotonic() - start,
        notebooks,
    )


def test_site_builds_with_notebooks_executed(site):
    total = sum(run.seconds + run.solve_seconds for run in site.notebooks.values())
    print(f"notebooks executed and solved in {total:.0f} s; docs built in {site.seconds:.0f} s")
    assert site.build.returncode == 0, (
        f"sphinx failed:\n{site.build.stdout[-6000:]}\n{site.build.stderr[-6000:]}"
    )
    # every page took its notebook from the cache: none was executed a second time
    log = site.build.stdout + site.build.stderr
    assert "Executing notebook" not in log, log[-3000:]
    assert len(re.findall(r"Using cached notebook", log)) == len(NOTEBOOKS), log[-3000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, site):
    run = site.notebooks[path.name]
    print(
        f"{path.name} ran in {run.seconds:.0f} s, its solution and checks in "
        f"{run.solve_seconds:.1f} s"
    )
    assert run.error is None, f"{path.name} raised:\n{run.error}"
    nb = run.shipped
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, f"{path.name} raised:\n" + "\n".join(
        "\n".join(o.get("traceback", [])) for o in errors
    )
    text = "".join(o.get("text", "") for o in outputs)
    assert "largest parameter difference" in text  # each notebook checks against a reference
    # the magic's summary line of each run shows its projection on --instance or says why
    # none came: a line still estimating is redrawn when the figure comes, so only the last
    # run's may be (the notebook ended before its figure did); notebook 02 trains through
    # sagenb.train alone, and has none
    plain = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)
    lines = re.findall(r"^(.*projected on.*)\n(?:result in|what was done is in) `", plain, re.M)
    assert not [line for line in lines[:-1] if ": estimating" in line], lines
    # the finished dashboard is a static copy, for viewers without a kernel or network, and
    # the saved notebook stays small: at most ~300 KB per dashboard (issue 17)
    boards = [o for o in outputs if "smp-static-copy" in o.get("data", {}).get("text/html", "")]
    assert boards, "no finished dashboard's static copy"
    size = len(nbformat.writes(nb).encode())
    print(f"{path.name} saved: {size / 1e3:.0f} KB, {len(boards)} dashboard(s)")
    assert size <= 300_000 * len(boards), f"{size / 1e3:.0f} KB for {len(boards)} dashboards"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_prose_quotes_only_what_the_cells_printed(path, site):
    """Every figure the markdown quotes is one a cell of the notebook printed or wrote in its
    source, in this run (tests/prose.py): a text that quotes a figure measured on this machine
    fails on the next run that measures another, so the prose refers to such figures instead."""
    wrong = contradictions(site.notebooks[path.name].shipped)
    assert not wrong, "quoted in the prose, printed by no cell:\n" + "\n".join(
        f"  markdown cell {q.cell}: {q.text!r} in '...{q.context}...'" for q in wrong
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_ends_with_exercises_left_blank(path, site):
    """2 to 4 exercises, each an answer cell left blank and a check cell, after the notebook's
    last run; as shipped (and on the site) every check says "not answered yet"."""
    nb = site.notebooks[path.name].shipped
    answers, checks = _cells(nb, ANSWER), _cells(nb, CHECK)
    assert 2 <= len(checks) <= 4 and len(answers) == len(checks), (len(answers), len(checks))
    for answer in answers:
        names = re.findall(r"^(answer_\d+)\s*=\s*None\b", answer.source, re.M)
        assert names, f"an answer cell that is not left blank:\n{answer.source}"
    for number, check in enumerate(checks, start=1):
        assert _text(check).strip() == f"Exercise {number}: {NOT_ANSWERED}", _text(check)
    # the exercises close the notebook: after the first of their cells come only theirs (at
    # most one extra short run, tagged exercise-run) and the cell that stops the pool
    code = [c for c in nb.cells if c.cell_type == "code"]
    start = min(code.index(c) for c in answers + checks + _cells(nb, RUN))
    tags = [set(c.metadata.get("tags", [])) & {ANSWER, CHECK, RUN} for c in code[start:-1]]
    assert all(tags), [c.source[:60] for c in code[start:-1]]
    assert len(_cells(nb, RUN)) <= 1, "at most one extra run for the exercises"
    assert code[-1].source.strip() == "%smp_cluster stop"  # the notebook still tidies up


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_exercises_are_solvable(path, site):
    """notebooks/solutions/<notebook>.py, run in the notebook's kernel after it ran, answers
    every exercise, and each check then passes on the runs the notebook made."""
    run = site.notebooks[path.name]
    assert run.error is None, f"{path.name} raised before its exercises:\n{run.error}"
    assert run.graded, f"{path.name}: no exercise was graded"
    for number, text in enumerate(run.graded, start=1):
        print(text.strip().splitlines()[0] if text.strip() else "(nothing printed)")
        assert text.strip().startswith(f"Exercise {number}: correct"), text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_exercises_reject_tampered_answers(path, site):
    """After the solution passed, each check rejects what a student might try instead of
    solving it (tests/tamper.py): the solution scaled, negated, inverted or off by one, the
    other options, the numbers its feedback on a wrong answer shows, and the answer of
    another student whose drawn figures differ (issue 55)."""
    run = site.notebooks[path.name]
    assert run.error is None, f"{path.name} raised before its exercises:\n{run.error}"
    assert run.tampered is not None, f"{path.name}: the tampered answers were not graded"
    assert run.tampered == [], f"{path.name}: accepted {run.tampered}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_page_shows_outputs(path, site):
    """The notebook's page shows what the run printed and the dashboard's static copy (an
    inline SVG), without the widget state (MBs per dashboard) that only a kernel could use,
    and the exercises as shipped: no solution on the page."""
    page = site.html / "notebooks" / f"{path.stem}.html"
    assert page.exists(), f"no page for {path.name}: is it in docs/index.md's toctree?"
    html = page.read_text()
    assert "largest parameter difference" in html
    assert "smp-static-copy" in html, "the dashboard's static copy is missing"
    assert "application/vnd.jupyter.widget-state+json" not in html
    assert len(html) < 2_000_000, f"{page.name} is {len(html) / 1e6:.1f} MB"
    assert NOT_ANSWERED in html and ": correct" not in html
