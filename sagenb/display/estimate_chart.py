"""The estimate's chart: hours and dollars of the run on 1, 2, 4, 8 instances, each a (low,
high) range (plotly; notebook side only, as dashboard.py and charts.py)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["scaling_figure"]


def _bars(rows: list[Any], attr: str) -> tuple[list[str], list[float], list[float]]:
    """x labels, the low ends and the spans (high - low) of the rows that have `attr`."""
    shown = [r for r in rows if getattr(r, attr) is not None]
    labels = [f"{r.instances} x ({r.engines} engines)" for r in shown]
    lows = [getattr(r, attr)[0] for r in shown]
    return labels, lows, [getattr(r, attr)[1] - getattr(r, attr)[0] for r in shown]


def scaling_figure(est: Any) -> go.Figure:
    """Floating bars from low to high: hours, and on-demand and spot dollars."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("Hours", "Dollars"))
    panels = (("hours", "hours", "#4C78A8", 1), ("cost_usd", "on-demand", "#E45756", 2))
    for attr, name, colour, col in (*panels, ("spot_usd", "spot", "#54A24B", 2)):
        labels, lows, spans = _bars(est.scaling, attr)
        fig.add_trace(
            go.Bar(x=labels, y=spans, base=lows, name=f"{name} (low-high)", marker_color=colour),
            1,
            col,
        )
    mfu = est.assumptions[0].split(" x ")[-1].split(" (")[0] if est.assumptions else ""
    fig.update_layout(
        barmode="group",
        height=380,
        template="plotly_white",
        title=(
            f"{est.config.strategy} on {est.config.instance}: {est.steps or '?'} steps, "
            f"{mfu}; price as of {est.price.as_of}, hardware as of {est.hardware.as_of}"
        ),
    )
    fig.update_yaxes(title_text="hours", row=1, col=1)
    fig.update_yaxes(title_text="USD", row=1, col=2)
    return fig
