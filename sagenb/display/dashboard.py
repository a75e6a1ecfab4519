"""The live dashboard under a `%%smp_train` cell: loss, throughput, memory per engine, step
time and pipeline bubble, the pipeline schedule (or the learning rate, and the gradient norm
with --clip-grad-norm), and what the run costs.

A metric sink. In a Jupyter kernel it shows one small widget (live_figure.LiveFigure): the
header (status, progress, layout, time left, cost) and the figure as an inline SVG drawn in
Python from the chart spec (charts.py, svg_figure.py). The header and the loss panel are
redrawn every second (REDRAW_S, 0.9 s); the other panels every 2 s at first, then less often,
every FIGURE_MAX_S from a quarter of a minute on (`figure_period`); each redraw is one message that
holds only the panels whose drawing changed. Given the run's `on_stop`, the header has a Stop
button: pressed, the run ends at its next step boundary on every rank, "stopped", heard while
the cell is still busy following the run. When the run ends, a static copy (the same header and
drawing, no button) replaces the live widget in the same output: what a saved notebook holds, shown
offline and without a kernel. Anywhere else (a script, a test) it only records, and
`save_html` writes the figure, interactive (plotly.js inline), to one self-contained file. This
module, charts.py and svg_figure.py own plotly and the drawing; nothing on the engine side
imports them.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from sagenb.config.options import TrainConfig, describe
from sagenb.display import charts, svg_figure
from sagenb.display.live_figure import LiveFigure
from sagenb.display.step_columns import StepColumns
from sagenb.metrics import keys
from sagenb.metrics.stream import History
from sagenb.sizing.cost import CostMeter

__all__ = ["Dashboard", "layout_text", "figure_period", "STOP_BUTTON"]

#: who stopped a run whose Stop button was pressed, as the header and `stopped_by` say it
STOP_BUTTON = "the dashboard's Stop button"

#: the header and the loss panel are redrawn this often, together: at least once a second,
#: as the session's polling (session.POLL_S) adds up to 0.05 s. What costs the page is
#: rendering a change in JupyterLab, about the same for the header alone, a panel alone or
#: both, so one message carries both (benchmarks/dashboard_page.py)
REDRAW_S = 0.9
#: the other panels: every FIGURE_MIN_S at first, elapsed / FIGURE_SLOWDOWN, every FIGURE_MAX_S
#: at most. Redrawing all six panels costs the page ~20 ms more than the loss alone; a 30 s
#: run redraws them 7 times (11 with every 0.9 s for the first 6 s, then elapsed / 6)
FIGURE_MIN_S, FIGURE_MAX_S, FIGURE_SLOWDOWN = 2.0, 5.0, 3.0


def figure_period(elapsed: float) -> float:
    """Seconds between redraws of the panels other than the loss `elapsed` seconds into a
    run: every 2 s for the first 6 s, then elapsed / 3, every 5 s from 15 s on. Memory, step
    time and cost change slowly; the loss panel (charts.Panel.every_second) is redrawn every
    second throughout (benchmarks/dashboard_browser.py measures what it costs)."""
    return min(FIGURE_MAX_S, max(FIGURE_MIN_S, elapsed / FIGURE_SLOWDOWN))


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def layout_text(config: TrainConfig) -> str:
    """'model: 2 partitions x 1 replica, 1f1b, 4 microbatches' and the like, with the memory
    savers in use ('sharded (ZeRO-3) on 2 engines, bf16, activation checkpointing')."""
    text = describe(config.strategy).layout(config, config.engines or 1)
    if config.precision != "fp32":
        text += f", {config.precision}"
    if config.activation_checkpointing:
        text += ", activation checkpointing"
    if config.offload_activations:
        text += ", activations offloaded to the host"
    return text


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 1:  # a run that failed at once does not read "0 s"
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Dashboard:
    """Records every step of every rank; draws live in a notebook, saves as HTML anywhere."""

    def __init__(
        self,
        config: TrainConfig,
        cost: CostMeter,
        *,
        history: History | None = None,
        live: bool | None = None,
        on_stop: Callable[[str], None] | None = None,
    ) -> None:
        """`on_stop(who)`: asks the run to stop at its next step boundary; with it, the live
        dashboard has a Stop button (where the kernel can hear it while the cell runs)."""
        self.config, self.cost = config, cost
        self.engines = config.engines or 1
        # The session's history is a sink logged before this one: share it rather than
        # aggregate every record a second time. Standalone, the dashboard keeps its own.
        self._owns_history = history is None
        self.history = History(self.engines, config.batch_size) if history is None else history
        #: the rows of the run's earlier segments (--continue): this one's progress and time
        #: left count from there; `segments` (each segment's first step) marks the loss
        self._rows_before = len(self.history.steps)
        self.segments: list[int] = []
        self._columns = StepColumns(config.replicas(self.engines))
        self.memory: dict[int, Mapping[str, Any]] = {}
        self.timelines: dict[int, tuple[float, list]] = {}  # rank -> (t0, events), last step
        self.cost_points: list[tuple[float, float]] = []
        self.total_steps: int | None = None
        self.rate_key = keys.THROUGHPUT
        self.status, self.elapsed = "starting", 0.0
        self.on_stop = on_stop
        self.stopped_by: str | None = None  # who ended the run early, once it has ended
        self._clicked = threading.Event()  # set from ipykernel's shell-channel thread
        self.stop_asked = False  # the click passed on to the run (`tick`)
        self.warnings: list[str] = []  # why the run cannot equal one process's (equivalence.py)
        self._logged = 0  # records logged; a redraw with nothing new draws nothing
        self._drawn = {"all": 0, "every second": 0}  # _logged at each kind's last redraw
        self._last_draw = self._last_redraw = 0.0
        self.redraws = 0
        self._figure_widget: LiveFigure | None = None
        self._display = None
        self._static_svg: str | None = None  # the finished run's figure, once left static
        if live if live is not None else _in_kernel():
            self._show()

    # -- sink interface -------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int, rank: int) -> None:
        self.status = "training"
        self.total_steps = metrics.get(keys.TOTAL_STEPS, self.total_steps)
        if self._owns_history:
            self.history.log(metrics, step, rank)
        self.memory[rank] = metrics
        self.warnings += [w for w in metrics.get(keys.WARNINGS, ()) if w not in self.warnings]
        if keys.TIMELINE in metrics:
            self.timelines[rank] = (metrics[keys.TIMELINE_T0], metrics[keys.TIMELINE])
        if keys.TOKENS in metrics:  # token-id inputs: the history has tokens/s
            self.rate_key = keys.TOKEN_THROUGHPUT
        self._logged += 1

    def tick(self, elapsed: float) -> None:
        """Called by the session while it waits: every REDRAW_S the header and the loss, and
        the other panels when their period (`figure_period`) is due, in one message. A click
        of the Stop button since the last tick is passed on to the run first."""
        self.elapsed = elapsed
        if self._clicked.is_set() and not self.stop_asked:
            self._ask_stop()
        now = time.monotonic()
        if now - self._last_redraw < REDRAW_S:
            return
        self._last_redraw = now
        self.cost_points.append((elapsed, self.cost.cost(elapsed)))
        every_second = now - self._last_draw < figure_period(elapsed)
        # the period counts from the last redraw that drew something: the first metrics are
        # drawn in full when they come, not a period after an empty redraw
        if self._redraw(every_second=every_second) and not every_second:
            self._last_draw = now

    def stop_clicked(self) -> None:
        """The Stop button's handler: the click is recorded, from whichever thread hears it
        (ipykernel's shell-channel thread, live_figure.listen_for_stop), and the session's
        next `tick` asks the run to stop, from the thread that follows the run."""
        self._clicked.set()

    def _ask_stop(self) -> None:
        self.stop_asked = True
        if self.on_stop is not None:
            self.on_stop(STOP_BUTTON)
        if self._figure_widget is not None:
            self._figure_widget.stopping = True  # every view of it says "Stopping..."
        self._redraw_header()

    def finish(self, elapsed: float, *, status: str, stopped_by: str | None = None) -> None:
        """The run ended: "done", "failed", "stopped" (at a step boundary, by the Stop
        button) or "interrupted" (by the kernel's interrupt, or at a step boundary: a
        non-finite loss with --stop-on-nonfinite); the header says which and, for a run that
        ended early, at which step and `stopped_by` whom."""
        self.elapsed, self.status, self.stopped_by = elapsed, status, stopped_by
        self.cost_points.append((elapsed, self.cost.cost(elapsed)))
        self._logged += 1
        if self._figure_widget is not None:
            self._figure_widget.stoppable = False  # nothing left to stop
        self._redraw()
        self._leave_static_copy()

    def close(self) -> None:
        pass

    # -- what is drawn --------------------------------------------------------------------
    def columns(self) -> StepColumns:
        """The lines derived from every step (smoothed loss and throughput, each replica's
        loss, the step time's split, eval points), taking only the rows that came since the
        last redraw: a redraw costs the same at step 100 and at step 100,000."""
        return self._columns.update(self.history.steps, self.rate_key, self.total_steps)

    def progress(self) -> tuple[int, int]:
        """(steps done in this run, steps this run has to do). A resumed run starts after
        its checkpoint's step, so its first row is not step 1."""
        rows, first = self.history.steps, self._rows_before
        done = len(rows) - first
        before = rows[first][keys.STEP] - 1 if done > 0 else 0
        return done, (self.total_steps or 0) - before

    def projected_cost(self) -> float:
        done, todo = self.progress()
        if todo <= 0 or not done:
            return self.cost.cost(self.elapsed)
        return self.cost.projected(self.elapsed, done, todo)

    def header_text(self) -> str:
        rows, total = self.history.steps, self.total_steps
        step = rows[-1][keys.STEP] if rows else 0
        epoch = rows[-1][keys.EPOCH] + 1 if rows else 0
        done, todo = self.progress()
        left = ""
        if total and done and self.status == "training":
            left = f", ~{_duration(self.elapsed * (todo - done) / done)} left"
        return (
            f"{self._status_text(step)} | {layout_text(self.config)} | step {step}/"
            f"{total or '?'}, epoch {epoch}/{self.config.epochs} | {_duration(self.elapsed)} "
            f"elapsed{left} | "
            f"{self._cost_text()}"
        )

    def _status_text(self, step: int) -> str:
        """ "training", "done", ...; "stopped at step 37 of 200 by the dashboard's Stop
        button" for a run that ended early; "stopping" once the Stop button is passed on."""
        if self.stopped_by is not None:
            return f"{self.status} at step {step} of {self.total_steps or '?'} by {self.stopped_by}"
        if self.stop_asked and self.status == "training":
            return f"stopping at the next step boundary ({STOP_BUTTON})"
        return self.status

    def _cost_text(self) -> str:
        """ "this run" (measured; priced only on the instance's kind of hardware) and
        "projected on I" (the estimate's step time x this run's steps), kept apart (issue 16:
        CPU seconds are not accelerator seconds)."""
        done, todo = self.progress()
        measured = self.cost.this_run(self.elapsed)
        if self.cost.billed_here:
            projected = self.projected_cost()
            measured = (
                f"this run: ${self.cost.cost(self.elapsed):.4f} so far, ${projected:.4f} at "
                f"completion (spot ${self.cost.spot(projected):.4f}) on {self.cost.instances} "
                f"x {self.cost.price.name}, price as of {self.cost.price.as_of}"
            )
        return f"{measured} | {self.cost.projected_on(todo, done)}"

    def to_figure(self, *, header: bool = True) -> go.Figure:
        """The dashboard as a plotly figure; `header=False`: without the header as its title
        (the notebook's live and static dashboards show it as HTML above the figure)."""
        return charts.figure(self, header=header)

    def save_html(self, path: str | Path) -> Path:
        """One self-contained file (plotly.js inline), viewable without a kernel or network."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.to_figure().write_html(path, include_plotlyjs=True, full_html=True)
        return path

    # -- live display ---------------------------------------------------------------------
    def _header_html(self) -> str:
        rows, total = self.history.steps, self.total_steps
        done = rows[-1][keys.STEP] if rows else 0
        # a stream of unknown length: an indeterminate bar (no value), and "step N/?" above it
        value = f"value='{done}' max='{total}' " if total else ""
        return (
            f"<div class='smp-header'><b>sagenb</b> &middot; "
            f"{html.escape(self.header_text())}<br><progress {value}"
            f"style='width: 100%'></progress>{self._warnings_html()}</div>"
        )

    def _warnings_html(self) -> str:
        return "".join(
            f"<div style='color: #9a5b00'>&#9888; {html.escape(w)}</div>" for w in self.warnings
        )

    def _show(self) -> None:
        from IPython.display import display

        fig = self.to_figure(header=False)  # the header is HTML above it
        self._figure_widget = widget = LiveFigure(fig, header=self._header_html())
        if self.on_stop is not None:
            widget.listen_for_stop(self.stop_clicked)
        widget.add_class("smp-dashboard")
        widget.add_class("tex2jax_ignore")  # JupyterLab would typeset "$0.03 so far, $0.09"
        self._display = display(widget, display_id=True)

    def _redraw_header(self) -> None:
        if self._figure_widget is not None:
            self._figure_widget.show_header(self._header_html())

    def redraw_header(self) -> None:
        """Draw the header again (the run's projection came): in the live dashboard, or in
        the static copy a finished run left in its output."""
        if self._static_svg is not None and self._display is not None:
            bundle = {
                "text/html": self.static_html(self._static_svg),
                "text/plain": self.header_text(),
            }
            self._display.update(bundle, raw=True)
        else:
            self._redraw_header()

    def _redraw(self, every_second: bool = False) -> bool:
        """The header and, when new metrics came, the panels: all, or those drawn every
        second (the loss). Only the panels whose drawing changed travel. Returns whether
        there were new metrics to draw."""
        widget = self._figure_widget
        if widget is None:
            return False
        with widget.hold_sync():  # the header and the panels in one message
            self._redraw_header()
            kind = "every second" if every_second else "all"
            if self._drawn[kind] == self._logged:
                return False
            self._drawn[kind] = self._logged
            shown = charts.panels(self)
            due = [p for p in shown if p.every_second] if every_second else shown
            # each trace by its name (charts keeps it in `meta`), never by position
            # thinned once, to what the drawing shows (not to the saved figure's 2,000 points)
            data = charts.trace_data(self, due, points=svg_figure.MAX_POINTS)
            due_panels = {widget.panel_of(name) for name in data}
            if widget.update_traces(data, due_panels, charts.axis_titles(self)):
                self.redraws += 1
        return True

    def static_html(self, svg: str | None = None) -> str:
        """The dashboard as HTML with no script: the header and the figure as an inline SVG
        (svg_figure), viewable offline, without a kernel, in nbconvert's HTML and on GitHub.
        `svg`: the figure as already drawn (the live widget's drawing of the finished run)."""
        if svg is None:
            svg = svg_figure.to_svg(self.to_figure(header=False))
        return (
            # tex2jax_ignore / mathjax_ignore: JupyterLab typesets "$0.03 so far, $0.09" as TeX
            f"<div class='smp-dashboard smp-static-copy tex2jax_ignore mathjax_ignore'>"
            f"{self._header_html()}{svg}</div>"
        )

    def _leave_static_copy(self) -> None:
        """The finished dashboard replaces the live one in its output: the static copy (a few
        KB to ~150 KB) is what a saved notebook holds, and the widget is closed, so no widget
        state is saved with it (issue 17: plotly's FigureWidget left ~5 MB per dashboard)."""
        if self._display is None or self._figure_widget is None:
            return
        widget = self._figure_widget  # finish() redrew every panel: its drawing is the run's
        svg = self._static_svg = widget.drawing.svg(widget.shown, css_class="smp-static")
        bundle = {"text/html": self.static_html(svg), "text/plain": self.header_text()}
        self._display.update(bundle, raw=True)
        self._figure_widget.close()
