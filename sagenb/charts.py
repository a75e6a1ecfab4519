"""The dashboard's figure: six panels drawn from what the dashboard recorded.

Pure functions of the recorded state, so the live FigureWidget, the saved HTML and the static
copy in an executed notebook are one figure. `trace_data` gives every trace's (x, y, ...) in the
fixed order `figure` builds them, so a live redraw only assigns new arrays.

A line shows at most MAX_POINTS points: a longer run is drawn every k-th step, its last step
always included (TensorBoard samples its charts too; `result.history` keeps every step). Numbers
go to plotly as numpy arrays, which it takes whole instead of checking element by element.
Without both, a live redraw cost 55 ms of the notebook's CPU at 5,000 steps, four times a
second, taken from the engines' cores on a small machine; now under 10 ms at any length.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["figure", "trace_data", "SMOOTHING"]

SMOOTHING = 0.9  # exponential moving average of the global loss (TensorBoard's default 0.6-0.9)
MEMORY_KINDS = ("params", "grads", "optimizer", "activations")
MEMORY_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#B279A2")
REPLICA_COLOURS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fdd0a2", "#c7e9c0", "#dadaeb")
FORWARD, BACKWARD = "#4C78A8", "#F58518"
MAX_POINTS = 2000


def _thin(items: Sequence) -> list:
    """At most ~MAX_POINTS of `items`: every k-th, ending with the last."""
    n = len(items)
    if n <= MAX_POINTS:
        return list(items)
    k = math.ceil(n / MAX_POINTS)
    kept = list(items[k - 1 :: k])
    if (n - 1) % k != k - 1:
        kept.append(items[-1])
    return kept


def _line(x: Sequence[float], y: Sequence[float]) -> dict[str, np.ndarray]:
    return {"x": np.asarray(x, dtype=float), "y": np.asarray(y, dtype=float)}


def _smoothed(values: list[float]) -> list[float]:
    out, value = [], None
    for v in values:
        value = v if value is None else SMOOTHING * value + (1 - SMOOTHING) * v
        out.append(value)
    return out


def _timeline(board: Any) -> dict[str, dict[str, list]]:
    """The last complete step's microbatches as Gantt bars, per kind (F, B)."""
    bars: dict[str, dict[str, list]] = {
        kind: {"x": [], "base": [], "y": [], "text": []} for kind in "FB"
    }
    timelines = board.timelines
    if not timelines:
        return bars
    t0 = min(t for t, _ in timelines.values())
    for start, events in timelines.values():
        for kind, stage, micro, a, b in events:
            bar = bars[kind]
            bar["base"].append((start - t0 + a) * 1e3)
            bar["x"].append((b - a) * 1e3)
            bar["y"].append(f"stage {stage}")
            bar["text"].append(str(micro))
    return bars


def _per_engine(board: Any, key: str, missing: float | None = None) -> dict[str, list]:
    """One value per engine from its last step; engines without the key are left out
    unless `missing` gives a value."""
    points = [
        (f"engine {r}", board.memory.get(r, {}).get(key, missing)) for r in range(board.engines)
    ]
    kept = [(x, y) for x, y in points if y is not None]
    return {"x": [x for x, _ in kept], "y": [y for _, y in kept]}


def trace_data(board: Any) -> list[dict[str, Any]]:
    rows = board.history.steps
    shown = _thin(range(len(rows)))  # the rows drawn, for every per-step line
    data = [_line(*zip(*_thin(pts))) if pts else _line([], []) for pts in board.replica_losses()]
    smoothed = _smoothed([r["loss"] for r in rows])
    steps = [rows[i]["step"] for i in shown]
    data.append(_line(steps, [smoothed[i] for i in shown]))
    evals = [r for r in rows if "eval_loss" in r]
    data.append(_line([r["step"] for r in evals], [r["eval_loss"] for r in evals]))
    rate_key = board.rate_key
    data.append(_line(steps, [rows[i].get(rate_key, 0.0) for i in shown]))
    for kind in MEMORY_KINDS:
        data.append(_per_engine(board, f"memory/{kind}(MiB)", missing=0.0))
    for key in ("memory/device_peak(MiB)", "memory/device_capacity(MiB)"):  # CUDA only
        data.append(_per_engine(board, key))
    busy, idle = board.step_split()
    data.append(_line(steps, [busy[i] for i in shown]))
    data.append(_line(steps, [idle[i] for i in shown]))
    timeline = _timeline(board)
    data += [timeline["F"], timeline["B"]]
    cost = _thin(board.cost_points)  # one point per header redraw: two a second
    data.append(_line([t for t, _ in cost], [c for _, c in cost]))
    data.append(_line([t for t, _ in cost], [board.cost.spot(c) for _, c in cost]))
    return data


