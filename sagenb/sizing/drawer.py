"""Who draws the estimate's chart: a seam the package's face fills.

An estimate is sized without plotly, and sizing/ stands below display/, which imports it (the
dashboard prices a run with sizing/cost.py). Yet `est.figure()` is the estimate's public way to
its chart (docs/cost-and-estimates.md). So the estimate asks this module, and the package's
face (sagenb/__init__.py), which every import of `sagenb.sizing` runs first, gives it the
display's chart (display/estimate_chart.py), imported on the first figure: the chart is drawn
on the notebook side, from the estimate's data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["draw", "draws_with"]

_drawer: Callable[[Any], Any] | None = None


def draws_with(drawer: Callable[[Any], Any]) -> None:
    """Called by the package's face: `drawer(estimate)` returns the estimate's figure."""
    global _drawer
    _drawer = drawer


def draw(estimate: Any) -> Any:
    """The estimate's figure, as the drawer the face gave draws it."""
    if _drawer is None:
        raise RuntimeError(
            "no drawer is registered for the estimate's chart: import sagenb (its face gives "
            "it), or draw it with sagenb.display.estimate_chart.scaling_figure(est)"
        )
    return _drawer(estimate)
