"""The pictures the docs show, each taken by one test from today's drawing code (issue 34).

A test that takes a picture writes it to `shot(name)` (artifacts/browser/, so a test run leaves
the checkout clean) and then calls `keep(name, request)`. With SAGENB_REFRESH_SCREENSHOTS=1 the
picture is copied to docs/ and docs/pictures.json records the test that took it and a hash of
the code that draws it (sagenb/display/). tests/test_pictures.py fails when a picture the
README or docs/ show has no such record, names a test that no longer exists, or was drawn by
other code than today's: refresh it with

    SAGENB_REFRESH_SCREENSHOTS=1 .venv/bin/python -m pytest tests/test_browser.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ARTIFACTS = ROOT / "artifacts" / "browser"
MANIFEST = DOCS / "pictures.json"
#: what draws every picture the docs show: the dashboard, its charts and their SVG
DRAWING_CODE = ROOT / "sagenb" / "display"
REFRESH = os.environ.get("SAGENB_REFRESH_SCREENSHOTS") == "1"


def drawing_hash() -> str:
    """A hash of the drawing code's source, file by file (renaming the folder keeps it)."""
    digest = hashlib.sha256()
    for path in sorted(DRAWING_CODE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def manifest() -> dict[str, dict[str, str]]:
    return json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}


def shot(name: str) -> Path:
    """Where a test writes picture `name`."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def keep(name: str, request) -> None:
    """With SAGENB_REFRESH_SCREENSHOTS=1: picture `name`, just taken by the test of `request`,
    becomes docs/`name`, recorded with that test and today's drawing code."""
    if not REFRESH:
        return
    shutil.copyfile(shot(name), DOCS / name)
    entries = manifest()
    entries[name] = {"test": request.node.nodeid.split("[")[0], "drawn_by": drawing_hash()}
    MANIFEST.write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")
