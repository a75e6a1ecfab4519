"""The dashboard's figure: six panels drawn from what the dashboard recorded.

Declarative (issue 18): `PANELS` says where each chart sits and how its axes read, `traces`
lists every trace once (name, panel, style, data). The figure is built from that list and a
live redraw takes its data from the same list, assigning each trace's arrays to the trace of
the same name (kept in plotly's `meta`, which a FigureWidget keeps; it rewrites `uid`), so no
trace is found by its position. The functions are pure functions of the board, so the live
FigureWidget, the saved HTML and the static copy in an executed notebook are one figure.

A line shows at most MAX_POINTS points (the live drawing svg_figure.MAX_POINTS): a longer run
is drawn every k-th step, its last step always included (TensorBoard samples its charts too;
`result.history` keeps every step). Numbers go to plotly as numpy arrays, which it takes whole
instead of checking element by element. The lines derived from every step (moving averages,
replica losses) are kept as the run grows (step_columns.py), so a redraw reads the rows it draws
and the new ones, never the whole history: the loss panel's live redraw costs the notebook
~1-3 ms at 1,100 steps and at 30,000 (it was 4 ms and 84 ms; benchmarks/dashboard_redraw.py).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sagenb.config.options import describe
from sagenb.display.step_columns import SMOOTHING, StepColumns, smoothed
from sagenb.display.svg_figure import thinned
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.config.options import TrainConfig
    from sagenb.metrics.stream import History
    from sagenb.sizing.cost import CostMeter

__all__ = [
    "panels",
    "wrap_header",
    "Board",
    "Panel",
    "Trace",
    "PANELS",
    "traces",
    "figure",
    "trace_data",
    "axis_titles",
    "smoothed",
    "SMOOTHING",
]

MEMORY_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#B279A2")  # one per keys.MEMORY_KINDS
REPLICA_COLOURS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fdd0a2", "#c7e9c0", "#dadaeb")
FORWARD, BACKWARD, WEIGHT = "#4C78A8", "#F58518", "#54A24B"
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

    def columns(self) -> StepColumns: ...  # the lines derived from every row, up to date
    def header_text(self) -> str: ...


Text = str | Callable[[Board], str]  # a label, or how to read it off the board


def pipelined(board: Board) -> bool:
    """Whether the run has a pipeline schedule and bubble to draw: the one place charts ask."""
    return describe(board.config.strategy).pipelined


def _text(text: Text, board: Board) -> str:
    return text if isinstance(text, str) else text(board)


@dataclass(frozen=True, eq=False)  # a panel is itself: hashed by identity, a dict's key
class Panel:
    """One subplot: where it sits, its title and axis titles, and more y-axis settings."""

    row: int
    col: int
    title: Text
    x: Text | None = None
    y: Text | None = None
    yaxis: Mapping[str, Any] = field(default_factory=lambda: {"rangemode": "tozero"})
    #: redrawn every second while a run trains, however long it runs (the others less often)
    every_second: bool = False


LOSS = Panel(1, 1, "Loss", "step", "loss", {"rangemode": "normal"}, every_second=True)
THROUGHPUT = Panel(1, 2, "Throughput", "step", lambda b: keys.unit(b.rate_key))
MEMORY = Panel(2, 1, "Memory per engine, last step", None, "MiB")
STEP_TIME = Panel(
    2,
    2,
    lambda b: "Step time: compute, bubble" if pipelined(b) else "Step time",
    "step",
    "s per step",
)
SCHEDULE = Panel(
    3,
    1,
    "Pipeline schedule, last step",
    "ms into the step",
    yaxis={"autorange": "reversed"},  # stage 0 on top
)


def _clips(board: Board) -> bool:
    """The engines record the gradient norm only when they clip it (--clip-grad-norm)."""
    return board.config.clip_grad_norm is not None


#: in the schedule's place when there is no pipeline: how the optimizer steps (issue 17)
OPTIMIZER = Panel(
    3,
    1,
    lambda b: "Learning rate, gradient norm" if _clips(b) else "Learning rate",
    "step",
    "log scale",
    {"type": "log", "tickformat": ".0e"},
)  # ".0e": a log axis spanning less than a decade otherwise labels its ticks "2", "5"


def spreads_experts(board: Board) -> bool:
    """Whether the run spreads mixture-of-experts layers over engines (--expert-parallel)."""
    return int(board.config.option("expert_parallel")) > 1


#: in the schedule's place with --expert-parallel: how evenly the router spread the tokens,
#: which decides how busy each engine's experts are (imbalance is what MoE users watch)
EXPERTS = Panel(3, 1, "Tokens per expert, last step", "expert", "(token, choice) pairs")


def _cost_title(meter: CostMeter) -> str:
    """The cost panel says what its dollars are: this run billed as the instance only when the
    engines run on its kind of hardware; else this run's seconds at the instance's price, a
    what-if, labelled as one (the projection on the instance is in the header)."""
    what = f"{meter.instances} x {meter.price.name}"
    note = f"price as of {meter.price.as_of}"
    if meter.billed_here:
        title = f"Cost, {what}"
    else:
        title = f"This run's seconds at {what} prices"
        note = f"ran on {meter.runs_on or 'other hardware'}, not a {meter.price.name}; {note}"
    return f"{title}<br><span style='font-size:10px'>{note}</span>"


COST = Panel(
    3,
    2,
    lambda b: _cost_title(b.cost),
    "elapsed (s)",
    "USD",
    # dollars as decimals: plotly's SI prefixes read "800µ" for $0.0008
    {"rangemode": "tozero", "tickprefix": "$", "exponentformat": "none"},
)
PANELS = (LOSS, THROUGHPUT, MEMORY, STEP_TIME, SCHEDULE, COST)  # row by row, as plotly counts


def panels(board: Board) -> tuple[Panel, ...]:
    """This run's panels: the schedule timeline only for pipelines (elsewhere it stayed
    empty: issue 17), the tokens per expert where experts are spread over engines, the
    optimizer's learning rate (and gradient norm, when clipped) otherwise."""
    instead = EXPERTS if spreads_experts(board) else OPTIMIZER
    return tuple(instead if p is SCHEDULE and not pipelined(board) else p for p in PANELS)


