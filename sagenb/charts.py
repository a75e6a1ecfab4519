"""The dashboard's figure: six panels drawn from what the dashboard recorded.

Declarative (issue 18): `PANELS` says where each chart sits and how its axes read, `traces`
lists every trace once (name, panel, style, data). The figure is built from that list and a
live redraw takes its data from the same list, assigning each trace's arrays to the trace of
the same name (kept in plotly's `meta`, which a FigureWidget keeps; it rewrites `uid`), so no
trace is found by its position. The functions are pure functions of the board, so the live
FigureWidget, the saved HTML and the static copy in an executed notebook are one figure.

A line shows at most MAX_POINTS points: a longer run is drawn every k-th step, its last step
always included (TensorBoard samples its charts too; `result.history` keeps every step). Numbers
go to plotly as numpy arrays, which it takes whole instead of checking element by element.
Without both, a live redraw cost 55 ms of the notebook's CPU at 5,000 steps, four times a
second, taken from the engines' cores on a small machine; now under 10 ms at any length.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sagenb import metric_keys as keys
from sagenb.config import describe, strategy_names

if TYPE_CHECKING:
    from sagenb.config import TrainConfig
    from sagenb.cost import CostMeter
    from sagenb.metrics import History

__all__ = [
    "Board",
    "Panel",
    "Trace",
    "PANELS",
    "traces",
    "figure",
    "trace_data",
    "smoothed",
    "SMOOTHING",
]

SMOOTHING = 0.9  # exponential moving average of the global loss (TensorBoard's default 0.6-0.9)
MEMORY_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#B279A2")  # one per keys.MEMORY_KINDS
REPLICA_COLOURS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fdd0a2", "#c7e9c0", "#dadaeb")
FORWARD, BACKWARD = "#4C78A8", "#F58518"
MAX_POINTS = 2000


class Board(Protocol):
    """What the charts read from the dashboard (dashboard.Dashboard is one)."""

    @property
    def config(self) -> TrainConfig: ...
    @property
    def cost(self) -> CostMeter: ...
    @property
    def history(self) -> History: ...
    @property
    def engines(self) -> int: ...
    @property
    def memory(self) -> Mapping[int, Mapping[str, Any]]: ...  # rank -> its last step's metrics
    @property
    def timelines(self) -> Mapping[int, tuple[float, list]]: ...  # rank -> (t0, events)
    @property
    def cost_points(self) -> Sequence[tuple[float, float]]: ...  # (elapsed s, USD)
    @property
    def rate_key(self) -> str: ...  # keys.THROUGHPUT, or keys.TOKEN_THROUGHPUT for tokens

    def replica_losses(self) -> list[list[tuple[int, float]]]: ...
    def step_split(self) -> tuple[list[float], list[float]]: ...
    def header_text(self) -> str: ...


Text = str | Callable[[Board], str]  # a label, or how to read it off the board


def pipelined(board: Board) -> bool:
    """Whether the run has a pipeline schedule and bubble to draw: the one place charts ask."""
    return describe(board.config.strategy).pipelined


def _text(text: Text, board: Board) -> str:
    return text if isinstance(text, str) else text(board)


@dataclass(frozen=True)
class Panel:
    """One subplot: where it sits, its title and axis titles, and more y-axis settings."""

    row: int
    col: int
    title: Text
    x: Text | None = None
    y: Text | None = None
    yaxis: Mapping[str, Any] = field(default_factory=lambda: {"rangemode": "tozero"})


LOSS = Panel(1, 1, "Loss", "step", "loss", {"rangemode": "normal"})
THROUGHPUT = Panel(1, 2, "Throughput", "step", lambda b: keys.unit(b.rate_key))
MEMORY = Panel(2, 1, "Memory per engine (last step)", None, "MiB")
STEP_TIME = Panel(
    2,
    2,
    lambda b: "Step time: compute and pipeline bubble" if pipelined(b) else "Step time",
    "step",
    "seconds per step",
)
SCHEDULE = Panel(
    3,
    1,
    lambda b: (
        "Pipeline schedule, last step" if pipelined(b) else "Pipeline schedule (model/hybrid only)"
    ),
    "ms into the step",
    yaxis={"autorange": "reversed"},  # stage 0 on top
)
COST = Panel(
    3,
    2,
    lambda b: (
        f"Estimated cost on {b.cost.instances} x {b.cost.price.name} "
        f"(price as of {b.cost.price.as_of})"
    ),
    "elapsed (s)",
    "USD",
)
PANELS = (LOSS, THROUGHPUT, MEMORY, STEP_TIME, SCHEDULE, COST)  # row by row, as plotly counts


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


def smoothed(values: list[float]) -> list[float]:
    out: list[float] = []
    value = None
    for v in values:
        if math.isnan(v):  # a step whose loss was lost with its engine: a gap, not a NaN trail
            out.append(v)
            continue
        value = v if value is None else SMOOTHING * value + (1 - SMOOTHING) * v
        out.append(value)
    return out


class Snapshot:
    """What one draw reads from the board; a series several traces use is derived once."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.rows = board.history.steps
        self.shown = _thin(range(len(self.rows)))  # the rows drawn, for every per-step line
        self.steps = [self.rows[i][keys.STEP] for i in self.shown]

    def per_step(self, values: Sequence[float]) -> dict[str, np.ndarray]:
        """A line of one value per history row, thinned."""
        return _line(self.steps, [values[i] for i in self.shown])

    @cached_property
    def replicas(self) -> list[list[tuple[int, float]]]:
        return self.board.replica_losses()

    @cached_property
    def split(self) -> tuple[list[float], list[float]]:
        return self.board.step_split()

    @cached_property
    def timeline(self) -> dict[str, dict[str, list]]:
        """The last complete step's microbatches as Gantt bars, per kind (F, B)."""
        bars: dict[str, dict[str, list]] = {
            k: {"x": [], "base": [], "y": [], "text": []} for k in "FB"
        }
        timelines = self.board.timelines
        t0 = min((t for t, _ in timelines.values()), default=0.0)
        for start, events in timelines.values():
            for kind, stage, micro, a, b in events:
                bar = bars[kind]
                bar["base"].append((start - t0 + a) * 1e3)
                bar["x"].append((b - a) * 1e3)
                bar["y"].append(f"stage {stage}")
                bar["text"].append(str(micro))
        return bars

    @cached_property
    def cost(self) -> list[tuple[float, float]]:
        return _thin(self.board.cost_points)  # one point per header redraw: two a second


