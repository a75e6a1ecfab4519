"""Notebook 02's bubble lab: a pipeline's measured idle share against the formula, and its
peak activations, over microbatches, schedules and partitions.

`measure(result)` reads one pipeline run (`sagenb.train(..., strategy="model")`): each rank's
forwards and backwards of every step from the timelines the engines report, and each rank's
peak saved activations. `table` prints the points, `figure` draws them (plotly, shown as an
inline SVG like the finished dashboard). Notebook-side: it reads results, never runs on an
engine.

Why the timelines and not `idle(s)` alone: a rank's `idle(s)` is its step from the moment it
entered the schedule to its own last event, less its forwards and backwards
(engine/strategies/pipeline/strategy.py). The formula's bubble, (p - 1) / (v m + p - 1)
(Huang et al. 2019, GPipe, section 2.2; Narayanan et al. 2021, section 2.2, for v virtual
stages), is each stage's idle time over the whole schedule, from the first forward on any
stage to the last backward on any stage: the last stage's wait after its last backward, while
the first stages finish theirs, is in the formula and not in that stage's `idle(s)`. The
timelines carry wall-clock times (`timeline_t0(unix s)` plus each event's offset) that line up
across the engines of one machine, so the span is measured the formula's way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sagenb.engine.strategies.pipeline import SCHEDULES, PipelineOptions, schedule_bubble
from sagenb.metrics import keys
from sagenb.metrics.stream import StepMetrics

__all__ = ["LabPoint", "measure", "span_idle_share", "table", "figure", "smallest_m"]

COLOURS = {
    "gpipe": "#4C78A8",
    "1f1b": "#E45756",
    "interleaved": "#54A24B",
    "looped-bfs": "#B279A2",
    "zero-bubble": "#F58518",
    "zbv": "#72B7B2",
    "dualpipev": "#9D755D",
}


@dataclass(frozen=True)
class LabPoint:
    """One (partitions, schedule, microbatches) of the sweep and what it measured."""

    partitions: int
    schedule: str
    microbatches: int
    virtual: int  # model chunks per engine: --virtual-stages where the schedule holds several
    #: mean over the ranks of idle / span, the span from the first forward to the last
    #: backward of any rank, summed over the measured steps
    idle_share: float
    #: peak saved activations per rank at the last step, MiB
    activations: dict[int, float] = field(default_factory=dict)

    @property
    def formula(self) -> float:
        """The schedule's bubble on equal stages: (p - 1) / (v m + p - 1) for GPipe, 1F1B and
        interleaved; the others' own orders, run on equal stages (schedule_bubble)."""
        return schedule_bubble(self.schedule, self.partitions, self.microbatches, self.virtual)


def span_idle_share(metrics: Iterable[StepMetrics], *, skip: int = 1) -> dict[int, float]:
    """Each rank's idle share of the pipeline's span, over the steps after the first `skip`
    (warm-up): per step the span runs from the earliest forward of any rank to the latest
    backward of any rank, and a rank is idle for the span less its own forwards and
    backwards; idle and span are summed over the steps, then divided."""
    steps: dict[int, dict[int, list[tuple[float, float]]]] = {}
    for m in metrics:
        if keys.TIMELINE not in m.values or m.step <= skip:
            continue
        t0 = m.values[keys.TIMELINE_T0]
        events = [(t0 + e[3], t0 + e[4]) for e in m.values[keys.TIMELINE]]
        steps.setdefault(m.step, {})[m.rank] = events
    if not steps:
        raise ValueError(f"no pipeline step after the first {skip} reported a {keys.TIMELINE}")
    idle: dict[int, float] = {}
    span: dict[int, float] = {}
    for ranks in steps.values():
        every = [e for events in ranks.values() for e in events]
        length = max(end for _, end in every) - min(start for start, _ in every)
        for rank, events in ranks.items():
            busy = sum(end - start for start, end in events)
            idle[rank] = idle.get(rank, 0.0) + max(0.0, length - busy)
            span[rank] = span.get(rank, 0.0) + length
    return {rank: idle[rank] / span[rank] for rank in sorted(idle) if span[rank] > 0}


def measure(result: Any, *, skip: int = 1) -> LabPoint:
    """The point of one finished pipeline run (a sagenb TrainResult)."""
    pipe = PipelineOptions.of(result.config)
    shares = span_idle_share(result.metrics, skip=skip)
    key = keys.MEMORY_ACTIVATIONS
    last = max(m.step for m in result.metrics if key in m.values)
    activations = {
        m.rank: float(m.values[key]) for m in result.metrics if m.step == last and key in m.values
    }
    return LabPoint(
        partitions=pipe.partitions,
        schedule=pipe.schedule,
        microbatches=pipe.microbatches,
        virtual=pipe.chunks,
        idle_share=sum(shares.values()) / len(shares),
        activations=dict(sorted(activations.items())),
    )