def _line(x: Sequence[float], y: Sequence[float]) -> dict[str, np.ndarray]:
    return {"x": np.asarray(x, dtype=float), "y": np.asarray(y, dtype=float)}


class Snapshot:
    """What one draw reads from the board; a series several traces use is derived once."""

    def __init__(self, board: Board, points: int = MAX_POINTS) -> None:
        self.board, self.points = board, points
        self.rows = board.history.steps
        self.shown = thinned(range(len(self.rows)), points)  # the rows of every per-step line
        self.steps = [self.rows[i][keys.STEP] for i in self.shown]
        self.columns = board.columns()

    def per_step(self, values: Sequence[float]) -> dict[str, np.ndarray]:
        """A line of one value per history row, thinned."""
        return _line(self.steps, [values[i] for i in self.shown])

    @cached_property
    def timeline(self) -> dict[str, dict[str, list]]:
        """The last complete step's microbatches as Gantt bars, per kind (F, B; W where the
        schedule splits the backward: B is then the input's gradient, W the weights')."""
        bars: dict[str, dict[str, list]] = {
            k: {"x": [], "base": [], "y": [], "text": []} for k in "FBW"
        }
        timelines = self.board.timelines
        t0 = min((t for t, _ in timelines.values()), default=0.0)
        # by stage: the rows (categories, in order of first appearance) run stage 0, 1, ...
        # down, where engines holding several stages (interleaved, a V) report theirs together
        events = sorted(
            (event[1], start - t0 + event[3], event)
            for start, mine in timelines.values()
            for event in mine
        )
        for stage, at, (kind, _, micro, a, b) in events:
            bar = bars[kind]
            bar["base"].append(at * 1e3)
            bar["x"].append((b - a) * 1e3)
            bar["y"].append(f"stage {stage}")
            bar["text"].append(str(micro))
        return bars

    @cached_property
    def cost(self) -> list[tuple[float, float]]:
        return thinned(self.board.cost_points, self.points)  # one point per header redraw


def _replica(snap: Snapshot, r: int) -> dict[str, np.ndarray]:
    return snap.per_step(snap.columns.replica_losses[r])


def _smoothed_loss(snap: Snapshot) -> dict[str, np.ndarray]:
    return snap.per_step(snap.columns.loss.values)


def _eval_loss(snap: Snapshot) -> dict[str, np.ndarray]:
    evals = thinned(snap.columns.evals, snap.points)
    return _line([step for step, _ in evals], [loss for _, loss in evals])


def _segment_starts(snap: Snapshot) -> dict[str, np.ndarray]:
    """Where each --continue went on: its first step, at the smoothed loss there."""
    rows, loss = snap.rows, snap.columns.loss.values
    first = rows[0][keys.STEP] if rows else 0
    starts = [s for s in getattr(snap.board, "segments", ())[1:] if 0 <= s - first < len(loss)]
    return _line(starts, [loss[s - first] for s in starts])


def _continued(board: Board) -> bool:
    return len(getattr(board, "segments", ())) > 1


