"""The documentation: every relative link in README.md and docs/*.md resolves (to a file, and to
a heading where it names one), and the Sphinx site builds with warnings as errors.

GitHub renders the Markdown pages as they are, so a link must work there (a path relative to
the page, a heading slug as GitHub makes it); the Sphinx build (MyST) resolves the same links
between pages, and turns a broken one into a warning, which -W makes an error.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without code blocks and code spans, where a `[x](y)` is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation other than
    '-' and '_' removed, spaces to '-' (as github-slugger does)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {github_slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_pages_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "index.md", "flags.md", "architecture.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.name}")
        elif ROOT not in dest.parents:
            broken.append(f"{target}: points outside the repository")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_readme_is_short():
    """The README says what sagenb is and how to start; the depth lives in docs/."""
    assert len((ROOT / "README.md").read_bytes()) <= 12_500


def test_sphinx_builds_without_warnings(tmp_path):
    """`python -m sphinx -W`: a broken link between pages, a bad heading level or a page missing
    from the table of contents fails the build. Needs the docs extra (scripts/setup.sh installs
    it: pip install -e '.[docs]'). The notebooks' pages are built without running them here
    (seconds, no engines); tests/test_notebooks.py builds the site with them executed."""
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-D",
            "nb_execution_mode=off",
            str(ROOT / "docs"),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"sphinx failed:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "html" / "index.html").exists()
    assert time.monotonic() - start < 60, "the docs build should take seconds, not minutes"


def test_the_flag_reference_is_generated_from_the_config():
    """docs/flags.md holds exactly the tables sagenb.config.flag_reference() writes from the
    fields (regenerate: replace the tables with its output), and so documents every flag the
    magic takes, in the config's sections."""
    from sagenb.config import flag_reference
    from sagenb.notebook.magics import train_parser

    page = (ROOT / "docs" / "flags.md").read_text()
    reference = flag_reference()
    assert reference in page, "docs/flags.md is out of date: paste flag_reference()'s output"
    rows = [line for line in page.splitlines() if line.startswith("|")]
    assert rows == [line for line in reference.splitlines() if line.startswith("|")]
    for action in train_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}`" in reference, flag


# -- docs/architecture.md names every module ---------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
SAGENB = ROOT / "sagenb"
#: a row of the page's "Every module" tables: | `pool/startup.py` | its role |
MODULE_ROW = re.compile(r"^\| `([\w/]+\.py)` \| (.+?) \|$", re.M)


def named_modules(page: str) -> dict[str, str]:
    """{path from sagenb/: role} for each row of the page's "## Every module" section."""
    section = page.partition("\n## Every module\n")[2].partition("\n## ")[0]
    return dict(MODULE_ROW.findall(section))


def test_the_checker_reads_a_module_row():
    page = "x\n## Every module\n\n| module | role |\n|---|---|\n| `pool/a.py` | does a |\n\n## Next"
    assert named_modules(page) == {"pool/a.py": "does a"}
    assert named_modules(page.replace("## Every module", "## Other")) == {}


def test_the_architecture_page_names_every_module_with_its_role():
    """A module added, moved or removed without the page following fails here: an unnamed
    module is one nobody knows where to find (STYLE.md)."""
    modules = {p.relative_to(SAGENB).as_posix() for p in SAGENB.rglob("*.py")}
    named = named_modules(ARCHITECTURE.read_text())
    assert sorted(modules - set(named)) == [], "name these in docs/architecture.md"
    assert sorted(set(named) - modules) == [], "docs/architecture.md names modules that are gone"
    assert [path for path, role in named.items() if not role.strip()] == []


def test_the_data_flow_line_names_the_run_the_projection_and_the_event_log():
    flow = ARCHITECTURE.read_text().split("\n\n")[2]  # the indented block under "Data flows"
    assert all(word in flow for word in ("run", "projection", "event log", "pool", "engine"))
