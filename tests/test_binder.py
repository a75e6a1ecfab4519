"""binder/ alone is enough to run the notebooks (issue 18): a fresh virtual environment built
from binder/'s files the way repo2docker builds one (requirements.txt, then postBuild, from the
repository's root: https://repo2docker.readthedocs.io/en/latest/config_files.html) runs
notebook 1 in its own kernel.

Slow (a fresh torch and JupyterLab installed; benchmarks aside, the suite's longest test): marked
`slow`, `-m "not slow"` leaves it out. pip takes the packages where this machine's pip
configuration points (PyPI, or a local mirror of it); torch is pinned as "2.13.0+cpu", a version
only PyTorch's CPU index (or a local copy of that wheel) has, so no CUDA build can stand in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from sagenb.pool import cluster

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"

RUN_NOTEBOOK = """
import sys
import nbformat
from nbclient import NotebookClient

nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=300, kernel_name="python3",
               resources={"metadata": {"path": sys.argv[3]}}).execute()
nbformat.write(nb, sys.argv[2])
"""


def _binder_env() -> dict[str, str]:
    """This process's environment without what points at the suite's own environment (the
    worktree on PYTHONPATH, the outer virtualenv): the new one must stand on its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # PyTorch's index is out of reach on some CI machines (a local copy of the CPU wheel stands
    # in): fail over to the next index at once instead of pip's five retries per package
    env["PIP_RETRIES"] = "0"
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> float:
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    )
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.pool  # the notebook's kernel starts a pool of engines
@pytest.mark.timeout(900)
def test_binder_environment_runs_notebook_1(tmp_path):
    runtime = (BINDER / "runtime.txt").read_text().strip()  # "python-3.11"
    want = runtime.removeprefix("python-")
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != want:
        pytest.skip(f"binder/runtime.txt asks for Python {want}; this is {have}")
    cluster.stop_pool()  # the notebook's kernel starts its own pool; keep the cores for it
    venv, env = tmp_path / "venv", _binder_env()
    python = str(venv / "bin" / "python")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"  # postBuild's `python` is the new one
    times = {"venv": _run([sys.executable, "-m", "venv", str(venv)], env, 120)}
    times["requirements.txt"] = _run(
        # what is under test is that binder/'s files suffice, not the download: pip may take
        # wheels from its cache (scripts/setup.sh filled it), and skips byte-compiling
        [python, "-m", "pip", "install", "--no-compile", "-r", "binder/requirements.txt"],
        env,
        600,
    )
    times["postBuild"] = _run([str(BINDER / "postBuild")], env, 300)
    torch_version = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert torch_version == ["2.13.0+cpu", "None"], torch_version

    executed = tmp_path / "01_quickstart.ipynb"
    work = tmp_path / "work"
    work.mkdir()
    times["notebook 1"] = _run(
        [
            python,
            "-c",
            RUN_NOTEBOOK,
            str(ROOT / "notebooks" / "01_quickstart.ipynb"),
            str(executed),
            str(work),
        ],
        env,
        600,
    )
    print("binder environment:", ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    nb = nbformat.read(executed, as_version=4)
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "largest parameter difference" in text
