"""No silent wrong result, nothing lost at the end of a run: a run is "done" only when every
rank finished its plan, only the run's own participants can stop it, a non-finite loss is
said, and a run that fails keeps what it trained (`err.result`, smp_result)."""

from __future__ import annotations

import psutil
import pytest

import sagenb
from sagenb.run.failures import TrainingError

from .conftest import REGRESSION_CELL
from .helpers import assert_params_equal, fault_cell
from .reference import train_reference

# a separate process that finds the run's store (the port rank 0 is connected to) and sends
# every stop message of the protocol, as a process on the same machine could (the store has
# no authentication and lists its keys to any client)
FORGER = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=datetime.timedelta(seconds=5))
keys = store.list_keys()
store.set("sagenb/stop_requested", "1")
store.set("sagenb/stop_after_step/1", "6")
for key in keys:
    if key.startswith("sagenb/"):
        store.set(key, "1")
print("forged", len(keys), "keys", flush=True)
"""

FORGING = (
    "import subprocess, sys\n"
    "            from sagenb.engine.wire import process_group\n"
    "            port = process_group._store.port\n"
    f"            subprocess.run([sys.executable, '-c', {FORGER!r}, str(port)], check=True)"
)


def test_stop_messages_from_another_process_are_ignored(pool):
    """The forged requests carry no run token: the run trains to its end, as one process."""
    cell = fault_cell(FORGING, at_call=5, rank=0)
    result = sagenb.train(cell, batch_size=16, epochs=5, dashboard=False)
    assert result.status == "done" and len(result.history) == 60
    model, _, _ = train_reference(REGRESSION_CELL, batch_size=16, epochs=5)
    assert_params_equal(result.state_dict(), model)


def test_a_stop_request_the_notebook_did_not_send_is_not_done(pool):
    """A request with the run's token (here from the cell itself, on rank 1) stops the run at a
    step boundary: "interrupted", by whom it says, with a warning; never "done"."""
    cell = fault_cell(
        "from sagenb.engine.wire import process_group, stopping\n"
        "            stopping.request(process_group._store, process_group._stop_watch.token)",
        at_call=5,
    )
    with pytest.warns(RuntimeWarning, match=r"stopped after step \d+ of 60: a stop request"):
        result = sagenb.train(cell, batch_size=16, epochs=5, dashboard=False)
    assert result.status == "interrupted" and "did not send" in result.stopped_by
    assert 5 <= len(result.history) < 60
    assert "interrupted by a stop request" in result.summary()


NAN_CELL = (
    REGRESSION_CELL
    + """
import time
calls = [0]
def loss_fn(output, target):
    calls[0] += 1
    time.sleep(0.01)  # the notebook hears of a step's loss within about half a second
    loss = torch.nn.functional.mse_loss(output, target)
    return loss * float("nan") if calls[0] >= 4 else loss
"""
)


@pytest.mark.parametrize("stop", [False, True], ids=["warned", "stopped"])
def test_a_nonfinite_loss_is_warned_and_can_end_the_run(pool, stop):
    with pytest.warns(RuntimeWarning, match="the loss of step 4 on rank . is nan"):
        result = sagenb.train(
            NAN_CELL, batch_size=16, epochs=20, stop_on_nonfinite=stop, dashboard=False
        )
    assert any("is nan" in w for w in result.warnings)
    if stop:
        assert result.status == "interrupted" and 4 <= len(result.history) < 240
        assert "--stop-on-nonfinite" in result.stopped_by
    else:
        assert result.status == "done" and len(result.history) == 240


def test_a_checkpoint_that_cannot_be_written_keeps_the_trained_result(pool, tmp_path):
    """The checkpoint directory becomes a file mid-run (a disk that fills up, a directory
    removed): the final checkpoint fails, the run says so, and what it trained is kept."""
    where = tmp_path / "ckpt"
    replace_with_file = (
        "import shutil\n"
        f"            shutil.rmtree({str(where)!r}, ignore_errors=True)\n"
        f"            open({str(where)!r}, 'w').close()"
    )
    cell = fault_cell(replace_with_file, at_call=3, rank=0)
    with pytest.raises(TrainingError, match="checkpoint of step 6 could not be written") as info:
        sagenb.train(cell, batch_size=16, steps=6, checkpoint_dir=str(where), dashboard=False)
    failed = info.value.result
    assert failed.status == "failed" and len(failed.history) == 6
    model, _, _ = train_reference(REGRESSION_CELL, batch_size=16, steps=6)
    assert_params_equal(failed.state_dict(), model)
    # the ranks all stopped together: the pool trains the next run at once
    assert len(sagenb.train(REGRESSION_CELL, batch_size=16, steps=2, dashboard=False).history) == 2


def test_after_a_failure_the_magic_keeps_the_failed_run(pool):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    shell.run_cell_magic("smp_train", "--batch-size 16 --steps 2 --no-dashboard", REGRESSION_CELL)
    assert shell.user_ns["smp_result"].status == "done"
    failing = fault_cell("raise ValueError('bad batch on purpose')", at_call=4)
    with pytest.raises(TrainingError, match="bad batch on purpose"):
        shell.run_cell_magic("smp_train", "--batch-size 16 --steps 9 --no-dashboard", failing)
    failed = shell.user_ns["smp_result"]  # not the previous run's result
    assert failed.status == "failed" and len(failed.history) <= 4


def own_listening_ports() -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_a_failed_run_leaves_no_port_open_here(pool):
    """The run's store closes with the run, not with the traceback that still holds it."""
    before = own_listening_ports()
    with pytest.raises(TrainingError) as info:
        sagenb.train(fault_cell("raise ValueError('bad batch on purpose')"), dashboard=False)
    assert info.value.__traceback__ is not None  # the run's frames are still referenced
    assert own_listening_ports() == before


def test_on_failure_hears_of_a_failure_before_the_error(pool):
    """train's public hook, which benchmarks/recovery.py times detection with."""
    heard: list[str] = []
    with pytest.raises(TrainingError):
        sagenb.train(
            fault_cell("raise ValueError('bad batch on purpose')"),
            dashboard=True,
            live=False,  # the dashboard as a sink, without a widget
            on_failure=heard.append,
        )
    assert heard == ["rank failed"]
