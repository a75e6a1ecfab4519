"""`sagenb.compare`: several finished runs side by side (issue 17), pool-free: the results are
built from recorded histories, as the session builds them."""

from __future__ import annotations

import dataclasses

import pytest

import sagenb
from sagenb.config import TrainConfig
from sagenb.display.comparison import compare, labels
from sagenb.metrics import keys
from sagenb.metrics.result import TrainResult
from sagenb.metrics.stream import History


def recorded(strategy: str, engines: int, steps: int, step_s: float, **options) -> TrainResult:
    """A finished run of `steps` steps of `step_s` seconds, as the session records it."""
    config = TrainConfig(strategy=strategy, batch_size=8, **options).with_engines(engines)
    history = History(engines, 8)
    for step in range(1, steps + 1):
        for rank in range(engines):
            history.log(
                {
                    keys.STEP: step, keys.EPOCH: 0, keys.LR: 0.1, keys.LOSS: 1.0 / step,
                    keys.STEP_TIME: step_s, keys.TIME: 1000.0 + step * step_s,
                    **{keys.memory(k): 1.0 + rank + i for i, k in enumerate(keys.MEMORY_KINDS)},
                },
                step,
                rank,
            )  # fmt: skip
    return TrainResult(
        config=config, history=history.steps, metrics=history.records,
        wall_time_s=1.0 + steps * step_s, time_to_first_step_s=1.0, cost_usd=0.01 * engines,
        cost_label=f"${0.01 * engines:.2f}", engines=engines, device="cpu", source=None,
        status="done", _state_dict={},
    )  # fmt: skip


def test_runs_are_drawn_side_by_side_labelled_by_their_layouts():
    data = recorded("data", 2, 10, 0.5)
    one = recorded("data", 1, 10, 0.8)
    sharded = recorded("sharded", 2, 6, 0.7)
    assert labels([data, one, sharded]) == [
        "data parallel on 2 engines", "data parallel on 1 engine", "sharded (ZeRO-3) on 2 engines",
    ]  # fmt: skip
    fig = sagenb.compare(data, one, sharded)
    by_panel: dict[str, list] = {}
    for trace in fig.data:
        by_panel.setdefault(trace.xaxis, []).append(trace)
    loss_step, loss_time, rate, cost, memory = (
        by_panel[f"x{i if i > 1 else ''}"] for i in range(1, 6)
    )
    assert [t.name for t in loss_step] == labels([data, one, sharded])
    assert list(loss_step[2].x) == list(range(1, 7)) and loss_step[2].y[-1] == pytest.approx(1 / 6)
    # wall time: the first step at the time to first step, then by the engines' clock
    assert list(loss_time[0].x) == pytest.approx([1.0 + 0.5 * i for i in range(10)])
    assert list(rate[1].y) == pytest.approx([8 / 0.8] * 10)  # smoothed: a constant stays put
    assert [t.y[0] for t in cost] == [0.02, 0.01, 0.02]
    titles = [a.text for a in fig.layout.annotations]
    assert "Cost (USD)" in titles  # billed on the instance's kind of hardware: a cost
    # a CPU's seconds at a GPU instance's price are labelled as what they are, as the
    # dashboard labels them
    cpu = dataclasses.replace(data, billed=False)
    titles = [a.text for a in sagenb.compare(cpu, one).layout.annotations]
    assert "Cost (USD)" not in titles
    assert any("not what these runs cost" in t for t in titles)
    # memory: one bar per engine of every run, the four kinds stacked
    assert len(memory) == 4 * 3
    params = [t for t in memory if t.name == "params"]
    assert [len(t.y) for t in params] == [2, 1, 2] and list(params[0].y) == [1.0, 2.0]


def test_same_layouts_are_numbered_and_bad_calls_say_how():
    a, b = recorded("data", 2, 3, 0.1), recorded("data", 2, 3, 0.1)
    assert labels([a, b]) == ["data parallel on 2 engines #1", "data parallel on 2 engines #2"]
    assert [t.name for t in compare(a, b, names=["lr 0.1", "lr 0.01"]).data if t.xaxis == "x"] == [
        "lr 0.1", "lr 0.01"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one TrainResult"):
        compare()
    with pytest.raises(ValueError, match="2 names for 1 runs"):
        compare(a, names=["x", "y"])


def test_memory_kinds_have_their_colours_and_the_runs_readable_labels():
    """Each memory kind has one colour across the runs, the dashboard's (issue 35: in each
    run's colour, the legend showed four squares of one colour); each bar is labelled by its
    engine, and each run's name stands once under its bars, not joined to every engine's
    label, where the labels ran into each other."""
    import re

    from sagenb.display.charts import MEMORY_COLOURS
    from sagenb.display.svg_figure import to_svg

    runs = [recorded("data", 2, 4, 0.5), recorded("sharded", 2, 4, 0.7),
            recorded("tensor", 2, 4, 0.7)]  # fmt: skip
    fig = compare(*runs)
    memory = [t for t in fig.data if t.xaxis == "x5"]
    colours = {t.name: {t.marker.color} for t in memory}
    for t in memory:
        colours[t.name].add(t.marker.color)
    assert colours == {k: {c} for k, c in zip(keys.MEMORY_KINDS, MEMORY_COLOURS)}
    svg = to_svg(fig)
    legend = re.findall(r"<rect x='[^']+' y='[^']+' width='10' height='8' fill='([^']+)'/>"
                        r"<text[^>]*>([^<]+)</text>", svg)  # fmt: skip
    assert [(n, c) for c, n in legend if n in keys.MEMORY_KINDS] == list(
        zip(keys.MEMORY_KINDS, MEMORY_COLOURS)
    )
    ticks = re.findall(r"<text class='x5tick' x='([^']+)'[^>]*>([^<]+)</text>", svg)
    assert [t for _, t in ticks] == ["engine 0", "engine 1"] * 3
    # ~5.5 px a letter at 10 px: each label fits in the room between its neighbours
    xs = [float(x) for x, _ in ticks]
    widest = max(5.5 * len(t) for _, t in ticks)
    assert min(b - a for a, b in zip(xs, xs[1:])) > widest
    names = re.findall(r"font-weight='bold'>([^<]+)</text>", svg)
    assert names == labels(runs)
