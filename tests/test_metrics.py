"""Every step of every rank reaches the notebook, in order, also when it polls slowly."""

from __future__ import annotations

import pytest

import sagenb
from sagenb.run import training_run

from .conftest import REGRESSION_CELL


def per_rank_steps(result) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for rec in result.metrics:
        steps.setdefault(rec.rank, []).append(rec.step)
    return steps


def test_every_step_of_every_rank_arrives_in_order(pool):
    result = sagenb.train(REGRESSION_CELL, batch_size=8, epochs=2, dashboard=False)
    expected = list(range(1, 49))
    assert per_rank_steps(result) == {0: expected, 1: expected}
    for rec in result.metrics:
        for key in ("loss", "step_time(s)", "throughput(samples/s)", "memory/params(MiB)"):
            assert key in rec.values
        assert rec.values["memory/params(MiB)"] > 0
        assert rec.values["memory/activations(MiB)"] > 0


def test_slow_polling_loses_nothing(pool, monkeypatch):
    # A poll every 2 s while ~200 steps are published per rank: one key per step survives
    # AsyncResult.data's dict.update, where a single reused key would keep only the last.
    monkeypatch.setattr(training_run, "POLL_S", 2.0)
    result = sagenb.train(REGRESSION_CELL, batch_size=2, epochs=2, dashboard=False)
    expected = list(range(1, 193))
    assert per_rank_steps(result) == {0: expected, 1: expected}
    assert [row["step"] for row in result.history] == expected


def test_dashboard_records_every_step(pool):
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=10)
    board = result.dashboard
    traces = board.to_figure().data
    smoothed = next(t for t in traces if t.meta == "loss (smoothed)")  # identity: meta
    assert list(smoothed.x) == list(range(1, 11))  # one point per step
    assert smoothed.y[0] == result.losses[0]
    replicas = [t for t in traces if t.meta.startswith("replica")]
    assert [list(t.y) for t in replicas] == [
        [row["rank_losses"][r] for row in result.history] for r in range(2)
    ]
    bars = [t for t in traces if t.name in ("params", "grads", "optimizer", "activations")]
    assert {len(t.x) for t in bars} == {2}  # one bar per engine, per memory kind
    assert board.status == "done"
    assert board.cost_points[-1][1] == result.cost_usd


def test_live_dashboard_redraws_are_throttled():
    import time

    from sagenb.config import TrainConfig
    from sagenb.display.dashboard import REDRAW_S, Dashboard, figure_period
    from sagenb.display.svg_figure import MAX_POINTS
    from sagenb.sizing.cost import CostMeter, instance_price

    config = TrainConfig(engines=2, batch_size=8)
    board = Dashboard(config, CostMeter(instance_price(config.instance), 2), live=True)
    started = time.perf_counter()
    steps = 3000
    for step in range(1, steps + 1):
        for rank in (0, 1):
            board.log(
                {
                    "step": step,
                    "total_steps": steps,
                    "epoch": 0,
                    "loss": 1.0 / step,
                    "lr": 0.1,
                    "step_time(s)": 0.001,
                    "memory/params(MiB)": 1.0,
                },
                step,
                rank,
            )
        board.tick(time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    board.finish(elapsed, status="done")
    # a fast run does not flood the browser: the figure at most once a second here
    assert board.redraws <= elapsed / REDRAW_S + 2
    assert [figure_period(t) for t in (0, 5.4, 12, 30, 3600)] == [2.0, 2.0, 4.0, 5.0, 5.0]
    # the smoothed loss, as the browser has it: by its name, wherever the spec puts it
    drawn = board._figure_widget.drawing.values("loss (smoothed)", "x")
    # a long run is drawn every k-th step (k = 10 here) from the first, ending with the last:
    # the page is sent what it draws, ~MAX_POINTS a line
    assert len(drawn) == steps // 10 + 1 == MAX_POINTS + 1
    assert drawn[:2] == [1, 11] and drawn[-2:] == [steps - 9, steps]
    header = board._figure_widget.header
    assert "done" in header and f"step {steps}/{steps}" in header


def test_pipeline_dashboard_draws_the_schedule_and_the_cost(pool):
    from .models import SEQUENTIAL_CELL

    result = sagenb.train(
        SEQUENTIAL_CELL, strategy="model", partitions=2, microbatches=4, batch_size=32, steps=8
    )
    board = result.dashboard
    traces = {t.name: t for t in board.to_figure().data}
    for kind in ("forward", "backward"):  # every microbatch of the last step, on both stages
        assert sorted(traces[kind].y) == ["stage 0"] * 4 + ["stage 1"] * 4
        assert sorted(traces[kind].text) == sorted("01230123")
    rows = result.history
    assert all(r["busy(s)"] > 0 and r["idle(s)"] >= 0 for r in rows)
    costs = [c for _, c in board.cost_points]
    assert costs == sorted(costs)  # never decreases
    assert board.projected_cost() == pytest.approx(result.cost_usd)  # converges to the final
    assert board.cost.spot(result.cost_usd) == pytest.approx(0.3 * result.cost_usd)
    assert "model: 2 partitions x 1 replica, 1f1b, 4 microbatches" in board.header_text()


def test_a_resumed_run_counts_its_progress_from_its_checkpoint():
    from sagenb.config import TrainConfig
    from sagenb.display.dashboard import Dashboard
    from sagenb.sizing.cost import CostMeter, instance_price

    config = TrainConfig(engines=1, batch_size=8)
    board = Dashboard(config, CostMeter(instance_price(config.instance), 1), live=False)
    for step in range(21, 27):  # resumed from step 20's checkpoint: 6 of 12 steps done
        row = dict(step=step, total_steps=32, epoch=1, loss=1.0, lr=0.1)
        board.log({**row, "step_time(s)": 1.0}, step, 0)
    board.elapsed = 6.0
    assert "step 26/32" in board.header_text() and "~6 s left" in board.header_text()
    assert board.projected_cost() == pytest.approx(board.cost.cost(12.0))


def test_a_stream_of_unknown_length_shows_its_steps_without_a_total():
    """A stream's total is unknown until the engines read its end (engine/data/stream.py):
    "step N/?", an indeterminate bar and no time left, then the total its last step gives."""
    from sagenb.config import TrainConfig
    from sagenb.display.dashboard import Dashboard
    from sagenb.sizing.cost import CostMeter, instance_price

    config = TrainConfig(engines=1, batch_size=8)
    board = Dashboard(config, CostMeter(instance_price(config.instance), 1), live=False)
    for step in range(1, 4):
        row = dict(step=step, total_steps=None, epoch=0, loss=1.0, lr=0.1)
        board.log({**row, "step_time(s)": 1.0}, step, 0)
    board.elapsed = 3.0
    assert "step 3/?" in board.header_text() and "left" not in board.header_text()
    assert "<progress style=" in board._header_html()  # no value: indeterminate
    board.log({**row, "step": 4, "total_steps": 4, "step_time(s)": 1.0}, 4, 0)
    assert "step 4/4" in board.header_text()
