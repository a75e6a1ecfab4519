"""A plotly figure drawn as one small inline SVG, by Python: the dashboard's finished copy.

Why not plotly.js: an executed notebook's static copy must render with no network and no
kernel (issue 17), and plotly.min.js weighs 4.6 MB, which a notebook would have to carry once
per notebook (a JupyterLab output is rendered on its own, so a later output cannot count on an
earlier one's script), over the budget of ~300 KB per dashboard. An SVG of the same figure is
20-150 KB, renders in nbconvert's HTML, in JupyterLab without a kernel (its sanitizer keeps
SVG, drops scripts) and on GitHub.

It draws from the figure the live chart shows (charts.figure): every trace of the spec, whatever
traces and panels it holds, found by the axes plotly assigned it. Handled: scatter lines and
markers (stackgroup stacked), vertical bars (stacked, categorical x), horizontal bars with a
base (the pipeline schedule), reversed and hidden axes, subplot titles and axis titles, and a
legend per panel. Not drawn: hover text, annotations other than titles and placeholders.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["to_svg", "thin", "MAX_POINTS"]

MAX_POINTS = 500  # points per line in the static copy: 1000 px wide panels show no more
WIDTH = 1000
FONT = "font-family='Open Sans, Arial, sans-serif'"


def _esc(text: Any) -> str:
    return html.escape(str(text).replace("<br>", " "), quote=True)


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}"


def thin(xs: Sequence, ys: Sequence) -> tuple[list, list]:
    n = len(xs)
    if n <= MAX_POINTS:
        return list(xs), list(ys)
    k = math.ceil(n / MAX_POINTS)
    idx = list(range(0, n, k))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _colour(trace: Any) -> str:
    marker = trace.marker.color if trace.marker is not None else None
    line = getattr(trace, "line", None)
    colour = (line.color if line is not None else None) or marker
    return colour if isinstance(colour, str) else "#555"


class _Axis:
    """One axis of a subplot: its pixel span, its data range (numeric or categories)."""

    def __init__(self, name: str, spec: Any, start: float, end: float) -> None:
        self.name, self.spec, self.start, self.end = name, spec, start, end
        self.categories: list[str] = []
        self.lo, self.hi = math.inf, -math.inf
        #: a log axis (the learning rate and gradient norm) is laid out in log10 of its values
        self.log = spec.type == "log"

    def add(self, values: Iterable[Any]) -> None:
        for v in values:
            if isinstance(v, str):
                if v not in self.categories:
                    self.categories.append(v)
            elif v is not None and math.isfinite(v) and not (self.log and v <= 0):
                v = math.log10(v) if self.log else v
                self.lo, self.hi = min(self.lo, v), max(self.hi, v)

    def settle(self) -> None:
        if self.categories:
            self.lo, self.hi = -0.5, len(self.categories) - 0.5
            return
        if not math.isfinite(self.lo):
            self.lo, self.hi = 0.0, 1.0
        if (self.spec.rangemode or "normal") == "tozero" and not self.log:
            self.lo, self.hi = min(0.0, self.lo), max(0.0, self.hi)
        pad = (self.hi - self.lo) * 0.05 or abs(self.hi) * 0.1 or 1.0
        self.lo -= 0 if self.lo == 0 else pad
        self.hi += pad

    def px(self, v: Any) -> float:
        value = self.categories.index(v) if isinstance(v, str) else float(v)
        if self.log:
            value = math.log10(value) if value > 0 else self.lo
        share = (value - self.lo) / (self.hi - self.lo)
        if self.spec.autorange == "reversed":
            share = 1 - share
        return round(self.start + share * (self.end - self.start), 1)

    def ticks(self) -> list[tuple[float, str]]:
        if self.categories:
            return [(self.px(c), c) for c in self.categories]
        if self.log:  # a tick at each power of ten in range
            powers = range(math.ceil(self.lo), math.floor(self.hi) + 1)
            if len(powers) < 2:  # less than a decade: its ends
                return [(self.px(10.0**e), _fmt(10.0**e)) for e in (self.lo, self.hi)]
            return [(self.px(10.0**k), f"1e{k}") for k in powers]
        return [(self.px(t), _fmt(t)) for t in _nice_ticks(self.lo, self.hi)]


def _values(trace: Any, key: str) -> list:
    values = getattr(trace, key, None)
    if values is None:
        return []
    values = list(values)
    if values and isinstance(values[0], (list, tuple)):  # plotly's multi-category axis
        return [" ".join(map(str, level)) for level in zip(*values)]
    return values


def _stacked(fig: Any) -> dict[int, tuple[list, list]]:
    """Per trace index: (x, y) after stacking, as plotly stacks them: bars in barmode 'stack'
    (per category, in trace order; a bar's base is where the last one ended) and scatter
    traces of one stackgroup (per point index)."""
    out: dict[int, tuple[list, list]] = {}
    bar_tops: dict[tuple, float] = {}
    group_tops: dict[tuple, list[float]] = {}
    stack_bars = fig.layout.barmode == "stack"
    for i, trace in enumerate(fig.data):
        x, y = _values(trace, "x"), _values(trace, "y")
        if trace.type == "bar" and trace.orientation != "h" and stack_bars:
            bases = [bar_tops.get((trace.xaxis, trace.yaxis, c), 0.0) for c in x]
            for c, b, v in zip(x, bases, y):
                bar_tops[(trace.xaxis, trace.yaxis, c)] = b + (v or 0.0)
            out[i] = (x, [(b, b + (v or 0.0)) for b, v in zip(bases, y)])
        elif trace.type == "scatter" and trace.stackgroup:
            key = (trace.xaxis, trace.yaxis, trace.stackgroup)
            below = group_tops.get(key, [0.0] * len(y))
            tops = [b + v for b, v in zip(below, y)]
            group_tops[key] = tops
            out[i] = (x, list(zip(below, tops)))
        else:
            out[i] = (x, y)
    return out


def _axes(fig: Any, height: int) -> dict[str, _Axis]:
    """Every axis by plotly's short name ('x3', 'y3'), placed by its domain."""
    margin = fig.layout.margin
    left, right = margin.l or 60, WIDTH - (margin.r or 20)
    top, bottom = margin.t or 60, height - (margin.b or 40)
    axes = {}
    for key in fig.layout:
        if key.startswith(("xaxis", "yaxis")):
            spec, name = fig.layout[key], key.replace("axis", "")
            d0, d1 = spec.domain or (0, 1)
            if name.startswith("x"):
                span = (left + d0 * (right - left), left + d1 * (right - left))
            else:
                span = (bottom - d0 * (bottom - top), bottom - d1 * (bottom - top))
            axes[name] = _Axis(name, spec, *span)
    return axes


def _trace_svg(trace: Any, xs: list, ys: list, xa: _Axis, ya: _Axis, colour: str) -> str:
    """One trace's shapes, tagged class='trace' with its name and its panel's axes
    (data-axes='x3y3', plotly's names) for tests and readers."""
    parts = []
    tag = f"data-name='{_esc(trace.meta)}' data-axes='{trace.xaxis or 'x'}{trace.yaxis or 'y'}'"
    if trace.type == "bar":
        horizontal = trace.orientation == "h"
        base = _values(trace, "base") or [0.0] * len(xs)
        for j, (x, y) in enumerate(zip(xs, ys)):
            if horizontal:  # the schedule: x is a duration from `base`, y a category
                x0, x1 = xa.px(base[j]), xa.px(base[j] + x)
                yc, h = ya.px(y), 0.7 * abs(ya.end - ya.start) / max(1, len(ya.categories))
                parts.append(
                    f"<rect x='{min(x0, x1)}' y='{yc - h / 2:.1f}' "
                    f"width='{abs(x1 - x0):.1f}' height='{h:.1f}'/>"
                )
            else:
                y0, y1 = y if isinstance(y, tuple) else (0.0, y or 0.0)
                xc = xa.px(x)
                w = 0.6 * abs(xa.end - xa.start) / max(1, len(xa.categories))
                top, low = ya.px(y1), ya.px(y0)
                parts.append(
                    f"<rect x='{xc - w / 2:.1f}' y='{min(top, low)}' "
                    f"width='{w:.1f}' height='{abs(low - top):.1f}'/>"
                )
        body = "".join(parts)
        return f"<g class='trace bar' {tag} fill='{colour}'>{body}</g>"
    tops = [y[1] if isinstance(y, tuple) else y for y in ys]
    xs, tops = thin(xs, tops)
    points = [(xa.px(x), ya.px(y)) for x, y in zip(xs, tops) if y is not None and math.isfinite(y)]
    mode = trace.mode or "lines"
    dash = "stroke-dasharray='4 3'" if trace.line and trace.line.dash == "dot" else ""
    width = trace.line.width if trace.line and trace.line.width else 1.5
    if "lines" in mode and points:
        d = "M" + "L".join(f"{x},{y}" for x, y in points)
        parts.append(
            f"<path class='js-line' d='{d}' fill='none' stroke='{colour}' "
            f"stroke-width='{width}' {dash}/>"
        )
    if "markers" in mode:
        size = 3 if trace.marker.symbol == "line-ew-open" else (trace.marker.size or 6) / 2
        for x, y in points:
            if trace.marker.symbol == "line-ew-open":
                parts.append(
                    f"<line x1='{x - 12}' x2='{x + 12}' y1='{y}' y2='{y}' "
                    f"stroke='{colour}' stroke-width='{size}'/>"
                )
            else:
                parts.append(f"<circle cx='{x}' cy='{y}' r='{size}' fill='{colour}'/>")
    return f"<g class='trace scatter' {tag}>{''.join(parts)}</g>"


def _axis_svg(xa: _Axis, ya: _Axis) -> str:
    out = []
    if xa.spec.visible is not False:
        out.append(
            f"<line x1='{xa.start}' x2='{xa.end}' y1='{ya.start}' y2='{ya.start}' stroke='#bbb'/>"
        )
        for px, text in xa.ticks():
            out.append(
                f"<text class='{xa.name}tick' x='{px}' y='{ya.start + 14}' "
                f"text-anchor='middle'>{_esc(text)}</text>"
            )
        if xa.spec.title and xa.spec.title.text:
            out.append(
                f"<text x='{(xa.start + xa.end) / 2}' y='{ya.start + 30}' "
                f"text-anchor='middle'>{_esc(xa.spec.title.text)}</text>"
            )
    if ya.spec.visible is not False:
        for px, text in ya.ticks():
            out.append(f"<line x1='{xa.start}' x2='{xa.end}' y1='{px}' y2='{px}' stroke='#eee'/>")
            out.append(
                f"<text x='{xa.start - 4}' y='{px + 4}' text-anchor='end'>{_esc(text)}</text>"
            )
        if ya.spec.title and ya.spec.title.text:
            mid = (ya.start + ya.end) / 2
            out.append(
                f"<text transform='translate({xa.start - 45},{mid}) rotate(-90)' "
                f"text-anchor='middle'>{_esc(ya.spec.title.text)}</text>"
            )
    return "".join(out)


def _paper(fig: Any, height: int) -> tuple[float, float, float, float]:
    """left, right, top, bottom of plotly's paper (the area inside the margins), in px."""
    margin = fig.layout.margin
    return margin.l or 60, WIDTH - (margin.r or 20), margin.t or 60, height - (margin.b or 40)


def _legend_svg(entries: list[tuple[str, str]], spec: Any, paper: tuple[float, ...]) -> str:
    """One legend where the layout puts it, anchored as plotly anchors it: a column of entries
    (each panel's, beside its plot, as charts.py places them) or a row (orientation 'h', as
    compare() puts the runs above its panels)."""
    left, right, top, bottom = paper
    x0 = left + (spec.x if spec.x is not None else 1.02) * (right - left)
    y0 = bottom - (spec.y if spec.y is not None else 1.0) * (bottom - top)
    widths = [14 + 5.5 * len(name) + 10 for name, _ in entries]  # 10 px type: ~5.5 px a letter
    row = spec.orientation == "h"
    width = sum(widths) if row else max(widths, default=0)
    height = 13 if row else 13 * len(entries)
    x0 -= {"right": width, "center": width / 2}.get(spec.xanchor or "left", 0)
    y0 -= {"bottom": height, "middle": height / 2}.get(spec.yanchor or "top", 0)
    out = []
    for j, (name, colour) in enumerate(entries):
        x, y = (x0 + sum(widths[:j]), y0 + 10) if row else (x0, y0 + 10 + 13 * j)
        out.append(
            f"<rect x='{x:.1f}' y='{y - 8}' width='10' height='8' fill='{colour}'/>"
            f"<text x='{x + 14:.1f}' y='{y}'>{_esc(name)}</text>"
        )
    return "".join(out)


def _transparent(trace: Any) -> bool:
    """A trace drawn with opacity 0 (charts.py's memory headroom): data, never ink."""
    marker = getattr(trace, "marker", None)
    return trace.opacity == 0 or (
        getattr(trace, "mode", None) == "markers" and marker is not None and marker.opacity == 0
    )


def to_svg(fig: Any) -> str:
    """The figure as one <svg> element (scales to its container's width)."""
    height = int(fig.layout.height or 900)
    axes = _axes(fig, height)
    stacked = _stacked(fig)
    visible = [i for i, t in enumerate(fig.data) if t.visible is not False]
    drawn = [i for i in visible if not _transparent(fig.data[i])]
    for i in visible:
        trace, (xs, ys) = fig.data[i], stacked[i]
        xa, ya = axes[trace.xaxis or "x"], axes[trace.yaxis or "y"]
        if trace.type == "bar" and trace.orientation == "h":
            base = _values(trace, "base") or [0.0] * len(xs)
            xa.add(base + [b + x for b, x in zip(base, xs)])
        else:
            xa.add(xs)
        ya.add(v for y in ys for v in (y if isinstance(y, tuple) else (y,)))
    for axis in axes.values():
        axis.settle()
    body: list[str] = []
    legends: dict[str, list[tuple[str, str]]] = {}
    for i in drawn:
        trace = fig.data[i]
        key = (trace.xaxis or "x", trace.yaxis or "y")
        colour = _colour(trace)
        shape = _trace_svg(trace, *stacked[i], axes[key[0]], axes[key[1]], colour)
        if trace.opacity is not None and trace.opacity < 1:
            shape = shape.replace("<g ", f"<g opacity='{trace.opacity}' ", 1)
        body.append(shape)
        if trace.showlegend is not False:
            legends.setdefault(trace.legend or "legend", []).append(
                (trace.name or trace.meta, colour)
            )
    frames = [
        _axis_svg(axes[xk], axes[yk])
        for xk, yk in sorted({(t.xaxis or "x", t.yaxis or "y") for t in fig.data})
    ]
    paper = _paper(fig, height)
    keys = [_legend_svg(entries, fig.layout[name], paper) for name, entries in legends.items()]
    notes = []
    for note in fig.layout.annotations:
        x = (note.x or 0) * WIDTH if note.xref == "paper" else None
        if x is None:  # a note in a panel's domain (the placeholder): centred on that panel
            xa, ya = axes[note.xref.split()[0]], axes[note.yref.split()[0]]
            x, y = (xa.start + xa.end) / 2, (ya.start + ya.end) / 2
        else:
            top, bottom = (fig.layout.margin.t or 60), height - (fig.layout.margin.b or 40)
            y = bottom - (note.y or 0) * (bottom - top) - 6
        small = " font-size='10'"
        lines = "".join(  # plotly's <br> as one tspan a line, later lines small (a subtitle)
            f"<tspan x='{x:.1f}' dy='{0 if i == 0 else 14}'{'' if i == 0 else small}>"
            f"{_esc(re.sub('<[^>]+>', '', line))}</tspan>"
            for i, line in enumerate(str(note.text).split("<br>"))
        )
        anchor = {"left": "start", "right": "end"}.get(note.xanchor or "center", "middle")
        notes.append(f"<text y='{y:.1f}' text-anchor='{anchor}' font-size='12'>{lines}</text>")
    return (
        f"<svg class='smp-static' xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {WIDTH} "
        f"{height}' width='100%' style='max-width: {WIDTH}px' font-size='10' {FONT}>"
        f"<rect width='{WIDTH}' height='{height}' fill='white'/>{''.join(frames)}"
        f"{''.join(body)}{''.join(keys)}{''.join(notes)}</svg>"
    )
