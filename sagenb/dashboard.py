"""The live dashboard under a `%%smp_train` cell: loss, throughput, memory per engine, cost.

A metric sink. In a Jupyter kernel it shows an ipywidgets header above a plotly FigureWidget
and redraws at most every REDRAW_S seconds, so a fast run does not flood the browser; anywhere
else (a script, a test) it only records, and `save_html` writes the same figure to one
self-contained file. This module owns plotly; nothing on the engine side imports it.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sagenb.config import TrainConfig
from sagenb.cost import CostMeter
from sagenb.metrics import History

__all__ = ["Dashboard"]

REDRAW_S = 0.25
MEMORY_KINDS = ("params", "grads", "optimizer", "activations")
MEMORY_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#B279A2")
RANK_COLOURS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fdd0a2", "#c7e9c0", "#dadaeb")


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class Dashboard:
    """Records every step of every rank; draws live in a notebook, saves as HTML anywhere."""

    def __init__(self, config: TrainConfig, cost: CostMeter, *, live: bool | None = None) -> None:
        self.config, self.cost = config, cost
        self.engines = config.engines or 1
        self.history = History(self.engines, config.batch_size)
        self.rank_steps: dict[int, list[tuple[int, float]]] = {r: [] for r in range(self.engines)}
        self.memory: dict[int, Mapping[str, Any]] = {}
        self.cost_points: list[tuple[float, float]] = []
        self.total_steps: int | None = None
        self.status, self.elapsed = "starting", 0.0
        self._dirty, self._last_draw = True, 0.0
        self.redraws = 0
        self._widget = self._figure_widget = self._header = None
        if live if live is not None else _in_kernel():
            self._show()

    # -- sink interface -------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int, rank: int) -> None:
        self.status = "training"
        self.total_steps = metrics.get("total_steps", self.total_steps)
        self.history.log(metrics, step, rank)
        if "loss" in metrics:  # pipelines: only the last stage computes the loss
            self.rank_steps[rank].append((step, metrics["loss"]))
        self.memory[rank] = metrics
        self._dirty = True

    def tick(self, elapsed: float) -> None:
        """Called by the session while it waits; redraws when due."""
        self.elapsed = elapsed
        now = time.monotonic()
        if now - self._last_draw >= REDRAW_S:
            self.cost_points.append((elapsed, self.cost.cost(elapsed)))
            self._redraw()
            self._last_draw = now

    def finish(self, elapsed: float, *, failed: bool) -> None:
        self.elapsed, self.status = elapsed, "failed" if failed else "done"
        self.cost_points.append((elapsed, self.cost.cost(elapsed)))
        self._dirty = True
        self._redraw()

    def close(self) -> None:
        pass

    # -- what is drawn --------------------------------------------------------------------
    def header_text(self) -> str:
        done = len(self.history.steps)
        total = self.total_steps or "?"
        rows = self.history.steps
        epoch = rows[-1]["epoch"] + 1 if rows else 0
        projected = (
            self.cost.projected(self.elapsed, done, self.total_steps) if self.total_steps else 0.0
        )
        return (
            f"{self.status} | {self.config.strategy} parallel on {self.engines} engines | "
            f"step {done}/{total}, epoch {epoch}/{self.config.epochs} | "
            f"{self.elapsed:.1f} s | est. ${self.cost.cost(self.elapsed):.4f} so far, "
            f"${projected:.4f} at completion on {self.cost.instances} x {self.cost.price.name} "
            f"(price as of {self.cost.price.as_of})"
        )

    def _traces(self) -> list[dict[str, Any]]:
        """(x, y) of every trace, in the fixed order the figure was built with."""
        rows = self.history.steps
        traces = [
            {"x": [s for s, _ in pts], "y": [v for _, v in pts]} for pts in self.rank_steps.values()
        ]
        traces.append({"x": [r["step"] for r in rows], "y": [r["loss"] for r in rows]})
        evals = [r for r in rows if "eval_loss" in r]
        traces.append({"x": [r["step"] for r in evals], "y": [r["eval_loss"] for r in evals]})
        traces.append(
            {"x": [r["step"] for r in rows], "y": [r["throughput(samples/s)"] for r in rows]}
        )
        ranks = [f"rank {r}" for r in range(self.engines)]
        for kind in MEMORY_KINDS:
            key = f"memory/{kind}(MiB)"
            traces.append(
                {
                    "x": ranks,
                    "y": [self.memory.get(r, {}).get(key, 0.0) for r in range(self.engines)],
                }
            )
        traces.append(
            {"x": [t for t, _ in self.cost_points], "y": [c for _, c in self.cost_points]}
        )
        return traces

    def to_figure(self) -> go.Figure:
        fig = make_subplots(
            rows=2,
            cols=2,
            subplot_titles=(
                "Loss (each rank, and the global batch)",
                "Throughput",
                "Memory per engine (last step)",
                f"Estimated cost on {self.cost.price.name}",
            ),
            vertical_spacing=0.16,
            horizontal_spacing=0.1,
        )
        data = self._traces()
        for r in range(self.engines):
            colour = RANK_COLOURS[r % len(RANK_COLOURS)]
            fig.add_trace(
                go.Scatter(
                    name=f"rank {r} loss",
                    mode="lines",
                    line={"width": 1, "color": colour},
                    **data[r],
                ),
                1,
                1,
            )
        n = self.engines
        fig.add_trace(
            go.Scatter(
                name="loss (global batch)",
                mode="lines",
                marker={"size": 4},
                line={"width": 2.5, "color": "#1f3b73"},
                **data[n],
            ),
            1,
            1,
        )
        fig.add_trace(
            go.Scatter(
                name="eval loss",
                mode="markers",
                marker={"size": 9, "symbol": "diamond", "color": "#d62728"},
                **data[n + 1],
            ),
            1,
            1,
        )
        fig.add_trace(
            go.Scatter(name="samples/s", mode="lines", line={"color": "#2ca02c"}, **data[n + 2]),
            1,
            2,
        )
        for i, (kind, colour) in enumerate(zip(MEMORY_KINDS, MEMORY_COLOURS)):
            fig.add_trace(go.Bar(name=kind, marker_color=colour, **data[n + 3 + i]), 2, 1)
        fig.add_trace(
            go.Scatter(name="cost so far", mode="lines", line={"color": "#8c564b"}, **data[-1]),
            2,
            2,
        )
        fig.update_layout(
            barmode="stack",
            height=620,
            margin={"l": 60, "r": 20, "t": 70, "b": 50},
            title={"text": html.escape(self.header_text()), "font": {"size": 13}},
            legend={"orientation": "h", "y": -0.12},
            template="plotly_white",
        )
        fig.update_xaxes(title_text="step", row=1, col=1)
        fig.update_yaxes(title_text="loss", row=1, col=1)
        fig.update_xaxes(title_text="step", row=1, col=2)
        fig.update_yaxes(title_text="samples/s", rangemode="tozero", row=1, col=2)
        fig.update_yaxes(title_text="MiB", row=2, col=1)
        fig.update_xaxes(title_text="elapsed (s)", row=2, col=2)
        fig.update_yaxes(title_text="USD", rangemode="tozero", row=2, col=2)
        return fig

    def save_html(self, path: str | Path) -> Path:
        """One self-contained file (plotly.js inline), viewable without a kernel or network."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.to_figure().write_html(path, include_plotlyjs=True, full_html=True)
        return path

    # -- live display ---------------------------------------------------------------------
    def _show(self) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        self._header = widgets.HTML(self._header_html())
        self._figure_widget = go.FigureWidget(self.to_figure())
        self._figure_widget.update_layout(title=None)
        self._widget = widgets.VBox([self._header, self._figure_widget])
        self._widget.add_class("smp-dashboard")
        display(self._widget)

    def _header_html(self) -> str:
        return f"<b>sagenb</b> &middot; {html.escape(self.header_text())}"

    def _redraw(self) -> None:
        if self._figure_widget is None or not self._dirty:
            if self._header is not None:
                self._header.value = self._header_html()
            return
        self._dirty = False
        self.redraws += 1
        with self._figure_widget.batch_update():
            for trace, data in zip(self._figure_widget.data, self._traces()):
                trace.x, trace.y = data["x"], data["y"]
        self._header.value = self._header_html()
