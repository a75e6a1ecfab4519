"""The magics end to end through a real IPython shell, and bad input caught before any engine."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import sagenb
from sagenb.config import TrainConfig, every_option, flag_name
from sagenb.metrics.result import TrainResult
from sagenb.notebook.magics import parse_train_line, train_parser
from sagenb.pool import cluster

from .conftest import REGRESSION_CELL, SGD_MOMENTUM
from .helpers import assert_params_equal
from .reference import train_reference


def test_magic_trains_and_stores_the_result(shell, pool):
    cell = REGRESSION_CELL + SGD_MOMENTUM
    shell.run_cell_magic(
        "smp_train",
        "--strategy data --batch-size 32 --steps 20 --epochs 4 --out res --no-dashboard",
        cell,
    )
    result = shell.user_ns["res"]
    assert isinstance(result, TrainResult)
    model, losses, _ = train_reference(cell, batch_size=32, steps=20, epochs=4)
    assert len(result.history) == 20
    assert_params_equal(result.state_dict(), model)


def test_default_out_name(shell, pool):
    shell.user_ns.pop("smp_result", None)
    shell.run_cell_magic("smp_train", "--batch-size 64 --steps 2", REGRESSION_CELL)
    assert isinstance(shell.user_ns["smp_result"], TrainResult)
    assert shell.user_ns["smp_result"].dashboard is not None


def cell_with_marker(tmp_path, body=REGRESSION_CELL):
    marker = tmp_path / "ran"
    return marker, f"open({str(marker)!r}, 'w').close()\n" + body


@pytest.mark.parametrize(
    "line, message",
    [
        ("--batch-sise 32", "unrecognized arguments: --batch-sise 32"),
        ("--engines 0", r"--engines 0: must be an integer >= 1"),
        ("--batch-size 33", r"--batch-size 33: must be divisible by engines x grad-accum = 2 x 1"),
        ("--lr -0.1", r"--lr -0.1: must be a finite number >= 0"),
        (
            "--strategy tensor --tensor-parallel 3",
            r"--tensor-parallel 3: must divide --engines \(2\)",
        ),
        ("--no-reshard-after-forward", r"--reshard-after-forward False: --no-reshard-after"),
        ("--precision fp8", r"argument --precision: invalid choice"),
        ("--strategy model --partitions 2 --microbatches 1", r"--microbatches 1: 1f1b needs"),
        ("--strategy pipeline", r"argument --strategy: invalid choice"),
        ("--engines 4", r"--engines 4: the running pool has 2 engines"),
        ("--instance ml.x9.huge", r"--instance 'ml.x9.huge': must be one of .*ml.p4d.24xlarge"),
        ("--steps 1.5", r"argument --steps: invalid int value"),
    ],
)
def test_bad_flags_fail_before_any_engine_runs(shell, pool, tmp_path, line, message):
    marker, cell = cell_with_marker(tmp_path)
    with pytest.raises(UsageError, match=message):
        shell.run_cell_magic("smp_train", line, cell)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["model", "dataset"])
def test_cell_without_a_required_name(shell, pool, tmp_path, name):
    body = REGRESSION_CELL.replace(f"\n{name} =", "\nsomething_else =")
    marker, cell = cell_with_marker(tmp_path, body)
    with pytest.raises(UsageError, match=f"the cell defines no {name}"):
        shell.run_cell_magic("smp_train", "--batch-size 32", cell)
    assert not marker.exists()


def test_cell_without_loss_fn_needs_dict_samples(shell, pool):
    """loss_fn may be left out only where the model computes its own loss from dict samples'
    labels; what the samples are is known once the cell has run, so the engines refuse it
    before the first step."""
    cell = REGRESSION_CELL.replace("\nloss_fn =", "\nsomething_else =")
    with pytest.raises((UsageError, sagenb.JobError), match="defines no loss_fn, and its sam"):
        shell.run_cell_magic("smp_train", "--batch-size 32", cell)


def test_bad_input_starts_no_pool(shell, tmp_path):
    cluster.stop_pool()
    marker, cell = cell_with_marker(tmp_path, "x = 1\n")
    with pytest.raises(UsageError, match="defines no model, dataset"):
        shell.run_cell_magic("smp_train", "--batch-size 32", cell)
    with pytest.raises(UsageError, match="--batch-size 33"):
        shell.run_cell_magic("smp_train", "--batch-size 33 --engines 2", REGRESSION_CELL)
    assert cluster.current_pool() is None


def test_dataset_smaller_than_a_batch_is_a_usage_error(shell, pool):
    cell = REGRESSION_CELL.replace("randn(192", "randn(10")
    with pytest.raises(UsageError, match=r"dataset has 10 samples, fewer than one global batch"):
        shell.run_cell_magic("smp_train", "--batch-size 32 --no-dashboard", cell)


def test_help_lists_every_flag_with_its_default(shell):
    text = train_parser().format_help()
    # every option, a strategy's own too (strategy_options, the field that holds those, is none)
    for option in every_option(TrainConfig):
        assert flag_name(option.name) in text  # --dashboard too: --dashboard/--no-dashboard
    assert "(default: 32)" in text  # --batch-size
    doc = shell.find_cell_magic("smp_train").__doc__
    assert "--batch-size" in doc and "--grad-accum" in doc


def test_config_round_trips_through_its_magic_line():
    config = TrainConfig(engines=2, batch_size=64, lr=0.01, grad_accum=2, dashboard=False, out="r")
    line = config.to_flags().removeprefix("%%smp_train ")
    assert parse_train_line(line) == config


@pytest.mark.pool  # starts a pool itself, with no fixture to show it
def test_cluster_magic_lifecycle(shell, capsys):
    """status / stop / start -n / restart, and %%smp_train starting a pool when none runs."""
    import psutil

    cluster.stop_pool()
    shell.run_line_magic("smp_cluster", "status")
    assert "no engine pool is running" in capsys.readouterr().out
    shell.run_cell_magic(
        "smp_train", "--engines 1 --batch-size 32 --steps 2 --no-dashboard", REGRESSION_CELL
    )
    assert cluster.current_pool().size == 1  # a cold start of --engines engines
    shell.run_line_magic("smp_cluster", "restart -n 2")
    out = capsys.readouterr().out
    assert "2 engines" in out and "rank" in out and "threads" in out
    pids = [row.pid for row in cluster.current_pool().status()]
    assert all(psutil.pid_exists(p) for p in pids)
    shell.run_line_magic("smp_cluster", "stop")
    assert "stopped" in capsys.readouterr().out
    assert cluster.current_pool() is None
    # nothing left behind once stop returns: no engine, nanny or controller process
    assert not any(psutil.pid_exists(p) for p in pids)
    assert cluster._pool_processes() == []
    with pytest.raises(UsageError, match="-n 0"):
        shell.run_line_magic("smp_cluster", "start -n 0")
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("smp_cluster", "launch")