def _rate(snap: Snapshot) -> dict[str, np.ndarray]:
    key, rows = snap.board.rate_key, snap.rows
    return _line(snap.steps, [rows[i].get(key, 0.0) for i in snap.shown])


def _smoothed_rate(snap: Snapshot) -> dict[str, np.ndarray]:
    """Per-step throughput is a band of noise (issue 17): its moving average is the line."""
    return snap.per_step(snap.columns.rate.values)


def _row_value(snap: Snapshot, key: str) -> dict[str, np.ndarray]:
    """A history value over the steps that have it (the gradient norm: --clip-grad-norm)."""
    kept = [i for i in snap.shown if key in snap.rows[i]]
    return _line([snap.rows[i][keys.STEP] for i in kept], [snap.rows[i][key] for i in kept])


def _memory_headroom(snap: Snapshot) -> dict[str, list]:
    """An invisible point a quarter above the tallest stack, so that the memory bars never
    touch the top of their axis (issue 17) in any redraw: it is data, as the bars are."""
    board = snap.board
    totals = [
        sum(board.memory.get(r, {}).get(keys.memory(k), 0.0) for k in keys.MEMORY_KINDS)
        for r in range(board.engines)
    ]
    marks = [
        board.memory.get(r, {}).get(key, 0.0)
        for r in range(board.engines)
        for key in (keys.MEMORY_DEVICE_PEAK, keys.MEMORY_DEVICE_CAPACITY, keys.MEMORY_OFFLOADED)
    ]
    top = max([*totals, *marks, 0.0])
    return {"x": [f"engine {r}" for r in range(board.engines)], "y": [1.25 * top] * board.engines}


def _expert_counts(snap: Snapshot, even: bool = False) -> dict[str, list]:
    """The last step's (token, choice) pairs routed to each expert, over the global batch and
    every MoE layer; `even`: the share each would get from a router that spread them evenly."""
    last = next((r for r in reversed(snap.rows) if keys.EXPERT_TOKENS in r), None)
    counts = last[keys.EXPERT_TOKENS] if last is not None else []
    share = sum(counts) / len(counts) if counts else 0.0
    return {
        "x": [str(e) for e in range(len(counts))],
        "y": [share] * len(counts) if even else counts,
    }


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

    def build(self, board: Board, snap: Snapshot, legend: str = "legend") -> Any:
        name = self.label(board) if self.label else self.name
        shown = {} if self.visible is None else {"visible": self.visible(board)}
        style = {"legend": legend, **self.style}  # the panel's own legend, beside it
        return self.kind(name=name, meta=self.name, **style, **shown, **self.data(snap))


def _marks(colour: str) -> dict[str, Any]:
    return {"mode": "markers", "marker": {"symbol": "line-ew-open", "size": 40, "color": colour}}


def _gantt(colour: str) -> dict[str, Any]:
    return {"orientation": "h", "marker_color": colour, "textposition": "inside",
            "insidetextanchor": "middle"}  # fmt: skip


def _splits_backward(board: Board) -> bool:
    """Whether the schedule runs the weights' gradients on their own (the zero-bubble ones)."""
    return describe(board.config.strategy).splits_backward(board.config)


def _cuda(board: Board) -> bool:
    """Whether the engines report CUDA memory (the device marks mean nothing on CPUs)."""
    return any(keys.MEMORY_DEVICE_CAPACITY in m for m in board.memory.values())


def _offloads(board: Board) -> bool:
    """Whether activations wait for backward in host memory (--offload-activations): marked
    beside the bars, which count what stays on the device."""
    return board.config.offload_activations


def _label(text: str) -> Callable[[Board], str]:
    return lambda board: text


FAINT = {"width": 1, "color": "rgba(44, 160, 44, 0.3)"}
INVISIBLE = {"mode": "markers", "marker": {"opacity": 0}, "hoverinfo": "skip", "showlegend": False}

