"""The dashboard's declarative chart spec (issue 18): the figure and every live redraw come from
one list of traces, each found by its name, never by its position; the metric keys are one
typed module. Pool-free: the dashboard is fed the metric dicts the engines publish."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import numpy as np
import pytest

from sagenb.config import TrainConfig
from sagenb.display import charts, svg_figure
from sagenb.display.dashboard import Dashboard
from sagenb.metrics import keys

from .boards import CONFIGS, KINDS, STEPS, new_board, run, step_metrics


@pytest.mark.parametrize("strategy", sorted(CONFIGS))
def test_the_figure_draws_every_trace_of_the_spec_once_in_its_panel(strategy):
    config = CONFIGS[strategy]
    board = new_board(config)
    run(board, range(1, STEPS + 1), pipeline=charts.pipelined(board))
    fig = board.to_figure()
    spec = charts.traces(board)
    assert collections.Counter(t.meta for t in fig.data) == collections.Counter(
        t.name for t in spec
    )
    assert len({t.name for t in spec}) == len(spec)  # names are identities: no two alike
    replicas = [t for t in fig.data if t.meta.startswith("replica")]
    assert len(replicas) == config.replicas(config.engines)
    drawn = {t.meta: t for t in fig.data}
    data = charts.trace_data(board)
    for trace in spec:
        shown = drawn[trace.name]
        panel = fig.get_subplot(trace.panel.row, trace.panel.col)
        assert (shown.xaxis, shown.yaxis) == (
            panel.xaxis.plotly_name.replace("axis", ""),
            panel.yaxis.plotly_name.replace("axis", ""),
        ), trace.name
        assert shown.name == (trace.label(board) if trace.label else trace.name)
        for key, values in data[trace.name].items():
            assert list(getattr(shown, key)) == list(values), (trace.name, key)
    if charts.pipelined(board):  # each engine's two microbatches, in the schedule panel
        bars = drawn["forward"]
        assert sorted(bars.y) == ["stage 0"] * config.engines + ["stage 1"] * config.engines
        assert "learning rate" not in drawn
    else:  # no empty schedule panel (issue 17): the learning rate in its place
        assert "forward" not in drawn and drawn["idle / bubble (s)"].visible is False
        assert list(drawn["learning rate"].y) == [0.1] * STEPS


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_gradient_norm_is_promised_only_when_it_is_recorded(clip):
    """The engines record the gradient norm only with --clip-grad-norm (engine/loop.py): the
    panel's title and legend say so, rather than naming a line that never comes."""
    board = new_board(TrainConfig(engines=2, batch_size=8, clip_grad_norm=clip))
    run(board, range(1, STEPS + 1))
    fig = board.to_figure()
    drawn = {t.meta: t for t in fig.data}
    titles = [a.text for a in fig.layout.annotations]
    svg = svg_figure.to_svg(fig)  # what the notebook shows: legend entries as text
    if clip is None:
        assert "Learning rate" in titles and "Learning rate, gradient norm" not in titles
        assert drawn["gradient norm"].visible is False
        assert ">grad norm<" not in svg and ">lr<" in svg
    else:
        assert "Learning rate, gradient norm" in titles
        assert drawn["gradient norm"].visible is not False
        assert ">grad norm<" in svg


def expected(board: Dashboard) -> dict[str, dict[str, list]]:
    """Each trace's data worked out from what `run` logged, independently of display/charts.py."""
    steps = list(range(1, STEPS + 1))
    # TensorBoard's bias-corrected moving average, over a window of a tenth of the run's 12
    # steps (1.2 steps: weight 1/6)
    weight, value, smoothed = 1 - 1 / 1.2, 0.0, []
    for n, step in enumerate(steps, 1):  # the global loss: the mean of 1/step and 1/step + 0.1
        value = weight * value + (1 - weight) * (1.0 / step + 0.05)
        smoothed.append(value / (1 - weight**n))
    slowest = [0.01 * s + 0.001 for s in steps]
    costs = board.cost_points
    out = {
        "loss (smoothed)": {"x": steps, "y": smoothed},
        "replica 0 loss": {"x": steps, "y": [1.0 / s for s in steps]},
        "replica 1 loss": {"x": steps, "y": [1.0 / s + 0.1 for s in steps]},
        "eval loss": {"x": [3, 6, 9, 12], "y": [2.0 / s for s in (3, 6, 9, 12)]},
        "throughput": {"x": steps, "y": [8 / t for t in slowest]},
        "compute (s)": {"x": steps, "y": slowest},
        "idle / bubble (s)": {"x": steps, "y": [0.0] * STEPS},
        "on-demand": {"x": [t for t, _ in costs], "y": [c for _, c in costs]},
        "spot": {"x": [t for t, _ in costs], "y": [board.cost.spot(c) for _, c in costs]},
    }
    for kind, mib in KINDS.items():
        out[kind] = {"x": ["engine 0", "engine 1"], "y": [mib, mib + 1]}
    return out