def _replica(snap: Snapshot, r: int) -> dict[str, np.ndarray]:
    points = snap.replicas[r]
    return _line(*zip(*_thin(points))) if points else _line([], [])


def _smoothed_loss(snap: Snapshot) -> dict[str, np.ndarray]:
    return snap.per_step(smoothed([row[keys.LOSS] for row in snap.rows]))


def _eval_loss(snap: Snapshot) -> dict[str, np.ndarray]:
    evals = [row for row in snap.rows if keys.EVAL_LOSS in row]
    return _line([r[keys.STEP] for r in evals], [r[keys.EVAL_LOSS] for r in evals])


def _rate(snap: Snapshot) -> dict[str, np.ndarray]:
    key, rows = snap.board.rate_key, snap.rows
    return _line(snap.steps, [rows[i].get(key, 0.0) for i in snap.shown])


def _per_engine(snap: Snapshot, key: str, missing: float | None = None) -> dict[str, list]:
    """One value per engine from its last step; engines without the key are left out
    unless `missing` gives a value."""
    board = snap.board
    points = [
        (f"engine {r}", board.memory.get(r, {}).get(key, missing)) for r in range(board.engines)
    ]
    kept = [(x, y) for x, y in points if y is not None]
    return {"x": [x for x, _ in kept], "y": [y for _, y in kept]}


def _cost(snap: Snapshot, spot: bool) -> dict[str, np.ndarray]:
    price = snap.board.cost.spot if spot else float
    return _line([t for t, _ in snap.cost], [price(c) for _, c in snap.cost])


Data = Callable[[Snapshot], dict[str, Any]]


@dataclass(frozen=True)
class Trace:
    """One trace: `name` is its identity (legend text unless `label` says otherwise, and its
    `meta`, by which a redraw finds it), `style` its plotly attributes, `data` its x, y, ...."""

    name: str
    panel: Panel
    data: Data
    style: Mapping[str, Any] = field(default_factory=dict)
    kind: Callable[..., Any] = go.Scatter  # the plotly trace type
    label: Callable[[Board], str] | None = None
    visible: Callable[[Board], bool] | None = None

    def build(self, board: Board, snap: Snapshot) -> Any:
        name = self.label(board) if self.label else self.name
        shown = {} if self.visible is None else {"visible": self.visible(board)}
        return self.kind(name=name, meta=self.name, **self.style, **shown, **self.data(snap))


def _marks(colour: str) -> dict[str, Any]:
    return {"mode": "markers", "marker": {"symbol": "line-ew-open", "size": 40, "color": colour}}


def _gantt(colour: str) -> dict[str, Any]:
    return {"orientation": "h", "marker_color": colour, "textposition": "inside",
            "insidetextanchor": "middle"}  # fmt: skip


