"""Every step of every rank reaches the notebook, in order, also when it polls slowly."""

from __future__ import annotations

import sagenb
from sagenb import session

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
    monkeypatch.setattr(session, "POLL_S", 2.0)
    result = sagenb.train(REGRESSION_CELL, batch_size=2, epochs=2, dashboard=False)
    expected = list(range(1, 193))
    assert per_rank_steps(result) == {0: expected, 1: expected}
    assert [row["step"] for row in result.history] == expected


def test_dashboard_records_every_step(pool):
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=10)
    board = result.dashboard
    traces = board.to_figure().data
    mean_loss = next(t for t in traces if t.name == "loss (global batch)")
    assert list(mean_loss.x) == list(range(1, 11))
    assert list(mean_loss.y) == result.losses
    bars = [t for t in traces if t.type == "bar"]
    assert {len(t.x) for t in bars} == {2}  # one bar per engine, per memory kind
    assert board.status == "done"
    assert board.cost_points[-1][1] == result.cost_usd


def test_live_dashboard_redraws_are_throttled():
    import time

    from sagenb.config import TrainConfig
    from sagenb.cost import CostMeter, instance_price
    from sagenb.dashboard import REDRAW_S, Dashboard

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
    board.finish(elapsed, failed=False)
    assert board.redraws <= elapsed / REDRAW_S + 2  # a fast run does not flood the browser
    widget_trace = board._figure_widget.data[2]  # the global-batch loss, as the browser has it
    assert len(widget_trace.x) == steps
    assert "done" in board._header.value and f"step {steps}/{steps}" in board._header.value
