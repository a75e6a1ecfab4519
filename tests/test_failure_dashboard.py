"""After a failure the dashboard reads the last step every rank finished (issue 17): status,
step, epoch, elapsed time, cost so far and the charts, for each kind of failure."""

from __future__ import annotations

import importlib.util
import math

import pytest

import sagenb
from sagenb.run.failures import (
    EngineDiedError,
    OutOfMemoryError,
    StalledError,
    TrainingError,
    TrainingInterrupted,
)

from .conftest import REGRESSION_CELL
from .helpers import fault_cell, interrupt_after

AT = 23  # loss_fn's call (= the step) in which rank 1 fails; 22 steps were finished by all
RUN = dict(batch_size=16, epochs=3, dashboard=True, live=False)  # 36 steps of ~10 ms


def assert_reads_step(result, step: int) -> None:
    """The failed run's result and dashboard stand at `step`, whatever the failure was."""
    board = result.dashboard
    assert [row["step"] for row in result.history] == list(range(1, step + 1))
    assert f"| step {step}/36, epoch {result.history[-1]['epoch'] + 1}/3 |" in board.header_text()
    loss = next(t for t in board.to_figure().data if t.meta == "loss (smoothed)")
    assert list(loss.x) == list(range(1, step + 1))
    assert board.elapsed > 0 and board.elapsed == result.wall_time_s
    assert board.cost_points[-1] == (board.elapsed, board.cost.cost(board.elapsed))
    assert board.cost_points[-1][1] > 0 and "| 0 s elapsed" not in board.header_text()


@pytest.mark.parametrize(
    "action, error",
    [
        ("raise ValueError('bad batch on purpose')", TrainingError),
        ("raise MemoryError('out of memory on purpose')", OutOfMemoryError),
        ("os.kill(os.getpid(), signal.SIGKILL)", EngineDiedError),
    ],
    ids=["exception", "oom", "killed"],
)
def test_failed_run_reads_its_last_step(pool, action, error):
    with pytest.raises(error) as info:
        sagenb.train(fault_cell(action, at_call=AT), **RUN)
    result = info.value.result
    assert result.status == "failed" and result.dashboard.status == "failed"
    assert_reads_step(result, AT - 1)


def test_killed_engine_steps_are_settled_from_its_peers(pool, tmp_path):
    """The killed rank's unsent steps are rows of the other rank's loss, marked as such, and
    reach the other sinks too (--log-dir's event files, when tensorboard is installed)."""
    logs = {"log_dir": str(tmp_path)} if importlib.util.find_spec("tensorboard") else {}
    with pytest.raises(EngineDiedError) as info:
        sagenb.train(fault_cell("os.kill(os.getpid(), signal.SIGKILL)", at_call=AT), **RUN, **logs)
    result = info.value.result
    lost = [row for row in result.history if "lost_ranks" in row]
    assert lost and all(row["lost_ranks"] == [1] for row in lost)
    assert all(math.isnan(row["rank_losses"][1]) for row in lost)
    assert all(row["loss"] == row["rank_losses"][0] for row in lost)
    assert any("lost with its engine" in w for w in result.dashboard.warnings)
    if logs:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (folder,) = tmp_path.iterdir()
        events = EventAccumulator(str(folder))
        events.Reload()
        assert [e.step for e in events.Scalars("loss")] == list(range(1, AT))


def test_stalled_run_reads_its_last_step(pool):
    with pytest.raises(StalledError) as info:
        sagenb.train(fault_cell("while True: pass", at_call=AT), timeout=3, **RUN)
    assert_reads_step(info.value.result, AT - 1)


class _InterruptLater:
    """A sink that presses the interrupt button 1 s after the first step arrived (timed from
    the run's start, an interrupt could land in a first run's imports on a busy machine)."""

    def __init__(self) -> None:
        self.timer = None

    def log(self, metrics, step, rank) -> None:
        if self.timer is None:
            self.timer = interrupt_after(1.0)

    def close(self) -> None:
        pass


def test_interrupted_run_reads_its_last_step(pool):
    slow = REGRESSION_CELL + (
        "\nimport time\ndef loss_fn(o, t):\n    time.sleep(0.2)\n"
        "    return nn.functional.mse_loss(o, t)\n"
    )
    with pytest.raises(TrainingInterrupted) as info:
        sagenb.train(slow, sinks=[_InterruptLater()], **RUN)
    result = info.value.result
    steps = len(result.history)
    assert 1 < steps < 36 and result.dashboard.status == "interrupted"
    assert_reads_step(result, steps)
