"""The live chart's redraws (sagenb/live_figure.py): after the first few, a redraw sends only
the points added and the values changed, and what the front end ends up holding (the Python
mirror of its splices) equals the spec's data. The static copy (sagenb/svg_figure.py) draws
every trace of the spec. Pool-free, like test_charts."""

from __future__ import annotations

import numpy as np

from sagenb import charts
from sagenb.live_figure import RESYNC_FIRST, splices

from .test_charts import CONFIGS, new_board, run


def test_splices_send_the_new_tail_only():
    old = {"x": np.arange(5.0), "y": [1.0, 2.0, 3.0, 4.0, 5.0], "name": "a"}
    new = {"x": np.arange(7.0), "y": [1.0, 2.0, 3.0, 4.0, 9.0, 6.0, 7.0], "name": "a"}
    assert splices(old, new) == {"splice": {"x": (5, [5.0, 6.0]), "y": (4, [9.0, 6.0, 7.0])}}
    assert splices(new, new) == {}
    assert splices(old, new, whole=True)["set"]["name"] == "a"


def test_redraws_after_the_first_send_only_new_points():
    board = new_board(CONFIGS["model"], live=True)
    widget = board._figure_widget
    step = 0
    for _ in range(RESYNC_FIRST):  # the first redraws send whole arrays
        step += 1
        run(board, range(step, step + 1), pipeline=True)
        board._dirty = True
        board._redraw()
    before = widget.sent_values
    run(board, range(step + 1, step + 2), pipeline=True)
    board._dirty = True
    board._redraw()
    # one new step: a point on each per-step line, the cost point, and what changed of the
    # memory bars and the schedule: far less than the figure holds
    held = sum(len(v) for t in widget.shown.values() for k, v in t.items() if k in ("x", "y"))
    assert 0 < widget.sent_values - before < held / 3, (widget.sent_values - before, held)
    for name, data in charts.trace_data(board).items():
        for key, values in data.items():
            assert list(widget.shown[name][key]) == list(np.asarray(values).tolist()), name


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