# Legend texts are short: each panel has its own legend beside it, in a column of ~100 px at
# 700 px wide (the name stays the trace's identity, as `meta`).
TRACES: tuple[Trace, ...] = (
    Trace("loss (smoothed)", LOSS, _smoothed_loss,
          {"mode": "lines", "line": {"width": 2.5, "color": "#1f3b73", "simplify": False}},
          label=_label("smoothed")),
    Trace("eval loss", LOSS, _eval_loss,
          {"mode": "markers", "marker": {"size": 9, "symbol": "diamond", "color": "#d62728"}},
          label=_label("eval")),
    Trace("segment starts", LOSS, _segment_starts,
          {"mode": "markers", "marker": {"size": 11, "symbol": "triangle-right",
                                         "color": "#ff7f0e"}},
          label=_label("--continue"), visible=_continued),
    Trace("throughput", THROUGHPUT, _rate, {"mode": "lines", "line": FAINT},
          label=_label("per step")),
    Trace("throughput (smoothed)", THROUGHPUT, _smoothed_rate,
          {"mode": "lines", "line": {"width": 2.5, "color": "#2ca02c"}}, label=_label("smoothed")),
    *(Trace(kind, MEMORY, partial(_per_engine, key=keys.memory(kind), missing=0.0),
            {"marker_color": colour}, go.Bar)
      for kind, colour in zip(keys.MEMORY_KINDS, MEMORY_COLOURS)),
    Trace("device peak (CUDA)", MEMORY, partial(_per_engine, key=keys.MEMORY_DEVICE_PEAK),
          _marks("#333"), label=_label("CUDA peak"), visible=_cuda),
    Trace("device capacity (CUDA)", MEMORY,
          partial(_per_engine, key=keys.MEMORY_DEVICE_CAPACITY), _marks("#d62728"),
          label=_label("capacity"), visible=_cuda),
    Trace("offloaded activations", MEMORY, partial(_per_engine, key=keys.MEMORY_OFFLOADED),
          _marks("#b279a2"), label=_label("activations on host"), visible=_offloads),
    Trace("memory headroom", MEMORY, _memory_headroom, INVISIBLE),
    Trace("compute (s)", STEP_TIME, lambda s: s.per_step(s.columns.busy),
          {"mode": "lines", "stackgroup": "t", "line": {"color": "#4C78A8"}},
          label=_label("compute")),
    Trace("idle / bubble (s)", STEP_TIME, lambda s: s.per_step(s.columns.idle),
          {"mode": "lines", "stackgroup": "t", "line": {"color": "#E45756"}},
          label=_label("bubble"),
          visible=pipelined),  # always zero without a pipeline: a red line along the top
    Trace("forward", SCHEDULE, lambda s: s.timeline["F"], _gantt(FORWARD), go.Bar),
    Trace("backward", SCHEDULE, lambda s: s.timeline["B"], _gantt(BACKWARD), go.Bar,
          label=lambda board: "input gradient" if _splits_backward(board) else "backward"),
    Trace("weight gradient", SCHEDULE, lambda s: s.timeline["W"], _gantt(WEIGHT), go.Bar,
          visible=_splits_backward),
    Trace("tokens per expert", EXPERTS, _expert_counts, {"marker_color": "#4C78A8"}, go.Bar,
          label=_label("routed")),
    Trace("even share", EXPERTS, partial(_expert_counts, even=True),
          {"mode": "lines", "line": {"color": "#d62728", "dash": "dash"}}, label=_label("even")),
    Trace("learning rate", OPTIMIZER, partial(_row_value, key=keys.LR),
          {"mode": "lines", "line": {"color": "#9467bd"}}, label=_label("lr")),
    Trace("gradient norm", OPTIMIZER, partial(_row_value, key=keys.GRAD_NORM),
          {"mode": "lines", "line": {"color": "#17becf"}}, label=_label("grad norm"),
          visible=_clips),
    Trace("on-demand", COST, partial(_cost, spot=False),
          {"mode": "lines", "line": {"color": "#8c564b"}}),
    Trace("spot", COST, partial(_cost, spot=True),
          {"mode": "lines", "line": {"color": "#8c564b", "dash": "dot"}},
          label=lambda b: f"spot ({b.cost.spot_discount:.0%} off)"),
)  # fmt: skip


def _replica_trace(r: int) -> Trace:
    """One line per replica, under one legend entry ("replicas") that shows or hides all."""
    colour = REPLICA_COLOURS[r % len(REPLICA_COLOURS)]
    style = {
        "mode": "lines",
        "line": {"width": 1, "color": colour, "simplify": False},
        "legendgroup": "replicas",
        "showlegend": r == 0,
        "hovertemplate": f"replica {r}: %{{y:.4g}}<extra>step %{{x}}</extra>",
    }
    return Trace(f"replica {r} loss", LOSS, partial(_replica, r=r), style, label=_label("replicas"))


def traces(board: Board) -> tuple[Trace, ...]:
    """Every trace of this run's figure, in drawing order: a loss line per replica (the same
    number from the first draw to the last), then those of TRACES in this run's panels. The
    figure and every redraw take them from here."""
    replicas = board.config.replicas(board.engines)
    shown = panels(board)
    return tuple(_replica_trace(r) for r in range(replicas)) + tuple(
        t for t in TRACES if t.panel in shown
    )


