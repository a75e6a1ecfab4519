"""The live dashboard in the page: a small anywidget (https://anywidget.dev) that shows the
header and the figure as an inline SVG drawn in Python (svg_figure.Drawing), and takes each
redraw as the header or the panels that changed.

Why not plotly.js (issue 17, measured by benchmarks/dashboard_browser.py in JupyterLab and
Chromium on the training machine): plotly's FigureWidget, and then an anywidget of ours that
loaded plotly.js once per page and sent only new points, cost a run's first draw 0.5-2.5 s of
browser CPU (evaluating the 4.6 MB library, then `newPlot` of six subplots) and each redraw
~150 ms (plotly lays out all six panels again): 7-19% of a 2-core machine's throughput, against
a goal of 2%. Here the browser parses an SVG fragment: the first draw is one `innerHTML`, a
redraw replaces the children of one panel's `<g>`, and the widget's module is a few lines.

- The first draw is the whole SVG (`svg`); each panel is then a trait of its own (`panel_x3y3`
  for the subplot on plotly's axes x3, y3), set only when its drawing changed, so a redraw sends
  only the panels whose data changed, and a page that opens the widget late (a reload, a
  second view) draws its current state. What the page shows is `shown` (tests read it).
- The Stop button (`listen_for_stop`) sits at the header's right; pressed, it says
  "Stopping..." in every view of the widget. The click is heard while the cell still runs
  (ipykernel_private.py); the run stops at its next step boundary (run/training_run.py).
- When the run ends the dashboard replaces the widget with its static copy (the same drawing
  of the finished figure, no button) and closes it: nothing of it stays in a saved notebook.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import anywidget
import traitlets

from sagenb.display import ipykernel_private
from sagenb.display.svg_figure import Drawing

__all__ = ["LiveFigure", "STOP_MESSAGE"]

#: what the page sends when the Stop button is pressed (anywidget's `model.send`)
STOP_MESSAGE = {"event": "stop"}

_ESM = r"""
export default {
  render({ model, el }) {
    const top = document.createElement("div");
    const header = document.createElement("div");
    const stop = document.createElement("button");
    const chart = document.createElement("div");
    top.style.cssText = "display: flex; align-items: flex-start; gap: 8px";
    header.style.flex = "1";
    stop.className = "smp-stop";
    stop.title = "End the run after the step in progress, on every rank: nothing is lost";
    stop.style.cssText = "font: inherit; font-size: 12px; padding: 1px 10px; cursor: pointer; "
      + "color: #b42318; background: #fff; border: 1px solid #d0857d; border-radius: 3px";
    stop.onclick = () => { model.send({ event: "stop" }); showStop(true); };
    top.append(header, stop);
    el.append(top, chart);
    chart.innerHTML = model.get("svg");
    const groups = new Map(
      [...chart.querySelectorAll("g.panel")].map((g) => [g.dataset.axes, g]));
    const showHeader = () => { header.innerHTML = model.get("header"); };
    const showStop = (clicked) => {
      const stopping = clicked === true || model.get("stopping");
      stop.hidden = !model.get("stoppable");
      stop.disabled = stopping;
      stop.textContent = stopping ? "Stopping\u2026" : "\u25A0 Stop";
    };
    const handlers = [["change:header", showHeader]];
    handlers.push(["change:stoppable", showStop], ["change:stopping", showStop]);
    for (const key of model.get("panels")) {
      const draw = () => {
        const content = model.get(`panel_${key}`);
        if (content && groups.has(key)) groups.get(key).innerHTML = content;
      };
      draw();
      handlers.push([`change:panel_${key}`, draw]);
    }
    showHeader();
    showStop();
    for (const [event, handler] of handlers) model.on(event, handler);
    return () => { for (const [event, handler] of handlers) model.off(event, handler); };
  },
};
"""


class LiveFigure(anywidget.AnyWidget):
    """The header and a figure's SVG in the page, redrawn panel by panel."""

    _esm = traitlets.Unicode(_ESM).tag(sync=True)
    header = traitlets.Unicode("").tag(sync=True)  # HTML
    svg = traitlets.Unicode("").tag(sync=True)  # the first draw: the whole figure
    panels = traitlets.List(traitlets.Unicode()).tag(sync=True)  # the panels' axes, in order
    #: the Stop button is shown (the run can hear it: `listen_for_stop`), and has been acted on
    stoppable = traitlets.Bool(False).tag(sync=True)
    stopping = traitlets.Bool(False).tag(sync=True)

    def __init__(self, fig: Any, *, header: str = "") -> None:
        self.drawing = Drawing(fig, css_class="smp-live")
        #: each panel's content as the page shows it
        self.shown = {key: self.drawing.panel(key) for key in self.drawing.panels}
        super().__init__(
            header=header, svg=self.drawing.svg(self.shown), panels=list(self.drawing.panels)
        )
        self.add_traits(
            **{f"panel_{key}": traitlets.Unicode("").tag(sync=True) for key in self.shown}
        )
        self.sent_chars = 0  # what the redraws sent (the benchmark and the tests read it)

    def listen_for_stop(self, clicked: Callable[[], None]) -> bool:
        """Show the Stop button, calling `clicked()` when it is pressed, while the cell runs:
        in ipykernel's shell-channel thread, as the click arrives (ipykernel_private.py says
        how and why), so `clicked` only records it. Without a kernel that can tell (a script,
        a test), no button, and False."""

        def heard(data: Any) -> None:
            if isinstance(data, dict) and data.get("method") == "custom":
                if data.get("content") == STOP_MESSAGE:
                    clicked()

        self.stoppable = ipykernel_private.on_arrival(self.comm, heard)
        return self.stoppable

    def show_header(self, html: str) -> None:
        if html != self.header:
            self.header = html

    def update_traces(
        self,
        data: Mapping[str, Mapping[str, Any]],
        panels: Collection[str] | None = None,
        titles: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Take each named trace's data and the axes' `titles` (by plotly's axis name); redraw
        the panels (all, or those in `panels`, and those whose axis got a new title) and send
        those whose drawing changed. Returns the panels sent."""
        for name, values in data.items():
            self.drawing.update(name, values)
        retitled = self.drawing.retitle(titles or {})
        sent = []
        due = list(self.shown if panels is None else panels)
        for key in due + sorted(retitled - set(due)):
            content = self.drawing.panel(key)
            if content != self.shown[key]:
                self.shown[key] = content
                setattr(self, f"panel_{key}", content)
                self.sent_chars += len(content)
                sent.append(key)
        return sent

    def panel_of(self, trace: str) -> str:
        """The panel (its axes, 'x3y3') that draws the trace of that name."""
        return self.drawing.panel_of(trace)
