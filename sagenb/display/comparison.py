"""Several finished runs side by side (issue 17: teaching is comparing): `sagenb.compare`.

One plotly figure of five panels drawn from the runs' results alone (history, metrics, cost),
so it works for runs trained with or without a dashboard, failed or interrupted ones included:
loss against step and against wall time, throughput, memory per engine by kind (the last
step's, as the dashboard's memory panel) and what each run cost. Each run is labelled by its
layout (dashboard.layout_text: 'data parallel on 2 engines', 'sharded (ZeRO-3) on 2 engines'),
so the legend says what differs.

TensorBoard's runs view is the model: one colour per run across every chart
(https://www.tensorflow.org/tensorboard/get_started), but the memory panel's, whose colours are
the kinds of memory, as on the dashboard (each run's bars stand over its name). Wall time is
measured from submitting the run, as `TrainResult.wall_time_s` is: a run that waits longer for
its first step starts later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sagenb.display.charts import MEMORY_COLOURS
from sagenb.display.step_columns import smoothed, smoothing_for
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.metrics.result import TrainResult

__all__ = ["compare", "labels"]

COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D")


def labels(results: Sequence[TrainResult]) -> list[str]:
    """Each run's layout; runs of the same layout are told apart by their order ('#2')."""
    from sagenb.display.dashboard import layout_text

    texts = [layout_text(r.config) for r in results]
    return [
        f"{t} #{texts[:i].count(t) + 1}" if texts.count(t) > 1 else t for i, t in enumerate(texts)
    ]


def _elapsed(result: TrainResult) -> list[float]:
    """Seconds from the run's submission to the end of each history row's step: the first
    step at its time to first step, the others by the clock of the engines ("time(unix s)",
    the slowest rank's)."""
    ends: dict[int, float] = {}
    for rec in result.metrics:
        if keys.TIME in rec.values:
            ends[rec.step] = max(ends.get(rec.step, 0.0), rec.values[keys.TIME])
    steps = [row[keys.STEP] for row in result.history]
    if not steps or any(s not in ends for s in steps):  # no clock: add up the step times
        total, out = result.time_to_first_step_s, []
        for i, row in enumerate(result.history):
            total += row[keys.STEP_TIME] if i else 0.0
            out.append(total)
        return out
    first = ends[steps[0]]
    return [result.time_to_first_step_s + ends[s] - first for s in steps]


def _memory(result: TrainResult) -> dict[int, dict[str, float]]:
    """Each rank's memory by kind at its last reported step (MiB)."""
    last: dict[int, dict[str, float]] = {}
    for rec in result.metrics:
        last[rec.rank] = {k: rec.values.get(keys.memory(k), 0.0) for k in keys.MEMORY_KINDS}
    return dict(sorted(last.items()))


def _rate_key(result: TrainResult) -> str:
    rows = result.history
    return keys.TOKEN_THROUGHPUT if rows and keys.TOKEN_THROUGHPUT in rows[0] else keys.THROUGHPUT


class ComparisonFigure(go.Figure):
    """The comparison's plotly figure, shown in a notebook as an inline SVG drawn in Python
    (svg_figure.to_svg, as a finished dashboard is): a saved notebook stays small and renders
    with no network and no plotly.js. `.show()` draws the interactive figure."""

    def _repr_mimebundle_(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        from sagenb.display.svg_figure import to_svg

        return {"text/html": f"<div class='smp-static-copy'>{to_svg(self)}</div>"}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)


