"""A real JupyterLab server and a page in headless Debian Chromium, for the browser test and the
browser benchmark (benchmarks/dashboard_browser.py).

Both are context managers that stop what they started, and kill what is left of its process
tree, even when the code inside fails.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

CHROMIUM = "/usr/bin/chromium"
# Debian's chromium, as measured on this project's machines: no sandbox as root, nothing that
# reaches for the network (Playwright's and Chrome's own downloads are unreachable here).
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# The news and update checks would reach for the internet and pop a toast over the notebook.
NO_NEWS = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}
}
SERVER_S = 60  # generous: the machine has 2 cores, shared with whatever else runs

# The notebook's kernel is "idle" for a moment before it is really ready, and Run All clicked
# then never runs: wait on the session itself (window.jupyterapp needs expose_app_in_browser).
KERNEL_READY = """() => {
  const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const context = widget && widget.sessionContext;
  const kernel = context && context.session && context.session.kernel;
  return Boolean(context && context.isReady && kernel && kernel.connectionStatus === 'connected'
                 && kernel.status === 'idle');
}"""
PROMPTS = """() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
  .map(e => e.textContent.trim())"""
OUTPUTS = """() => [...document.querySelectorAll('.jp-OutputArea-output')]
  .map(e => e.textContent).join('\\n')"""
ALL_RAN = f"() => ({PROMPTS})().every(p => /^\\[\\d+\\]:$/.test(p))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(proc: psutil.Process) -> list[psutil.Process]:
    """`proc` and all its descendants, taken while they live (an orphan loses its parent)."""
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_left(procs: list[psutil.Process], *, wait_s: float) -> None:
    """Wait up to `wait_s` for `procs` to exit on their own, then kill what is left."""
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    if alive:
        print(f"killing {len(alive)} processes left after {wait_s} s: {[p.pid for p in alive]}")
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def _wait_for_server(server: subprocess.Popen, status_url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_S
    while True:
        if server.poll() is not None:
            raise AssertionError(f"JupyterLab exited ({server.returncode}):\n{log_tail(log)}")
        try:
            urllib.request.urlopen(status_url, timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"JupyterLab did not answer within {SERVER_S} s:\n{log_tail(log)}"
                ) from None
            time.sleep(0.25)


@dataclass
class Lab:
    port: int
    token: str
    server: psutil.Process

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?token={self.token}"


@contextmanager
def jupyterlab(root: Path, home: Path, work: Path) -> Iterator[Lab]:
    """A JupyterLab server on 127.0.0.1 serving `root`, with HOME at `home`, its settings and
    log in `work`."""
    settings = work / "lab-settings"
    settings.mkdir(exist_ok=True)
    (settings / "overrides.json").write_text(json.dumps(NO_NEWS))
    port, token = free_port(), secrets.token_hex(16)
    args = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
        f"--LabApp.app_settings_dir={settings}",
    ]  # fmt: skip
    if os.geteuid() == 0:
        args.append("--allow-root")  # as root the server refuses to start without it
    log = work / "jupyterlab.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            args, env={**os.environ, "HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT
        )
    proc = psutil.Process(server.pid)
    try:
        _wait_for_server(server, f"http://127.0.0.1:{port}/api/status?token={token}", log)
        yield Lab(port, token, proc)
    finally:
        procs = tree(proc)  # server, kernel, controller, engines
        server.terminate()  # the server shuts its kernel down, and the kernel its engine pool
        kill_left(procs, wait_s=60)


@contextmanager
def chromium_page(home: Path, *, width: int = 1500, height: int = 1200):
    """A page in headless Debian Chromium, driven by Playwright; yields (page, the processes
    of the browser)."""
    from playwright.sync_api import sync_playwright

    before = {p.pid for p in psutil.Process().children()}
    pw = sync_playwright().start()
    # Playwright's driver, a child of this process; Chromium runs under it
    drivers = [p for p in psutil.Process().children() if p.pid not in before]
    browser = None
    try:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_FLAGS, env={**os.environ, "HOME": str(home)}
        )
        yield browser.new_page(viewport={"width": width, "height": height}), drivers
    finally:
        procs = [proc for driver in drivers for proc in tree(driver)]
        try:
            if browser is not None:
                browser.close()
        finally:
            pw.stop()
            kill_left(procs, wait_s=10)


def wait_for(page, script: str, timeout_s: float, what: str) -> None:
    """Wait until `script` is true in the page; on timeout, fail with the notebook's outputs."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(script, timeout=timeout_s * 1000, polling=250)
    except PlaywrightTimeout:
        outputs = page.evaluate(OUTPUTS)[-3000:]
        raise AssertionError(f"{what} within {timeout_s:.0f} s; outputs:\n{outputs}") from None


def run_all(page) -> None:
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def code_notebook(*sources: str) -> dict:
    """A notebook (nbformat 4) of code cells with these sources, for a Python 3 kernel."""
    cells: list[dict[str, object]] = [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": s}
        for s in sources
    ]
    return {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