def trace_data(
    board: Board, panels: Collection[Panel] | None = None, points: int = MAX_POINTS
) -> dict[str, dict[str, Any]]:
    """Every trace's data (or those of `panels`), by name, from the list the figure is built
    from; each line thinned to ~`points` (the live drawing shows svg_figure.MAX_POINTS)."""
    snap = Snapshot(board, points)
    return {
        trace.name: trace.data(snap)
        for trace in traces(board)
        if panels is None or trace.panel in panels
    }


def axis_titles(board: Board) -> dict[str, str]:
    """Each shown panel's axis titles by plotly's axis name ('x2', 'y2'), as `figure` sets
    them. A live drawing takes them at every redraw: the throughput's unit (samples/s, or
    tokens/s) is known only once the first metrics say whether the inputs are token ids,
    after the figure was first drawn (issue 35: the axis said samples/s over tokens/s)."""
    shown = panels(board)
    cols = max(p.col for p in shown)
    out: dict[str, str] = {}
    for panel in shown:
        number = (panel.row - 1) * cols + panel.col  # make_subplots numbers row by row
        suffix = "" if number == 1 else str(number)
        for axis, text in (("x", panel.x), ("y", panel.y)):
            if text is not None:
                out[axis + suffix] = _text(text, board)
    return out


#: x domains of the two columns of panels, each followed by its panels' legends: at 700 px
#: wide a legend column is ~95 px, and the right column's y-axis ticks and title keep ~50 px
#: clear of the left column's legends (issue 17: they ran into the neighbouring plot)
COLUMNS = ((0.0, 0.3), (0.56, 0.86))
LEGEND_GAP = 0.012
HEADER_LINE = 95  # characters of the header per line of the figure's title (~700 px at 12 px)


#: the figure's top margin: room for the header as its title, or for the panels' titles alone
#: when the header is HTML above the figure (the notebook's dashboards)
TOP_WITH_HEADER, TOP = 110, 40


def figure(board: Board, *, header: bool = True) -> go.Figure:
    """The whole dashboard as one plotly figure, the header as its title; `header=False`: no
    title and no room for it (the notebook shows the header as HTML above the figure)."""
    shown = panels(board)
    fig = make_subplots(
        rows=max(p.row for p in shown),
        cols=max(p.col for p in shown),
        vertical_spacing=0.1,
        subplot_titles=[_text(p.title, board) for p in shown],
    )
    snap = Snapshot(board)
    legends = {panel: "legend" if i == 0 else f"legend{i + 1}" for i, panel in enumerate(shown)}
    for trace in traces(board):
        panel = trace.panel
        fig.add_trace(trace.build(board, snap, legends[panel]), panel.row, panel.col)
    for i, panel in enumerate(shown):
        _place(fig, board, panel, legends[panel], fig.layout.annotations[i])
    top = TOP_WITH_HEADER if header else TOP
    fig.update_layout(
        barmode="stack",
        height=850 + top,
        template="plotly_white",
        margin={"l": 55, "r": 10, "t": top, "b": 40},
        font={"size": 11},
    )
    if header:
        fig.update_layout(
            title={"text": wrap_header(board.header_text()), "font": {"size": 12}, "y": 0.985}
        )
    return fig


def _place(fig: go.Figure, board: Board, panel: Panel, legend: str, title: Any) -> None:
    """Axes, title and legend of one panel: the plot in its column, the legend beside it."""
    left, right = COLUMNS[panel.col - 1]
    kwargs = {"row": panel.row, "col": panel.col}
    x = {} if panel.x is None else {"title_text": _text(panel.x, board)}
    fig.update_xaxes(domain=[left, right], title_standoff=4, **x, **kwargs)
    y = {} if panel.y is None else {"title_text": _text(panel.y, board)}
    fig.update_yaxes(title_standoff=2, **y, **panel.yaxis, **kwargs)
    top = fig.get_subplot(panel.row, panel.col).yaxis.domain[1]
    title.update(x=(left + right) / 2)
    fig.update_layout(
        {
            legend: {
                "x": right + LEGEND_GAP,
                "y": top,
                "xanchor": "left",
                "yanchor": "top",
                "orientation": "v",
                "font": {"size": 10},
                "tracegroupgap": 2,
                "bgcolor": "rgba(0,0,0,0)",
            }
        }
    )


def wrap_header(text: str, width: int = HEADER_LINE) -> str:
    """The header as the figure's title, broken into lines at its " | " separators (plotly
    does not wrap a title: at 700 px the one-line header was cut)."""
    lines: list[str] = []
    for part in text.split(" | "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " | " + part
        else:
            lines.append(part)
    return "<br>".join(html.escape(line) for line in lines)
