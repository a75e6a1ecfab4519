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

from .boards import CONFIGS, new_board, run


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


def test_the_throughput_axis_says_tokens_for_token_inputs():
    """The figure is first drawn before any metrics, with samples/s; token-id inputs make the
    throughput line tokens/s, and its axis must say so in the live drawing and in the static
    copy it leaves (issue 35: the axis said samples/s over a line of tokens/s)."""
    from sagenb.metrics import keys

    from .boards import step_metrics

    board = new_board(CONFIGS["data"], live=True)
    widget = board._figure_widget
    rate = widget.panel_of("throughput")
    assert "samples/s" in widget.shown[rate]  # before any metrics: samples
    for step in range(1, 5):
        for rank in range(board.engines):
            metrics = step_metrics(step, rank, True, False)
            metrics[keys.TOKENS], metrics[keys.SAMPLES] = 64 * 16, 64  # 16 tokens a sample
            board.log(metrics, step, rank)
    board._redraw(every_second=True)  # even the loss-only redraw retitles the axis
    assert "tokens/s" in widget.shown[rate] and "samples/s" not in widget.shown[rate]
    board.finish(4.0, status="done")
    # the static copy a finished run leaves (dashboard._leave_static_copy draws it so), and
    # the figure drawn afresh
    for static in (widget.drawing.svg(widget.shown), board.static_html()):
        assert "tokens/s" in static and "samples/s" not in static
    # and the line it labels is tokens/s: 16 times the samples/s of the same rows
    rows = board.history.steps
    assert rows[-1][keys.TOKEN_THROUGHPUT] == 16 * rows[-1][keys.THROUGHPUT]
    assert widget.drawing.values("throughput", "y")[-1] == rows[-1][keys.TOKEN_THROUGHPUT]


def test_the_static_copy_fills_the_step_times_stacked_areas():
    """Compute and bubble are a stack (plotly's stackgroup, filled 'tonexty'): the drawing
    fills each between the one below and its own top (issue 35: drawn as two lines, the bubble
    on top looked as large as the compute under it)."""
    import re

    board = new_board(CONFIGS["model"])
    run(board, range(1, 13), pipeline=True)
    drawing = Drawing(board.to_figure(header=False))
    panel = drawing.panel(drawing.panel_of("compute (s)"))

    def drawn(name: str) -> tuple[str, str, str]:
        """(fill colour, the area's outline, the line on top) of the named trace."""
        group = re.search(
            rf"<g class='trace scatter' data-name='{re.escape(name)}'[^>]*>(.*?)</g>", panel
        )
        assert group, name
        area = re.search(r"<path class='js-fill' d='M([^']+)Z' fill='([^']+)'", group.group(1))
        line = re.search(r"<path class='js-line' d='M([^']+)'", group.group(1))
        assert area and line, f"{name} has no filled area: {group.group(1)[:200]}"
        return area.group(2), area.group(1), line.group(1)

    compute, bubble = drawn("compute (s)"), drawn("idle / bubble (s)")
    assert compute[0] == "#4C78A8" and bubble[0] == "#E45756"
    # the bubble's area starts where the compute's ends: its outline runs back along the
    # compute's top line
    back = "L".join(reversed(compute[2].split("L")))
    assert bubble[1].endswith(back), (bubble[1][-120:], back[-120:])
    # and the compute's area reaches down to the axis (step time's y is 0 at its bottom)
    bottom = {
        float(point.split(",")[1]) for point in compute[1].split("L")[len(compute[2].split("L")) :]
    }
    assert len(bottom) == 1, bottom
