"""The live dashboard's redraws (sagenb/display/live_figure.py): a redraw sends only the panels
whose drawing changed, the loss panel alone every second; what the page ends up showing equals
the finished figure drawn afresh; the static copy (sagenb/display/svg_figure.py) draws every
trace of the spec. Pool-free, like test_charts."""

from __future__ import annotations

import time

import plotly.graph_objects as go

from sagenb.display import charts
from sagenb.display.dashboard import REDRAW_S
from sagenb.display.svg_figure import Drawing

from .test_charts import CONFIGS, new_board, run


def _redraw(board, **kwargs) -> list[str]:
    """The panels one redraw sent (their axes, 'x3y3')."""
    widget = board._figure_widget
    before = {key: getattr(widget, f"panel_{key}") for key in widget.shown}
    board._redraw(**kwargs)
    return [key for key in widget.shown if getattr(widget, f"panel_{key}") != before[key]]


def test_the_first_metrics_reach_every_panel_at_the_next_tick():
    """A tick before any metrics draws nothing and does not start the other panels' period
    (dashboard.figure_period, 2 s at first): the first step's memory bars are drawn at the
    next tick, not a period later."""
    board = new_board(CONFIGS["data"], live=True)
    widget = board._figure_widget
    memory = widget.panel_of("params")
    empty = widget.shown[memory]
    board.tick(0.0)  # the run has started; nothing logged yet
    run(board, range(1, 2))
    time.sleep(REDRAW_S)
    board.tick(REDRAW_S)
    assert widget.shown[memory] != empty
    # and it is the first step's memory, as a drawing from scratch shows it
    assert widget.shown[memory] == Drawing(board.to_figure(header=False)).panel(memory)


def test_a_redraw_sends_only_the_panels_that_changed():
    board = new_board(CONFIGS["model"], live=True)
    widget = board._figure_widget
    loss = widget.panel_of("loss (smoothed)")
    memory = widget.panel_of("params")
    run(board, range(1, 4), pipeline=True)
    assert set(_redraw(board)) == set(widget.shown)  # the first data: every panel
    assert _redraw(board) == []  # nothing logged since: nothing sent

    run(board, range(4, 5), pipeline=True)
    # the redraw due every second draws the loss only
    assert _redraw(board, every_second=True) == [loss]
    # the full redraw: the per-step panels and the cost moved; the memory bars did not
    sent = _redraw(board)
    assert loss not in sent and memory not in sent and len(sent) >= 3, sent

    # what the page shows is the figure of the same data drawn from scratch, panel by panel
    fresh = Drawing(board.to_figure(header=False))
    assert widget.shown == {key: fresh.panel(key) for key in fresh.panels}
    assert widget.panels == list(fresh.panels)


def test_the_header_travels_only_when_it_changed():
    board = new_board(CONFIGS["data"], live=True)
    widget = board._figure_widget
    sent = []
    widget.observe(lambda change: sent.append(change["new"]), names="header")
    board._redraw_header()
    assert sent == []  # the same text as the first draw
    run(board, range(1, 3))
    board._redraw_header()
    assert len(sent) == 1 and "step 2/12" in sent[0], sent


def test_the_static_copy_draws_every_trace():
    board = new_board(CONFIGS["model"])
    run(board, range(1, 13), pipeline=True)
    page = board.static_html()
    assert "<script" not in page and len(page) < 100_000
    for trace in charts.traces(board):
        if trace.visible is not None and not trace.visible(board):
            continue  # e.g. the CUDA marks of a CPU run: hidden in the live figure too
        if trace.style is charts.INVISIBLE:
            continue  # the memory axis's headroom: data for the axis range, never drawn
        assert f"data-name='{trace.name}'" in page, trace.name


def test_a_drawing_reads_numpy_data_plotly_encodes():
    """plotly's JSON carries numpy arrays as base64 typed arrays: drawn as the numbers."""
    import numpy as np

    fig = go.Figure(go.Scatter(x=np.arange(3.0), y=np.array([1.0, 4.0, 2.0]), meta="a"))
    drawing = Drawing(fig)
    assert drawing.values("a", "y") == [1.0, 4.0, 2.0]
    assert drawing.svg().count("L") >= 2 and "NaN" not in drawing.svg()
