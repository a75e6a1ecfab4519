"""Every picture the README and docs/ show is taken by a test from today's drawing code
(tests/pictures.py says how one is taken and refreshed). Pool-free and fast."""

from __future__ import annotations

import ast
import re

from .pictures import DOCS, ROOT, drawing_hash, manifest

SHOWN = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.(?:png|jpe?g|svg))\)")
REFRESH = "SAGENB_REFRESH_SCREENSHOTS=1 .venv/bin/python -m pytest {test}"


def shown() -> dict[str, list[str]]:
    """picture file name in docs/ -> the documents that show it."""
    found: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        if "_build" in doc.parts:
            continue
        for target in SHOWN.findall(doc.read_text()):
            path = (doc.parent / target).resolve()
            assert path.parent == DOCS, f"{doc.name} shows {target}: pictures live in docs/"
            found.setdefault(path.name, []).append(doc.relative_to(ROOT).as_posix())
    return found


def defines(test: str) -> bool:
    """Whether `tests/x.py::test_name` names a test function that exists."""
    file, _, name = test.partition("::")
    path = ROOT / file
    if not path.exists():
        return False
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_picture_shown_is_taken_by_a_test_from_todays_code():
    entries, today = manifest(), drawing_hash()
    problems = []
    for name, docs in sorted(shown().items()):
        entry = entries.get(name)
        if entry is None:
            problems.append(f"docs/{name} (shown in {', '.join(docs)}) is taken by no test")
        elif not defines(entry["test"]):
            problems.append(f"docs/{name} was taken by {entry['test']}, which no longer exists")
        elif entry["drawn_by"] != today:
            problems.append(
                f"docs/{name} was drawn by other code than today's sagenb/display/: "
                + REFRESH.format(test=entry["test"])
            )
    assert problems == []


def test_no_picture_is_left_unshown():
    pictures = {p.name for p in DOCS.iterdir() if p.suffix in (".png", ".jpg", ".jpeg")}
    assert sorted(pictures - set(shown())) == []
    assert sorted(set(manifest()) - set(shown())) == []


def test_the_check_reads_links_and_sees_a_stale_picture(tmp_path):
    doc = "A ![the dashboard](dashboard.png) and ![x](../docs/other.png) and [a link](x.md)"
    assert SHOWN.findall(doc) == ["dashboard.png", "../docs/other.png"]
    assert defines("tests/test_pictures.py::test_no_picture_is_left_unshown")
    assert not defines("tests/test_pictures.py::test_that_is_gone")
    assert len(drawing_hash()) == 16 and drawing_hash() == drawing_hash()