TRACES: tuple[Trace, ...] = (
    Trace("loss (smoothed)", LOSS, _smoothed_loss,
          {"mode": "lines", "line": {"width": 2.5, "color": "#1f3b73", "simplify": False}}),
    Trace("eval loss", LOSS, _eval_loss,
          {"mode": "markers", "marker": {"size": 9, "symbol": "diamond", "color": "#d62728"}}),
    Trace("throughput", THROUGHPUT, _rate, {"mode": "lines", "line": {"color": "#2ca02c"}},
          label=lambda b: keys.unit(b.rate_key)),
    *(Trace(kind, MEMORY, partial(_per_engine, key=keys.memory(kind), missing=0.0),
            {"marker_color": colour}, go.Bar)
      for kind, colour in zip(keys.MEMORY_KINDS, MEMORY_COLOURS)),
    Trace("device peak (CUDA)", MEMORY, partial(_per_engine, key=keys.MEMORY_DEVICE_PEAK),
          _marks("#333")),
    Trace("device capacity (CUDA)", MEMORY,
          partial(_per_engine, key=keys.MEMORY_DEVICE_CAPACITY), _marks("#d62728")),
    Trace("compute (s)", STEP_TIME, lambda s: s.per_step(s.split[0]),
          {"mode": "lines", "stackgroup": "t", "line": {"color": "#4C78A8"}}),
    Trace("idle / bubble (s)", STEP_TIME, lambda s: s.per_step(s.split[1]),
          {"mode": "lines", "stackgroup": "t", "line": {"color": "#E45756"}},
          visible=pipelined),  # always zero without a pipeline: a red line along the top
    Trace("forward", SCHEDULE, lambda s: s.timeline["F"], _gantt(FORWARD), go.Bar),
    Trace("backward", SCHEDULE, lambda s: s.timeline["B"], _gantt(BACKWARD), go.Bar),
    Trace("on-demand", COST, partial(_cost, spot=False),
          {"mode": "lines", "line": {"color": "#8c564b"}}),
    Trace("spot", COST, partial(_cost, spot=True),
          {"mode": "lines", "line": {"color": "#8c564b", "dash": "dot"}},
          label=lambda b: f"spot ({b.cost.spot_discount:.0%} off)"),
)  # fmt: skip


def _replica_trace(r: int) -> Trace:
    colour = REPLICA_COLOURS[r % len(REPLICA_COLOURS)]
    style = {"mode": "lines", "line": {"width": 1, "color": colour, "simplify": False}}
    return Trace(f"replica {r} loss", LOSS, partial(_replica, r=r), style)


def traces(board: Board) -> tuple[Trace, ...]:
    """Every trace of this run's figure, in drawing order: a loss line per replica (the same
    number from the first draw to the last), then TRACES. The figure and every redraw take
    them from here."""
    replicas = board.config.replicas(board.engines)
    return tuple(_replica_trace(r) for r in range(replicas)) + TRACES


def trace_data(board: Board) -> dict[str, dict[str, Any]]:
    """Every trace's data, by name, from the list the figure is built from."""
    snap = Snapshot(board)
    return {trace.name: trace.data(snap) for trace in traces(board)}


def figure(board: Board) -> go.Figure:
    """The whole dashboard as one plotly figure (the header as its title)."""
    fig = make_subplots(
        rows=max(p.row for p in PANELS),
        cols=max(p.col for p in PANELS),
        vertical_spacing=0.11,
        horizontal_spacing=0.09,
        subplot_titles=[_text(p.title, board) for p in PANELS],
    )
    snap = Snapshot(board)
    for trace in traces(board):
        fig.add_trace(trace.build(board, snap), trace.panel.row, trace.panel.col)
    for panel in PANELS:
        if panel.x is not None:
            fig.update_xaxes(title_text=_text(panel.x, board), row=panel.row, col=panel.col)
        y = {} if panel.y is None else {"title_text": _text(panel.y, board)}
        fig.update_yaxes(**y, **panel.yaxis, row=panel.row, col=panel.col)
    if not pipelined(board):
        _placeholder(fig, SCHEDULE)
    fig.update_layout(
        barmode="stack",
        height=900,
        template="plotly_white",
        margin={"l": 60, "r": 20, "t": 80, "b": 40},
        title={"text": html.escape(board.header_text()), "font": {"size": 12}},
        legend={"orientation": "v", "x": 1.02, "y": 1.0},
    )
    return fig


def _placeholder(fig: go.Figure, panel: Panel) -> None:
    """An empty panel says what would appear there instead of showing bare axes."""
    fig.update_xaxes(visible=False, row=panel.row, col=panel.col)
    fig.update_yaxes(visible=False, row=panel.row, col=panel.col)
    axis = PANELS.index(panel) + 1  # plotly numbers the subplots' axes row by row
    fig.add_annotation(
        text="each stage's forward and backward per microbatch<br>appear here for "
        f"--strategy {' or '.join(n for n in strategy_names() if describe(n).pipelined)}",
        xref=f"x{axis} domain",
        yref=f"y{axis} domain",
        x=0.5,
        y=0.5,
        showarrow=False,
        font={"color": "#888", "size": 13},
    )