def compare(*results: TrainResult, names: Sequence[str] | None = None) -> go.Figure:
    """Runs side by side: loss per step and over wall time, smoothed throughput, memory per
    engine by kind, and cost (on-demand, as each run was priced). `names` replaces the
    layouts as labels."""
    if not results:
        raise ValueError("compare() needs at least one TrainResult: compare(run_a, run_b)")
    if names is not None and len(names) != len(results):
        raise ValueError(f"compare(): {len(names)} names for {len(results)} runs")
    runs = list(zip(names or labels(results), results))
    fig = make_subplots(
        rows=3,
        cols=2,
        specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None]],
        subplot_titles=(
            "Loss per step",
            "Loss over wall time",
            f"Throughput ({keys.unit(_rate_key(results[0]))}, smoothed)",
            _cost_title(results),
            "Memory per engine, last step (MiB)",  # placed left: its legend is on the right
        ),
        vertical_spacing=0.12,
        horizontal_spacing=0.1,
    )
    for i, (name, result) in enumerate(runs):
        _add_run(fig, i, name, result)
    _add_memory(fig, runs)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="seconds since the run was submitted", row=1, col=2)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=2)
    fig.update_xaxes(tickfont={"size": 10}, row=3, col=1)
    memory_top = fig.get_subplot(3, 1).yaxis.domain[1]
    fig.layout.annotations[4].update(x=0, xanchor="left")
    fig.update_layout(
        template="plotly_white",
        height=900,
        barmode="stack",
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        # the runs above every panel; the kinds of memory beside the memory panel's title
        legend={"orientation": "h", "y": 1.02, "x": 0, "yanchor": "bottom"},
        legend2={"orientation": "h", "y": memory_top, "x": 1, "xanchor": "right",
                 "yanchor": "bottom", "font": {"size": 10}},
    )  # fmt: skip
    _headroom(fig, [r.cost_usd for r in results], 2, 2)
    _headroom(fig, [sum(m.values()) for r in results for m in _memory(r).values()], 3, 1)
    return ComparisonFigure(fig)


def _cost_title(results: Sequence[TrainResult]) -> str:
    """What the cost bars' dollars are, as the dashboard's cost panel says it: what the runs
    cost only where their engines ran on the instance's kind of hardware; else their measured
    seconds at its price (a CPU's seconds at a GPU instance's price: a what-if, not a cost)."""
    if all(r.billed for r in results):
        return "Cost (USD)"
    return (
        "Seconds at the instances' prices (USD)<br><span style='font-size:10px'>not what "
        "these runs cost: their engines are not the priced hardware</span>"
    )


def _headroom(fig: go.Figure, values: list[float], row: int, col: int) -> None:
    """Bars end below the top of their axis (issue 17: they touched it)."""
    finite = [v for v in values if v == v]  # NaN: a cost the meter could not compute
    if finite and max(finite) > 0:
        fig.update_yaxes(range=[0, 1.2 * max(finite)], row=row, col=col)


def _add_run(fig: go.Figure, i: int, name: str, result: TrainResult) -> None:
    colour = COLOURS[i % len(COLOURS)]
    steps = [row[keys.STEP] for row in result.history]
    line = {"mode": "lines", "line": {"color": colour}, "legendgroup": name}
    fig.add_trace(go.Scatter(x=steps, y=result.losses, name=name, **line), 1, 1)
    fig.add_trace(
        go.Scatter(x=_elapsed(result), y=result.losses, name=name, showlegend=False, **line), 1, 2
    )
    rates = [row.get(_rate_key(result), 0.0) for row in result.history]
    rate = smoothed(rates, smoothing_for(len(rates)))
    fig.add_trace(go.Scatter(x=steps, y=rate, name=name, showlegend=False, **line), 2, 1)
    fig.add_trace(
        go.Bar(
            x=[name],
            y=[result.cost_usd],
            name=name,
            marker_color=colour,
            showlegend=False,
            legendgroup=name,
            text=[result.cost_label],
            textposition="inside",
            hovertemplate=f"{result.cost_label}<extra>{name}</extra>",
        ),
        2,
        2,
    )
    fig.update_xaxes(showticklabels=False, row=2, col=2)


def _add_memory(fig: go.Figure, runs: list[tuple[str, TrainResult]]) -> None:
    """One stacked bar per engine of every run, grouped by run on a two-level axis (the run's
    name under its engines' bars), the kinds stacked and coloured as on the dashboard's memory
    panel. A colour per kind, not per run (issue 35: in the run's colour, the four kinds of a
    run looked one, and the legend showed four squares of one colour); the runs are told apart
    by where their bars stand and the names under them."""
    for kind, colour in zip(keys.MEMORY_KINDS, MEMORY_COLOURS):
        for i, (name, result) in enumerate(runs):
            memory = _memory(result)
            fig.add_trace(
                go.Bar(
                    x=[[name] * len(memory), [f"engine {r}" for r in memory]],
                    y=[m[kind] for m in memory.values()],
                    name=kind,
                    legend="legend2",
                    legendgroup=kind,
                    showlegend=i == 0,
                    marker={"color": colour, "line": {"color": "white", "width": 1}},
                    hovertemplate=f"{kind}: %{{y:.2f}} MiB<extra>{name}</extra>",
                ),
                3,
                1,
            )
    fig.update_xaxes(tickfont={"size": 10}, row=3, col=1)
