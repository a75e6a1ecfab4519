"""What the live dashboard costs the page, by what each update changes: no training, one page.

    .venv/bin/python benchmarks/dashboard_page.py [--rounds 2] [--seconds 30]
        [--out benchmarks/results]

A notebook in a real JupyterLab, open in headless Chromium (tests/lab.py), trains the peers'
job once (1,100 steps, no dashboard) and then replays its metrics into live dashboards, each
for the same seconds at the same pace, as the session feeds them (log, then tick every
0.05 s), with the page's module of the widget varied (after a short live dashboard, not
counted, which takes the kernel's one-time imports):

- `shipped`: sagenb's live dashboard as it is, with its Stop button (a run to stop);
- `no Stop button`: the same, for a dashboard with no run to stop (what the button costs);
- `messages only`: the same messages reach the page, which changes nothing on screen;
- `header only` / `panels only`: the page redraws only the header, or only the panels;

and, as the baseline, `idle`: the kernel sleeps for the same seconds, no dashboard. Per variant
(medians over rounds, the order alternating): CPU per second of the kernel, the Jupyter server
and the browser's processes (psutil), and of the page's main thread (Chromium's
Performance.getMetrics TaskDuration, and its layout and style parts). With no engines running,
these are the dashboard's costs alone; dashboard_browser.py measures what they take from
training. Needs Debian's chromium (scripts/test.sh installs it).

Writes dashboard_page.md and dashboard_page.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(ROOT))

from workload import BATCH, CELL  # noqa: E402

from sagenb.display.live_figure import _ESM  # noqa: E402
from tests.lab import (  # noqa: E402
    CHROMIUM,
    KERNEL_READY,
    OUTPUTS,
    chromium_page,
    code_notebook,
    jupyterlab,
    run_all,
    tree,
    wait_for,
)

SAMPLE_S = 0.2
HEADER = 'const handlers = [["change:header", showHeader]];'
PANEL = "if (content && groups.has(key)) groups.get(key).innerHTML = content;"


def _without(esm: str, old: str, new: str) -> str:
    assert old in esm, f"live_figure's module no longer has {old!r}: update this benchmark"
    return esm.replace(old, new)


VARIANTS = {
    "shipped": _ESM,
    "no Stop button": _ESM,  # the same module; the dashboard is given no on_stop
    "messages only": _without(
        _without(_ESM, HEADER, "const handlers = [];"), PANEL, "/* nothing drawn */"
    ),
    "header only": _without(_ESM, PANEL, "/* nothing drawn */"),
    "panels only": _without(_ESM, HEADER, "const handlers = [];"),
}


def notebook(rounds: int, seconds: float) -> dict:
    names = ["idle", *VARIANTS]
    setup = f"""import json, time, traitlets
import sagenb, sagenb.display.dashboard as D, sagenb.display.live_figure as LF
from sagenb.sizing.cost import meter_for
from IPython.display import clear_output
ESMS = {VARIANTS!r}
sagenb.start_pool(2)
res = sagenb.train({CELL!r}, batch_size={BATCH}, steps=1100, epochs=1100, engines=2,
                   dashboard=False)
sagenb.stop_pool()
clear_output()"""
    loop = f"""shipped, marks, asked = D.LiveFigure, [], []
def replay(name, seconds):
    started = time.time()
    if name == "idle":
        time.sleep(seconds)
    else:
        esm = traitlets.Unicode(ESMS[name]).tag(sync=True)
        D.LiveFigure = type("Variant", (shipped,), {{"_esm": esm}})
        on_stop = None if name == "no Stop button" else asked.append  # never pressed here
        board = D.Dashboard(res.config, meter_for(res.config, 2), live=True, on_stop=on_stop)
        assert board._figure_widget.stoppable == (on_stop is not None)
        n, i, t0 = len(res.metrics), 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            while i < n * elapsed / seconds:
                rec = res.metrics[i]
                board.log(rec.values, rec.step, rec.rank)
                i += 1
            board.tick(elapsed)
            time.sleep(0.05)
        board.finish(seconds, status="done")
        D.LiveFigure = shipped
    marks.append((name, started, time.time()))
    clear_output()
