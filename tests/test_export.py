"""The saved dashboard renders in a real browser (headless Debian Chromium), every point there."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

import sagenb

from .conftest import REGRESSION_CELL
from .lab import CHROMIUM_FLAGS

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", *CHROMIUM_FLAGS]


@pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it)"
)
def test_saved_dashboard_renders_in_chromium(pool, tmp_path):
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=12)
    page = result.dashboard.save_html(tmp_path / "dashboard.html")
    home = tmp_path / "home"  # Chromium writes ~/.config and ~/.cache
    home.mkdir()
    dom = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={home / 'profile'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HOME": str(home)},
        check=True,
    ).stdout
    assert "js-plotly-plot" in dom
    lines = re.findall(r'class="js-line"[^>]*\sd="([^"]+)"', dom)
    vertices = [len(re.findall(r"[ML]", d)) for d in lines]
    # two replicas' losses and the smoothed loss, one vertex per step, drawn by plotly.js
    assert vertices.count(12) >= 3, vertices
    bars = re.findall(r'<g class="point"', dom)
    assert len(bars) >= 4 * 2  # memory: 4 kinds x 2 engines