def table(points: Sequence[LabPoint]) -> str:
    """One line per point: p, schedule, m, v, the formula, the measured share and the peak
    activations of stage 0 and of the last rank."""
    lines = [" p  schedule     m  v  formula  measured  activations MiB (rank 0 .. last)"]
    for pt in points:
        head = f"{pt.partitions:>2}  {pt.schedule:<11} {pt.microbatches:>2}  {pt.virtual}"
        acts = " ".join(f"{a:6.2f}" for a in pt.activations.values())
        lines.append(f"{head}  {pt.formula:7.0%}  {pt.idle_share:8.0%}  {acts}")
    return "\n".join(lines)


def smallest_m(
    points: Sequence[LabPoint], *, partitions: int, schedule: str, below: float
) -> int | None:
    """The smallest m of the sweep whose measured idle share is under `below`; None when
    none is."""
    ran = [pt for pt in points if (pt.partitions, pt.schedule) == (partitions, schedule)]
    under = [pt.microbatches for pt in ran if pt.idle_share < below]
    return min(under) if under else None


class LabFigure(go.Figure):
    """Shown in a notebook as an inline SVG drawn in Python (display/svg_figure.py), as the
    finished dashboard is; `.show()` draws the interactive figure."""

    def _repr_mimebundle_(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        from sagenb.display.svg_figure import to_svg

        return {"text/html": f"<div class='smp-static-copy'>{to_svg(self)}</div>"}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)


def figure(points: Sequence[LabPoint], *, where: str = "this machine's CPU") -> go.Figure:
    """Top: the measured idle share (solid) against the formula (dotted), one panel per p.
    Bottom: the peak saved activations of stage 0 (the most of any rank under GPipe and
    1F1B). x: the microbatches, as categories 1, 2, 4, ..."""
    ps = sorted({pt.partitions for pt in points})
    fig = LabFigure(
        make_subplots(
            rows=2,
            cols=len(ps),
            subplot_titles=[f"idle share, p = {p}: {where} (solid), formula (dotted)" for p in ps]
            + [f"peak saved activations of rank 0, p = {p} (MiB)" for p in ps],
            vertical_spacing=0.16,
        )
    )
    ms = [str(m) for m in sorted({pt.microbatches for pt in points})]
    for col, p in enumerate(ps, start=1):
        for schedule in SCHEDULES:
            mine = [pt for pt in points if (pt.partitions, pt.schedule) == (p, schedule)]
            if mine:
                _add_schedule(fig, col, schedule, sorted(mine, key=lambda pt: pt.microbatches))
        fig.update_yaxes(title_text="idle / span", rangemode="tozero", row=1, col=col)
        fig.update_yaxes(title_text="MiB", rangemode="tozero", row=2, col=col)
        fig.update_xaxes(categoryorder="array", categoryarray=ms, row=1, col=col)
        fig.update_xaxes(title_text="microbatches m", row=2, col=col)
    fig.update_layout(
        height=620,
        template="plotly_white",
        legend={"orientation": "h", "x": 0, "y": 1.08, "yanchor": "bottom"},
        margin={"t": 90},
    )
    return fig


def _add_schedule(fig: LabFigure, col: int, schedule: str, ran: Sequence[LabPoint]) -> None:
    """One schedule's three lines in column `col`: its formula (dotted) and measured idle
    share on top, rank 0's peak saved activations below; in the legend once (column 1)."""
    colour = COLOURS[schedule]
    x = [str(pt.microbatches) for pt in ran]
    lines: tuple[tuple[int, list[Any], str, dict[str, str], str | None, bool], ...] = (
        (1, [pt.formula for pt in ran], "lines", {"dash": "dot"}, f"{schedule}: formula", False),
        (1, [pt.idle_share for pt in ran], "lines+markers", {}, schedule, col == 1),
        (2, [pt.activations.get(0) for pt in ran], "lines+markers", {}, None, False),
    )
    for row, y, mode, dash, name, legend in lines:
        trace = go.Scatter(
            x=x, y=y, mode=mode, line={"color": colour, **dash}, name=name, showlegend=legend
        )
        fig.add_trace(trace, row, col)