def test_a_redraw_updates_each_trace_by_its_name(monkeypatch):
    board = new_board(CONFIGS["data"], live=True)  # the widget, built from the spec's order
    run(board, range(1, 4))
    board.tick(3.0)  # the first redraw is due at once
    # the spec in another order from here on: a redraw that went by position would now
    # give every trace another's data
    monkeypatch.setattr(charts, "TRACES", tuple(reversed(charts.TRACES)))
    run(board, range(4, STEPS + 1))
    board.finish(float(STEPS), status="done")
    # what the page's drawing holds: every trace of the spec, each given its data by name
    drawing = board._figure_widget.drawing
    assert set(drawing.by_name) == {t.name for t in charts.traces(board)}
    for name, data in expected(board).items():
        for key, values in data.items():
            got = drawing.values(name, key)
            if isinstance(values[0], str):
                assert got == values, (name, key)
            else:
                np.testing.assert_allclose(got, values, rtol=1e-12, err_msg=f"{name}.{key}")


def test_metric_keys_import_nothing_and_keep_their_values():
    code = (
        "import sys, json; import sagenb.metrics.keys as k; "
        "heavy = [m for m in ('torch', 'plotly', 'IPython', 'ipywidgets') if m in sys.modules]; "
        "print(json.dumps([heavy, {n: v for n, v in vars(k).items() if n.isupper()}]))"
    )
    heavy, values = json.loads(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert heavy == []
    # results, checkpoints and the torchrun script's JSON lines carry these names: they stay
    assert values["LOSS"] == "loss" and values["STEP_TIME"] == "step_time(s)"
    assert values["THROUGHPUT"] == "throughput(samples/s)"
    assert values["MEMORY_PARAMS"] == "memory/params(MiB)"
    assert values["TIMELINE_T0"] == "timeline_t0(unix s)"
    names = [v for v in values.values() if isinstance(v, str)]
    assert len(names) == len(set(names))  # no two constants for one key
    assert keys.unit(keys.TOKEN_THROUGHPUT) == "tokens/s"
    with pytest.raises(ValueError, match="'loss' names no unit"):
        keys.unit(keys.LOSS)


class Counted(list):
    """The history's rows, counting how many of them are read (one by one, sliced or
    iterated)."""

    read = 0

    def __iter__(self):
        self.read += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        got = super().__getitem__(index)
        self.read += len(got) if isinstance(index, slice) else 1
        return got


def test_a_redraw_reads_the_new_rows_and_the_drawn_ones_not_the_whole_run():
    """A long run's redraw costs what it draws: at 30,000 steps, deriving every line from
    every row made a loss redraw 84 ms, once a second, on the engines' cores (issue 17)."""
    board = new_board(CONFIGS["data"], live=True)
    board.history.steps = rows = Counted()
    run(board, range(1, 20_001))
    board.tick(1.0)  # the first redraw takes every row once
    run(board, range(20_001, 20_031))  # a second of training
    rows.read = 0
    board._last_redraw = 0.0  # the next tick is due
    board.tick(2.0)
    # each drawn line reads its ~MAX_POINTS rows, plus the 30 new rows; the old code read all
    assert 0 < rows.read <= 2 * svg_figure.MAX_POINTS + 30, rows.read
    board.finish(20_030.0, status="done")
    for name in board._figure_widget.drawing.by_name:  # the page draws what it was sent
        assert len(board._figure_widget.drawing.values(name, "x")) <= svg_figure.MAX_POINTS + 1


def test_lines_kept_as_the_run_grows_equal_lines_drawn_from_scratch():
    """The columns are extended at each redraw: after many redraws, every line equals the
    same run's lines derived at once from all its rows."""
    live = new_board(CONFIGS["data"])
    for start in range(1, 3_000, 250):  # a redraw's worth of rows at a time
        run(live, range(start, start + 250))
        charts.trace_data(live, points=svg_figure.MAX_POINTS)
    fresh = new_board(CONFIGS["data"])
    run(fresh, range(1, 3_001))
    got, want = (charts.trace_data(b, points=svg_figure.MAX_POINTS) for b in (live, fresh))
    assert set(got) == set(want)
    for name, data in want.items():
        for key, values in data.items():
            np.testing.assert_array_equal(np.asarray(got[name][key]), np.asarray(values), name)


def test_a_rate_key_learnt_late_smooths_the_whole_run_again():
    from sagenb.display.step_columns import StepColumns, smoothed

    rows = [
        {keys.STEP: s, keys.LOSS: 1.0, keys.RANK_LOSSES: [1.0], keys.STEP_TIME: 0.1,
         keys.THROUGHPUT: float(s), keys.TOKEN_THROUGHPUT: 10.0 * s}
        for s in range(1, 7)
    ]  # fmt: skip
    columns = StepColumns(replicas=1).update(rows[:3], keys.THROUGHPUT)
    columns.update(rows, keys.TOKEN_THROUGHPUT)
    assert columns.rate.values == smoothed(10.0 * s for s in range(1, 7))
    assert columns.loss.values == smoothed([1.0] * 6) and columns.rows == 6


def test_the_smoothed_loss_follows_a_short_run_and_smooths_a_long_one():
    """The moving average's window suits the run's length (issue 35: notebook 02's 16 steps
    ended with a smoothed loss of ~1.9 over a loss of 0.24, a window of 10 steps anchored on the
    first loss). A loss falling as notebook 02's does, from 4.16 to 0.24 in 16 steps: the old
    line ended at 1.55; this one within 20% of the last loss (0.27: the lag of a 1.6-step
    window). A long noisy run keeps the full smoothing: its line's spread is a fraction of the
    noise's."""
    import math

    from sagenb.display.step_columns import SMOOTHING, smoothing_for

    falling = [4.16 * (0.24 / 4.16) ** (i / 15) for i in range(16)]
    board = new_board(TrainConfig(engines=1, batch_size=8))
    for step, loss in enumerate(falling, 1):
        board.log({**step_metrics(step, 0, True, False), keys.TOTAL_STEPS: 16,
                   keys.LOSS: loss}, step, 0)  # fmt: skip
    line = charts.trace_data(board)["loss (smoothed)"]["y"]
    assert line[0] == pytest.approx(falling[0])  # bias-corrected: no pull towards 0
    assert line[-1] == pytest.approx(falling[-1], rel=0.2)
    assert smoothing_for(16) == pytest.approx(0.375) and smoothing_for(None) == SMOOTHING
    assert smoothing_for(100) == smoothing_for(10**6) == SMOOTHING
    noisy = [1.0 + (0.5 if i % 2 else -0.5) for i in range(1000)]
    tail = charts.smoothed(noisy, smoothing_for(1000))[100:]
    assert max(tail) - min(tail) < 0.11 * (max(noisy) - min(noisy))
    assert not any(math.isnan(v) for v in tail)


def test_the_schedule_rows_run_stage_by_stage_where_engines_hold_several():
    """In a V engine 0 holds stages 0 and 3, engine 1 stages 1 and 2: the rows still run
    stage 0, 1, 2, 3 down, and ZB-V's weight gradients are drawn on their own."""
    config = TrainConfig(
        engines=2, batch_size=8, strategy="model", partitions=2, schedule="zbv", microbatches=4
    )
    board = new_board(config)
    for rank, stages in enumerate([(0, 3), (1, 2)]):
        metrics = step_metrics(1, rank, rank == 0, pipeline=True)
        events = [
            [k, s, 0, 0.001 * i, 0.001 * i + 0.0005] for i, s in enumerate(stages) for k in "FBW"
        ]
        metrics[keys.TIMELINE] = events
        board.log(metrics, 1, rank)
    drawn = {t.meta: t for t in board.to_figure().data}
    rows = list(dict.fromkeys(drawn["forward"].y))
    assert rows == [f"stage {s}" for s in range(4)]
    assert sorted(drawn["weight gradient"].y) == rows
    # B is then the input's gradient alone: the legend says so, as the teaching page does
    assert (drawn["backward"].name, drawn["weight gradient"].name) == (
        "input gradient",
        "weight gradient",
    )
