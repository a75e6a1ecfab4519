"""A plotly figure drawn as one small inline SVG, by Python: the dashboard, live and finished.

Why not plotly.js (issue 17): plotly.min.js weighs 4.6 MB. Evaluating it and drawing six
subplots cost a run's first draw 0.5-2.5 s of browser CPU, and each redraw of the six panels
~150 ms, taken from the engines' cores when the browser runs on the training machine; a saved
notebook would have to carry it once per notebook to render offline. An SVG of the same figure
is 20-150 KB, renders in nbconvert's HTML, in JupyterLab without a kernel (its sanitizer keeps
SVG, drops scripts) and on GitHub, and the browser lays it out in a few milliseconds.

`Drawing` reads the figure's plain JSON once (plotly's own objects answer each attribute read
through validators: reading them per point cost 300 ms a figure) and draws it panel by panel:
each subplot's axes and traces are one `<g class='panel' data-axes='x3y3'>`, so the live chart
(live_figure.py) replaces only the panels whose data changed. Every trace of the spec is drawn,
whatever traces and panels it holds, found by the axes plotly assigned it. Handled: scatter
lines and markers (stackgroup stacked), vertical bars (stacked, categorical or multi-category
x), horizontal bars with a base (the pipeline schedule), reversed, log, fixed-range and hidden
axes, subplot and axis titles, and the legends where the layout puts them. Not drawn: hover
text, annotations other than titles and placeholders.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Drawing", "to_svg", "thin", "thinned", "MAX_POINTS"]

MAX_POINTS = 300  # points per line: a panel of the 1000 px wide figure is ~280 px wide
WIDTH = 1000
FONT = "font-family='Open Sans, Arial, sans-serif'"
Spec = Mapping[str, Any]


def _esc(text: Any) -> str:
    return html.escape(str(text).replace("<br>", " "), quote=True)


def _get(spec: Spec | None, *path: str) -> Any:
    """spec[path[0]][path[1]]..., None where any step is missing."""
    for key in path:
        if not isinstance(spec, Mapping):
            return None
        spec = spec.get(key)
    return spec


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


def thinned(items: Sequence, points: int = MAX_POINTS) -> list:
    """At most ~`points` of `items`: every k-th from the first, and the last (charts thins its
    lines with this too, so the drawing and the data agree on which steps a line keeps)."""
    n = len(items)
    if n <= points:
        return list(items)
    k = math.ceil(n / points)
    kept = list(items[::k])
    if (n - 1) % k:
        kept.append(items[-1])
    return kept


def thin(xs: Sequence, ys: Sequence) -> tuple[list, list]:
    return thinned(xs), thinned(ys)


def _colour(trace: Spec) -> str:
    colour = _get(trace, "line", "color") or _get(trace, "marker", "color")
    return colour if isinstance(colour, str) else "#555"


class _Axis:
    """One axis of a subplot: its pixel span, its data range (numeric or categories)."""

    def __init__(self, name: str, spec: Spec, start: float, end: float) -> None:
        self.name, self.spec, self.start, self.end = name, spec, start, end
        self.categories: list[str] = []
        #: a multi-category axis (compare()'s runs and their engines): each category's
        #: (outer, inner) levels; the ticks say the inner, a second row each group's outer
        self.levels: dict[str, tuple[str, str]] = {}
        self.lo, self.hi = math.inf, -math.inf
        #: a log axis (the learning rate and gradient norm) is laid out in log10 of its values
        self.log = spec.get("type") == "log"
        self.reversed = spec.get("autorange") == "reversed"
        self.visible = spec.get("visible") is not False
        self.labelled = self.visible and spec.get("showticklabels") is not False
        self.title = _get(spec, "title", "text")

    def add(self, values: Iterable[Any]) -> None:
        values = values if isinstance(values, list) else list(values)
        if values and isinstance(values[0], str):
            self.categories += [v for v in dict.fromkeys(values) if v not in self.categories]
            return
        numbers = np.array(values, dtype=float)  # None (a gap) reads as nan
        numbers = numbers[np.isfinite(numbers) & ((numbers > 0) if self.log else True)]
        if numbers.size:
            lo, hi = float(numbers.min()), float(numbers.max())
            if self.log:
                lo, hi = math.log10(lo), math.log10(hi)
            self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)

    def settle(self) -> None:
        if self.categories:
            self.lo, self.hi = -0.5, len(self.categories) - 0.5
            return
        fixed = self.spec.get("range")
        if fixed is not None and len(fixed) == 2 and not self.log:
            self.lo, self.hi = float(fixed[0]), float(fixed[1])
            return
        if not math.isfinite(self.lo):
            self.lo, self.hi = 0.0, 1.0
        if (self.spec.get("rangemode") or "normal") == "tozero" and not self.log:
            self.lo, self.hi = min(0.0, self.lo), max(0.0, self.hi)
        pad = (self.hi - self.lo) * 0.05 or abs(self.hi) * 0.1 or 1.0
        self.lo -= 0 if self.lo == 0 else pad
        self.hi += pad

    def px(self, v: Any) -> float:
        value = self.categories.index(v) if isinstance(v, str) else float(v)
        if self.log:
            value = math.log10(value) if value > 0 else self.lo
        share = (value - self.lo) / (self.hi - self.lo)
        if self.reversed:
            share = 1 - share
        return round(self.start + share * (self.end - self.start), 1)

    def groups(self) -> list[tuple[float, float, str]]:
        """A multi-category axis's outer level: (first px, last px, label) for each run of
        consecutive categories with the same outer label; [] for a plain axis."""
        out: list[tuple[float, float, str]] = []
        for c in self.categories if self.levels else ():
            outer = self.levels.get(c, ("", c))[0]
            if out and out[-1][2] == outer:
                out[-1] = (out[-1][0], self.px(c), outer)
            else:
                out.append((self.px(c), self.px(c), outer))
        return out

    def pxs(self, values: np.ndarray) -> np.ndarray:
        """px of many numbers at once (a line's points)."""
        if self.log:
            values = np.log10(np.where(values > 0, values, 10.0**self.lo))
        share = (values - self.lo) / (self.hi - self.lo)
        if self.reversed:
            share = 1 - share
        return np.round(self.start + share * (self.end - self.start), 1)

    def ticks(self) -> list[tuple[float, str]]:
        if self.categories:
            return [(self.px(c), self.levels.get(c, ("", c))[1]) for c in self.categories]
        if self.log:  # a tick at each power of ten in range
            powers = range(math.ceil(self.lo), math.floor(self.hi) + 1)
            if len(powers) < 2:  # less than a decade: its ends
                return [(self.px(10.0**e), _fmt(10.0**e)) for e in (self.lo, self.hi)]
            return [(self.px(10.0**k), f"1e{k}") for k in powers]
        return [(self.px(t), _fmt(t)) for t in _nice_ticks(self.lo, self.hi)]


def _plain(values: Any) -> Any:
    """plotly's JSON keeps numpy arrays as typed arrays ({'dtype': 'f8', 'bdata': base64}):
    back to a numpy array."""
    if isinstance(values, Mapping) and "bdata" in values:
        array = np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
        shape = values.get("shape")
        return array.reshape([int(n) for n in str(shape).split(",")]) if shape else array
    return values


def _levels(trace: Spec, key: str) -> dict[str, tuple[str, str]]:
    """A multi-category trace's categories as `_values` names them, to their (outer, inner)
    levels; {} for any other trace."""
    values = _plain(trace.get(key))
    if values is None or isinstance(values, np.ndarray):
        return {}
    values = list(values)
    if len(values) != 2 or not all(isinstance(v, (list, tuple)) for v in values):
        return {}
    return {f"{o} {i}": (str(o), str(i)) for o, i in zip(*values)}


def _values(trace: Spec, key: str) -> list:
    values = _plain(trace.get(key))
    if values is None:
        return []
    values = values.tolist() if isinstance(values, np.ndarray) else list(values)
    if values and isinstance(values[0], (list, tuple)):  # plotly's multi-category axis
        return [" ".join(map(str, level)) for level in zip(*values)]
    return values


def _axes_of(trace: Spec) -> tuple[str, str]:
    return trace.get("xaxis") or "x", trace.get("yaxis") or "y"


def _axes_of_key(key: str) -> tuple[str, str]:
    """A panel's key ('x3y3') as its two axes ('x3', 'y3')."""
    split = key.index("y")
    return key[:split], key[split:]


def _transparent(trace: Spec) -> bool:
    """A trace drawn with opacity 0 (charts.py's memory headroom): data, never ink."""
    return trace.get("opacity") == 0 or (
        trace.get("mode") == "markers" and _get(trace, "marker", "opacity") == 0
    )


def _bars_svg(trace: Spec, xs: list, ys: list, xa: _Axis, ya: _Axis) -> str:
    parts = []
    if trace.get("orientation") == "h":  # the schedule: x is a duration from `base`
        base = _values(trace, "base") or [0.0] * len(xs)
        h = 0.7 * abs(ya.end - ya.start) / max(1, len(ya.categories))
        for b, x, y in zip(base, xs, ys):
            x0, x1, yc = xa.px(b), xa.px(b + x), ya.px(y)
            parts.append(
                f"<rect x='{min(x0, x1)}' y='{yc - h / 2:.1f}' "
                f"width='{abs(x1 - x0):.1f}' height='{h:.1f}'/>"
            )
    else:
        w = 0.6 * abs(xa.end - xa.start) / max(1, len(xa.categories))
        for x, y in zip(xs, ys):
            y0, y1 = y if isinstance(y, tuple) else (0.0, y or 0.0)
            xc, top, low = xa.px(x), ya.px(y1), ya.px(y0)
            parts.append(
                f"<rect x='{xc - w / 2:.1f}' y='{min(top, low)}' "
                f"width='{w:.1f}' height='{abs(low - top):.1f}'/>"
            )
    return "".join(parts)


def _points(xs: list, tops: list, xa: _Axis, ya: _Axis) -> list[tuple[float, float]]:
    """A line's vertices in px (`_scatter_svg` thinned them), missing and non-finite values
    left out."""
    y = np.array([np.nan if v is None else v for v in tops], dtype=float)
    keep = np.isfinite(y)
    if xa.categories:
        px = np.array([xa.px(x) for x in xs], dtype=float)
    else:
        px = xa.pxs(np.asarray(xs, dtype=float))
    return list(zip(px[keep].tolist(), ya.pxs(y[keep]).tolist()))


def _area_svg(xs: list, ys: list, xa: _Axis, ya: _Axis, colour: str) -> str:
    """A stacked trace's area, from the top of the trace below it (its base) to its own top,
    filled as plotly fills a stackgroup ('tonexty', the line's colour at half opacity): drawn as
    lines alone, a thin band on top of a thick one looked as large as it (issue 35)."""
    pairs = [(x, b, t) for x, (b, t) in zip(xs, ys) if _finite(b) and _finite(t)]
    if not pairs:
        return ""
    tops = _points([x for x, _, _ in pairs], [t for _, _, t in pairs], xa, ya)
    bases = _points([x for x, _, _ in pairs], [b for _, b, _ in pairs], xa, ya)
    outline = tops + bases[::-1]
    d = "M" + "L".join(f"{x},{y}" for x, y in outline) + "Z"
    return f"<path class='js-fill' d='{d}' fill='{colour}' fill-opacity='0.5' stroke='none'/>"


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _scatter_svg(trace: Spec, xs: list, ys: list, xa: _Axis, ya: _Axis, colour: str) -> str:
    xs, ys = thin(xs, ys)  # at most MAX_POINTS vertices, before any is read
    tops = [y[1] if isinstance(y, tuple) else y for y in ys]
    points = _points(xs, tops, xa, ya) if xs else []
    parts = []
    mode = trace.get("mode") or "lines"
    line = trace.get("line") or {}
    dash = "stroke-dasharray='4 3'" if line.get("dash") == "dot" else ""
    if trace.get("stackgroup") and ys and isinstance(ys[0], tuple):
        parts.append(_area_svg(xs, ys, xa, ya, colour))
    if "lines" in mode and points:
        d = "M" + "L".join(f"{x},{y}" for x, y in points)
        parts.append(
            f"<path class='js-line' d='{d}' fill='none' stroke='{colour}' "
            f"stroke-width='{line.get('width') or 1.5}' {dash}/>"
        )
    if "markers" in mode:
        marker = trace.get("marker") or {}
        if marker.get("symbol") == "line-ew-open":
            parts += [
                f"<line x1='{x - 12}' x2='{x + 12}' y1='{y}' y2='{y}' stroke='{colour}' "
                f"stroke-width='3'/>"
                for x, y in points
            ]
        else:
            size = (marker.get("size") or 6) / 2
            parts += [f"<circle cx='{x}' cy='{y}' r='{size}' fill='{colour}'/>" for x, y in points]
    return "".join(parts)


def _axis_svg(xa: _Axis, ya: _Axis) -> str:
    out = []
    if xa.visible:
        out.append(
            f"<line x1='{xa.start}' x2='{xa.end}' y1='{ya.start}' y2='{ya.start}' stroke='#bbb'/>"
        )
        if xa.labelled:
            out += [
                f"<text class='{xa.name}tick' x='{px}' y='{ya.start + 14}' "
                f"text-anchor='middle'>{_esc(text)}</text>"
                for px, text in xa.ticks()
            ]
        groups = xa.groups() if xa.labelled else []
        for first, last, label in groups:  # the outer level, under its categories' ticks
            out.append(
                f"<text x='{(first + last) / 2:.1f}' y='{ya.start + 28}' "
                f"text-anchor='middle' font-weight='bold'>{_esc(label)}</text>"
            )
        if xa.title:
            out.append(
                f"<text x='{(xa.start + xa.end) / 2}' y='{ya.start + (44 if groups else 30)}' "
                f"text-anchor='middle'>{_esc(xa.title)}</text>"
            )
    if ya.visible:
        for px, text in ya.ticks():
            out.append(f"<line x1='{xa.start}' x2='{xa.end}' y1='{px}' y2='{px}' stroke='#eee'/>")
            if ya.labelled:
                prefix = _esc(ya.spec.get("tickprefix") or "")
                out.append(
                    f"<text x='{xa.start - 4}' y='{px + 4}' text-anchor='end'>"
                    f"{prefix}{_esc(text)}</text>"
                )
        if ya.title:
            mid = (ya.start + ya.end) / 2
            out.append(
                f"<text transform='translate({xa.start - 45},{mid}) rotate(-90)' "
                f"text-anchor='middle'>{_esc(ya.title)}</text>"
            )
    return "".join(out)


class Drawing:
    """A figure as SVG, panel by panel. Built once from the figure (a plotly Figure or its
    plain JSON); `update` replaces a trace's data by its name (plotly's `meta`, as charts.py
    names them), `panel` draws one subplot's axes and traces, `svg` the whole figure."""

    def __init__(self, fig: Any, *, css_class: str = "smp-static") -> None:
        spec = fig if isinstance(fig, Mapping) else fig.to_plotly_json()
        self.layout: dict[str, Any] = dict(spec.get("layout") or {})
        self.traces: list[dict[str, Any]] = [dict(t) for t in spec.get("data") or ()]
        self.css_class = css_class
        self.height = int(self.layout.get("height") or 900)
        margin = self.layout.get("margin") or {}
        #: plotly's paper (the area inside the margins): left, right, top, bottom in px
        self.paper = (
            float(margin.get("l") or 60),
            float(WIDTH - (margin.get("r") or 20)),
            float(margin.get("t") or 60),
            float(self.height - (margin.get("b") or 40)),
        )
        self.by_name = {t["meta"]: i for i, t in enumerate(self.traces) if "meta" in t}
        #: each subplot's traces in drawing order, by its axes ('x3y3'), panels in trace order
        self.panels: dict[str, list[int]] = {}
        for i, trace in enumerate(self.traces):
            self.panels.setdefault("".join(_axes_of(trace)), []).append(i)

    def update(self, name: str, data: Mapping[str, Any]) -> None:
        self.traces[self.by_name[name]].update(data)

    def retitle(self, titles: Mapping[str, str]) -> set[str]:
        """Give axes new titles, by plotly's axis name ('y2': 'tokens/s'); returns the panels
        ('x2y2') whose drawing changed with them."""
        changed = set()
        for axis, text in titles.items():
            name = axis.replace("x", "xaxis", 1).replace("y", "yaxis", 1)
            spec = dict(self.layout.get(name) or {})
            if _get(spec, "title", "text") == text:
                continue
            spec["title"] = {**(spec.get("title") or {}), "text": text}
            self.layout[name] = spec
            changed |= {key for key in self.panels if axis in _axes_of_key(key)}
        return changed

    def values(self, name: str, key: str) -> list:
        """The named trace's `key` (x, y, ...) as drawn, a plain list."""
        return _values(self.traces[self.by_name[name]], key)

    def panel_of(self, name: str) -> str:
        return "".join(_axes_of(self.traces[self.by_name[name]]))

    def _axis(self, name: str) -> _Axis:
        spec = self.layout.get(name.replace("x", "xaxis", 1).replace("y", "yaxis", 1)) or {}
        left, right, top, bottom = self.paper
        d0, d1 = spec.get("domain") or (0, 1)
        if name.startswith("x"):
            return _Axis(name, spec, left + d0 * (right - left), left + d1 * (right - left))
        return _Axis(name, spec, bottom - d0 * (bottom - top), bottom - d1 * (bottom - top))

    def _stacked(self, indices: list[int]) -> dict[int, tuple[list, list]]:
        """Per trace of one panel: (x, y) after stacking, as plotly stacks them: bars in
        barmode 'stack' (per category, in trace order; a bar's base is where the last one
        ended) and scatter traces of one stackgroup (per point index)."""
        out: dict[int, tuple[list, list]] = {}
        bar_tops: dict[Any, float] = {}
        group_tops: dict[str, list[float]] = {}
        stack_bars = self.layout.get("barmode") == "stack"
        for i in indices:
            trace = self.traces[i]
            x, y = _values(trace, "x"), _values(trace, "y")
            kind = trace.get("type", "scatter")
            if kind == "bar" and trace.get("orientation") != "h" and stack_bars:
                bases = [bar_tops.get(c, 0.0) for c in x]
                for c, b, v in zip(x, bases, y):
                    bar_tops[c] = b + (v or 0.0)
                out[i] = (x, [(b, b + (v or 0.0)) for b, v in zip(bases, y)])
            elif kind == "scatter" and trace.get("stackgroup"):
                below = group_tops.get(trace["stackgroup"], [0.0] * len(y))
                tops = [b + (v or 0.0) for b, v in zip(below, y)]
                group_tops[trace["stackgroup"]] = tops
                out[i] = (x, list(zip(below, tops)))
            else:
                out[i] = (x, y)
        return out

    def panel(self, key: str) -> str:
        """One subplot's axes and traces, tagged with its axes (data-axes='x3y3', plotly's
        names) for tests and readers; `svg` wraps each in <g class='panel'>."""
        indices = [i for i in self.panels[key] if self.traces[i].get("visible") is not False]
        x_name, y_name = _axes_of(self.traces[self.panels[key][0]])
        xa, ya = self._axis(x_name), self._axis(y_name)
        stacked = self._stacked(indices)
        for i in indices:
            trace, (xs, ys) = self.traces[i], stacked[i]
            if trace.get("type") == "bar" and trace.get("orientation") == "h":
                base = _values(trace, "base") or [0.0] * len(xs)
                xa.add(base + [b + x for b, x in zip(base, xs)])
            else:
                xa.add(xs)
                xa.levels.update(_levels(trace, "x"))
            # stacked traces hold (base, top) pairs (_stacked), each value the others plain
            ya.add([v for y in ys for v in y] if ys and isinstance(ys[0], tuple) else ys)
        xa.settle()
        ya.settle()
        body = [_axis_svg(xa, ya)]
        for i in indices:
            trace = self.traces[i]
            if not _transparent(trace):
                body.append(self._trace_svg(trace, *stacked[i], xa, ya))
        return "".join(body)

    def _trace_svg(self, trace: Spec, xs: list, ys: list, xa: _Axis, ya: _Axis) -> str:
        colour = _colour(trace)
        opacity = trace.get("opacity")
        # data-n: the values it holds (a line draws at most MAX_POINTS of them); data-last: its
        # last x (a line's last step), which only grows while a run trains
        last = xs[-1] if xs and isinstance(xs[-1], (int, float)) else None
        tag = (
            f"data-name='{_esc(trace.get('meta', ''))}' data-axes='{xa.name}{ya.name}' "
            f"data-n='{len(xs)}'"
            + (f" data-last='{last}'" if last is not None else "")
            + (f" opacity='{opacity}'" if opacity is not None and opacity < 1 else "")
        )
        if trace.get("type") == "bar":
            body = _bars_svg(trace, xs, ys, xa, ya)
            return f"<g class='trace bar' {tag} fill='{colour}'>{body}</g>"
        return f"<g class='trace scatter' {tag}>{_scatter_svg(trace, xs, ys, xa, ya, colour)}</g>"

    def group(self, key: str, content: str | None = None) -> str:
        content = self.panel(key) if content is None else content
        return f"<g class='panel' data-axes='{key}'>{content}</g>"

    def chrome(self) -> str:
        """What does not change with the data: the legends and the titles."""
        legends: dict[str, list[tuple[str, str]]] = {}
        for trace in self.traces:
            if trace.get("visible") is False or _transparent(trace):
                continue
            if trace.get("showlegend") is not False:
                legends.setdefault(trace.get("legend") or "legend", []).append(
                    (trace.get("name") or trace.get("meta") or "", _colour(trace))
                )
        keys = [
            self._legend_svg(entries, self.layout.get(name) or {})
            for name, entries in legends.items()
        ]
        notes = [self._note_svg(note) for note in self.layout.get("annotations") or ()]
        return "".join(keys) + "".join(notes)

    def _legend_svg(self, entries: list[tuple[str, str]], spec: Spec) -> str:
        """One legend where the layout puts it, anchored as plotly anchors it: a column of
        entries (each panel's, beside its plot, as charts.py places them) or a row (orientation
        'h', as compare() puts the runs above its panels)."""
        left, right, top, bottom = self.paper
        x0 = left + (spec["x"] if spec.get("x") is not None else 1.02) * (right - left)
        y0 = bottom - (spec["y"] if spec.get("y") is not None else 1.0) * (bottom - top)
        widths = [14 + 5.5 * len(name) + 10 for name, _ in entries]  # 10 px type: ~5.5 px/letter
        row = spec.get("orientation") == "h"
        width = sum(widths) if row else max(widths, default=0)
        height = 13 if row else 13 * len(entries)
        x0 -= {"right": width, "center": width / 2}.get(spec.get("xanchor") or "left", 0)
        y0 -= {"bottom": height, "middle": height / 2}.get(spec.get("yanchor") or "top", 0)
        out = []
        for j, (name, colour) in enumerate(entries):
            x, y = (x0 + sum(widths[:j]), y0 + 10) if row else (x0, y0 + 10 + 13 * j)
            out.append(
                f"<rect x='{x:.1f}' y='{y - 8}' width='10' height='8' fill='{colour}'/>"
                f"<text x='{x + 14:.1f}' y='{y}'>{_esc(name)}</text>"
            )
        return "".join(out)

    def _note_svg(self, note: Spec) -> str:
        if note.get("xref") == "paper":
            x = (note.get("x") or 0) * WIDTH
            top, bottom = self.paper[2], self.paper[3]
            y = bottom - (note.get("y") or 0) * (bottom - top) - 6
        else:  # a note in a panel's domain (the placeholder): centred on that panel
            xa = self._axis(str(note.get("xref")).split()[0])
            ya = self._axis(str(note.get("yref")).split()[0])
            x, y = (xa.start + xa.end) / 2, (ya.start + ya.end) / 2
        small = " font-size='10'"
        lines = "".join(  # plotly's <br> as one tspan a line, later lines small (a subtitle)
            f"<tspan x='{x:.1f}' dy='{0 if i == 0 else 14}'{'' if i == 0 else small}>"
            f"{_esc(re.sub('<[^>]+>', '', line))}</tspan>"
            for i, line in enumerate(str(note.get("text", "")).split("<br>"))
        )
        anchor = {"left": "start", "right": "end"}.get(note.get("xanchor") or "center", "middle")
        return f"<text y='{y:.1f}' text-anchor='{anchor}' font-size='12'>{lines}</text>"

    def svg(self, panels: Mapping[str, str] | None = None, *, css_class: str | None = None) -> str:
        """The figure as one <svg> element (scales to its container's width); `panels`: each
        panel's content as already drawn (by `panel`), drawn here where missing."""
        drawn = panels or {}
        body = "".join(self.group(key, drawn.get(key)) for key in self.panels)
        return (
            f"<svg class='{css_class or self.css_class}' xmlns='http://www.w3.org/2000/svg' "
            f"viewBox='0 0 {WIDTH} {self.height}' width='100%' style='max-width: {WIDTH}px' "
            f"font-size='10' {FONT}><rect width='{WIDTH}' height='{self.height}' fill='white'/>"
            f"{body}{self.chrome()}</svg>"
        )


def to_svg(fig: Any) -> str:
    """The figure as one <svg> element, as a finished dashboard and compare() show it."""
    return Drawing(fig).svg()
