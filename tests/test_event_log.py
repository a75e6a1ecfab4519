"""--log-dir (issue 17 item 6): each step's history as TensorBoard event files, read back with
TensorBoard's own reader; without the tensorboard extra, a clear error before any engine."""

from __future__ import annotations

import sys

import pytest

import sagenb
from sagenb.config import ConfigError, TrainConfig
from sagenb.pool import cluster

from .conftest import REGRESSION_CELL


def read_back(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) pairs, as TensorBoard reads the folder."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_without_tensorboard_the_error_names_the_extra_before_any_engine(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    before = cluster.current_pool()
    with pytest.raises(ConfigError, match=r"--log-dir .*pip install 'sagenb\[tensorboard\]'"):
        sagenb.train(REGRESSION_CELL, log_dir=str(tmp_path), batch_size=16, steps=3)
    assert cluster.current_pool() is before and not any(tmp_path.iterdir())


def test_log_dir_is_a_notebook_option():
    config = TrainConfig(log_dir="runs")
    assert "log_dir" not in vars(config.for_engines())  # written here, never sent to engines
    with pytest.raises(ConfigError, match="--log-dir ''"):
        TrainConfig(log_dir="")


def test_each_step_is_written_and_read_back(pool, tmp_path):
    pytest.importorskip("tensorboard")
    result = sagenb.train(
        REGRESSION_CELL, log_dir=str(tmp_path), batch_size=16, steps=7, dashboard=False
    )
    (folder,) = tmp_path.iterdir()  # one folder per run
    assert folder.name.endswith("_data-2")
    scalars = read_back(folder)
    steps = list(range(1, 8))
    assert [s for s, _ in scalars["loss"]] == steps
    assert [v for _, v in scalars["loss"]] == pytest.approx(result.losses, rel=1e-6)
    assert [v for _, v in scalars["loss/replica 1"]] == pytest.approx(
        [row["rank_losses"][1] for row in result.history], rel=1e-6
    )
    assert [s for s, _ in scalars["throughput(samples/s)"]] == steps
    assert [s for s, _ in scalars["memory/params(MiB)/engine 1"]] == steps
    second = sagenb.train(
        REGRESSION_CELL, log_dir=str(tmp_path), batch_size=16, steps=2, dashboard=False
    )
    assert len(list(tmp_path.iterdir())) == 2 and second.status == "done"