def figure(board: Any) -> go.Figure:
    """The whole dashboard as one plotly figure (the header as its title)."""
    pipeline = board.config.strategy in ("model", "hybrid")
    fig = make_subplots(
        rows=3,
        cols=2,
        vertical_spacing=0.11,
        horizontal_spacing=0.09,
        subplot_titles=(
            "Loss",
            "Throughput",
            "Memory per engine (last step)",
            "Step time: compute and pipeline bubble" if pipeline else "Step time",
            "Pipeline schedule, last step" if pipeline else "Pipeline schedule (model/hybrid only)",
            f"Estimated cost on {board.cost.instances} x {board.cost.price.name} "
            f"(price as of {board.cost.price.as_of})",
        ),
    )
    data = iter(trace_data(board))
    for r in range(len(board.replica_losses())):
        colour = REPLICA_COLOURS[r % len(REPLICA_COLOURS)]
        fig.add_trace(
            go.Scatter(
                name=f"replica {r} loss",
                mode="lines",
                line={"width": 1, "color": colour, "simplify": False},
                **next(data),
            ),
            1,
            1,
        )
    fig.add_trace(
        go.Scatter(
            name="loss (smoothed)",
            mode="lines",
            line={"width": 2.5, "color": "#1f3b73", "simplify": False},
            **next(data),
        ),
        1,
        1,
    )
    fig.add_trace(
        go.Scatter(
            name="eval loss",
            mode="markers",
            marker={"size": 9, "symbol": "diamond", "color": "#d62728"},
            **next(data),
        ),
        1,
        1,
    )
    fig.add_trace(
        go.Scatter(
            name=board.rate_key.split("(")[1].rstrip(")"),
            mode="lines",
            line={"color": "#2ca02c"},
            **next(data),
        ),
        1,
        2,
    )
    for kind, colour in zip(MEMORY_KINDS, MEMORY_COLOURS):
        fig.add_trace(go.Bar(name=kind, marker_color=colour, **next(data)), 2, 1)
    fig.add_trace(
        go.Scatter(
            name="device peak (CUDA)",
            mode="markers",
            marker={"symbol": "line-ew-open", "size": 40, "color": "#333"},
            **next(data),
        ),
        2,
        1,
    )
    fig.add_trace(
        go.Scatter(
            name="device capacity (CUDA)",
            mode="markers",
            marker={"symbol": "line-ew-open", "size": 40, "color": "#d62728"},
            **next(data),
        ),
        2,
        1,
    )
    fig.add_trace(
        go.Scatter(
            name="compute (s)",
            mode="lines",
            stackgroup="t",
            line={"color": "#4C78A8"},
            **next(data),
        ),
        2,
        2,
    )
    fig.add_trace(
        go.Scatter(
            name="idle / bubble (s)",
            mode="lines",
            stackgroup="t",
            line={"color": "#E45756"},
            visible=pipeline,  # always zero without a pipeline: a red line along the top
            **next(data),
        ),
        2,
        2,
    )
    for name, colour in (("forward", FORWARD), ("backward", BACKWARD)):
        fig.add_trace(
            go.Bar(
                name=name,
                orientation="h",
                marker_color=colour,
                textposition="inside",
                insidetextanchor="middle",
                **next(data),
            ),
            3,
            1,
        )
    fig.add_trace(
        go.Scatter(name="on-demand", mode="lines", line={"color": "#8c564b"}, **next(data)), 3, 2
    )
    fig.add_trace(
        go.Scatter(
            name=f"spot ({board.cost.spot_discount:.0%} off)",
            mode="lines",
            line={"color": "#8c564b", "dash": "dot"},
            **next(data),
        ),
        3,
        2,
    )
    _axes(fig, board)
    fig.update_layout(
        barmode="stack",
        height=900,
        template="plotly_white",
        margin={"l": 60, "r": 20, "t": 80, "b": 40},
        title={"text": html.escape(board.header_text()), "font": {"size": 12}},
        legend={"orientation": "v", "x": 1.02, "y": 1.0},
    )
    return fig


def _axes(fig: go.Figure, board: Any) -> None:
    unit = board.rate_key.split("(")[1].rstrip(")")
    labels = {
        (1, 1): ("step", "loss"),
        (1, 2): ("step", unit),
        (2, 1): (None, "MiB"),
        (2, 2): ("step", "seconds per step"),
        (3, 1): ("ms into the step", None),
        (3, 2): ("elapsed (s)", "USD"),
    }
    for (row, col), (x, y) in labels.items():
        if x:
            fig.update_xaxes(title_text=x, row=row, col=col)
        if y:
            fig.update_yaxes(
                title_text=y,
                row=row,
                col=col,
                rangemode="tozero" if (row, col) != (1, 1) else "normal",
            )
    fig.update_yaxes(autorange="reversed", row=3, col=1)
    if board.config.strategy not in ("model", "hybrid"):
        fig.update_xaxes(visible=False, row=3, col=1)
        fig.update_yaxes(visible=False, row=3, col=1)
        fig.add_annotation(
            text="each stage's forward and backward per microbatch<br>appear here for "
            "--strategy model or hybrid",
            xref="x5 domain",
            yref="y5 domain",
            x=0.5,
            y=0.5,
            showarrow=False,
            font={"color": "#888", "size": 13},
        )