replay("shipped", 3)  # warm-up, not counted: the first dashboard's imports (~1 s of CPU)
marks.clear()
for round_ in range({rounds}):
    for name in {names!r}[:: 1 if round_ % 2 == 0 else -1]:
        replay(name, {seconds})
print("MARKS " + json.dumps(marks))"""
    return code_notebook(setup, loop)


def _cpu(procs: list[psutil.Process], seen: dict[int, float]) -> float:
    for p in procs:
        try:
            t = p.cpu_times()
            seen[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return sum(seen.get(p.pid, 0.0) for p in procs)


def measure(rounds: int, seconds: float) -> list[dict]:
    samples: list[tuple[float, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root, home = work / "notebooks", work / "home"
        root.mkdir()
        home.mkdir()
        (root / "page.ipynb").write_text(json.dumps(notebook(rounds, seconds)))
        with jupyterlab(root, home, work) as lab, chromium_page(home) as (page, drivers):
            page.goto(lab.url("page.ipynb"))
            wait_for(page, KERNEL_READY, 120, "the notebook's kernel was not connected and idle")
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            seen: dict[int, float] = {}
            run_all(page)
            deadline = time.monotonic() + 300 + rounds * (len(VARIANTS) + 1) * (seconds + 15)
            outputs = ""
            while time.monotonic() < deadline and "MARKS " not in outputs:
                kernels = [p for p in lab.server.children() if "ipykernel" in " ".join(p.cmdline())]
                metrics = {
                    m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]
                }
                samples.append(
                    (
                        time.time(),
                        {
                            "kernel": _cpu(kernels, seen),
                            "server": _cpu([lab.server], seen),
                            "browser": _cpu([p for d in drivers for p in tree(d)], seen),
                            "page main thread": metrics["TaskDuration"],
                            "page layout + style": metrics["LayoutDuration"]
                            + metrics["RecalcStyleDuration"],
                        },
                    )
                )
                outputs = page.evaluate(OUTPUTS)
                time.sleep(SAMPLE_S)
    line = next(x for x in outputs.splitlines() if x.startswith("MARKS "))

    def at(key: str, t: float) -> float:
        return next((s[key] for when, s in samples if when >= t), samples[-1][1][key])

    return [
        {
            "variant": name,
            **{key: (at(key, end) - at(key, start)) / (end - start) * 1e3 for key in samples[0][1]},
        }
        for name, start, end in json.loads(line[6:])
    ]


def summarise(runs: list[dict]) -> list[dict]:
    keys = [k for k in runs[0] if k != "variant"]
    rows = []
    for name in ["idle", *VARIANTS]:
        mine = [r for r in runs if r["variant"] == name]
        rows.append({"variant": name, **{k: statistics.median(r[k] for r in mine) for k in keys}})
    return rows


def markdown(rows: list[dict], rounds: int, seconds: float) -> str:
    keys = [k for k in rows[0] if k != "variant"]
    out = [
        "# What the live dashboard costs the page, by what each update changes",
        "",
        f"CPU ms per second (medians of {rounds} rounds of {seconds:.0f} s), a 1,100-step run's "
        "metrics replayed into a live dashboard in JupyterLab and headless Chromium, no training",
        "",
        "| variant | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for r in rows:
        out.append(f"| {r['variant']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not os.access(CHROMIUM, os.X_OK):
        sys.exit(f"needs Debian's chromium at {CHROMIUM} (scripts/test.sh installs it)")
    runs = measure(args.rounds, args.seconds)
    rows = summarise(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dashboard_page.json").write_text(json.dumps({"summary": rows, "runs": runs}, indent=1))
    (out / "dashboard_page.md").write_text(markdown(rows, args.rounds, args.seconds))
    print(markdown(rows, args.rounds, args.seconds))


if __name__ == "__main__":
    main()
