"""The live dashboard's Stop button (issue 51): pressed, the run ends at its next step boundary on
every rank, "stopped", nothing lost; heard while the cell is busy following the run.

- pool-free: the button's handler asks the run to stop at the next tick, once; the header and
  the result say "stopped", at which step and by whom; outside a kernel there is no button.
- a real ipykernel, no browser: the page's click, sent while a cell is busy, reaches the
  dashboard during that cell (display/ipykernel_private.py), on the main shell and on a subshell
  (JupyterLab 4.6 sends widgets' messages on one), and a cell queued behind it runs after it,
  once.
- the pool: the handler called while a run trains stops it at a step boundary, every rank at
  the same step, with the parameters of that step.

tests/test_browser.py presses the button in JupyterLab.
"""

from __future__ import annotations

import html
import json
import os
import threading
import time
from pathlib import Path

import pytest

import sagenb
from sagenb.display.dashboard import STOP_BUTTON, Dashboard
from sagenb.run import training_run
from sagenb.sizing.cost import CostMeter, instance_price

from .boards import CONFIGS, new_board, run
from .conftest import REGRESSION_CELL
from .helpers import assert_params_equal
from .reference import train_reference

ROOT = Path(__file__).resolve().parent.parent

# -- the Python side, no kernel -----------------------------------------------------------------


def test_the_handler_asks_the_run_to_stop_at_the_next_tick_once():
    asked: list[str] = []
    board = new_board(CONFIGS["data"])
    board.on_stop = asked.append
    run(board, range(1, 4))
    # the click is heard in ipykernel's shell-channel thread, not the one following the run
    clicker = threading.Thread(target=board.stop_clicked)
    clicker.start()
    clicker.join()
    assert asked == []  # passed on by the thread that follows the run
    board.tick(1.0)
    assert asked == [STOP_BUTTON]
    assert board.header_text().startswith(f"stopping at the next step boundary ({STOP_BUTTON})")
    board.stop_clicked()  # pressed again (a second view of the widget): asked once
    board.tick(2.0)
    assert asked == [STOP_BUTTON]


def test_a_stopped_run_says_who_stopped_it_and_at_which_step():
    board = new_board(CONFIGS["data"])
    run(board, range(1, 6))
    board.finish(5.0, status="stopped", stopped_by=STOP_BUTTON)
    header = board.header_text()
    assert header.startswith(f"stopped at step 5 of 12 by {STOP_BUTTON} | "), header
    assert "| step 5/12, epoch 1/" in header and "left" not in header
    static = board.static_html()
    assert html.escape(f"stopped at step 5 of 12 by {STOP_BUTTON}") in static
    assert "smp-stop" not in static and "<button" not in static  # the static copy: no button


def test_a_done_run_reads_as_before():
    board = new_board(CONFIGS["data"])
    run(board, range(1, 13))
    board.finish(12.0, status="done")
    assert board.header_text().startswith("done | data parallel on 2 engines | step 12/12")


def test_outside_a_kernel_there_is_no_button():
    """A live dashboard with a run to stop, in a process with no kernel (a test, a script):
    the widget's comm cannot hear a click during the cell, so no button is shown."""
    config = CONFIGS["data"]
    cost = CostMeter(instance_price(config.instance), 2)
    board = Dashboard(config, cost, live=True, on_stop=lambda who: None)
    assert board._figure_widget is not None and not board._figure_widget.stoppable
    run(board, range(1, 4))
    board.tick(1.0)
    board.finish(3.0, status="done")
    assert board.header_text().startswith("done | ")


# -- a real kernel: the click heard during a busy cell ------------------------------------------

SETUP = """
import time
from sagenb.config import TrainConfig
from sagenb.display.dashboard import Dashboard
from sagenb.sizing.cost import CostMeter, instance_price
config = TrainConfig(engines=2, batch_size=8)
asked = []
board = Dashboard(config, CostMeter(instance_price(config.instance), 2), live=True,
                  on_stop=asked.append)
print(json.dumps({"comm": board._figure_widget.model_id,
                  "stoppable": board._figure_widget.stoppable}))
"""
# as the session follows a run: tick every 0.05 s, redrawing every second, for up to BUSY_S
BUSY_S = 10.0
BUSY = f"""
start = time.monotonic()
while not asked and time.monotonic() - start < {BUSY_S}:
    board.tick(time.monotonic() - start)
    time.sleep(0.05)
print(json.dumps({{"asked": asked, "after_s": time.monotonic() - start,
                  "stopping": board._figure_widget.stopping}}))
"""
QUEUED = "queued = globals().get('queued', 0) + 1\nprint(json.dumps({'queued': queued}))"
CLICK_AFTER_S = 1.0


@pytest.fixture
def kernel(tmp_path):
    """A real ipykernel (jupyter_client), this checkout on its path; shut down after."""
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _outputs(kc, msg_id: str, timeout_s: float = 120.0) -> list[dict]:
    """The JSON lines the cell of `msg_id` printed, once it is idle; its error fails."""
    printed, deadline = [], time.monotonic() + timeout_s
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "error":
            pytest.fail(f"{content['ename']}: {content['evalue']}")
        if kind == "stream":
            printed += [json.loads(line) for line in content["text"].splitlines() if line]
        if kind == "status" and content["execution_state"] == "idle":
            return printed


def _replies(kc, count: int, timeout_s: float = 60.0) -> list[str]:
    """The msg_ids of the next `count` shell replies, in the order the kernel sent them."""
    return [kc.get_shell_msg(timeout=timeout_s)["parent_header"]["msg_id"] for _ in range(count)]


@pytest.mark.pool  # starts a kernel
@pytest.mark.parametrize("on_subshell", [False, True], ids=["main shell", "subshell"])
def test_a_click_during_a_busy_cell_is_heard_and_the_next_cell_runs_once(kernel, on_subshell):
    kc = kernel
    setup = kc.execute("import json\n" + SETUP)
    (shown,) = _outputs(kc, setup)
    assert shown["stoppable"], "no Stop button in a real kernel"
    _replies(kc, 1)
    busy = kc.execute(BUSY)
    queued = kc.execute(QUEUED)  # the next cell, queued behind the busy one
    subshell = None
    if on_subshell:  # as JupyterLab 4.6 sends a widget's messages (commsOverSubshells)
        kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
        subshell = kc.control_channel.get_msg(timeout=30)["content"]["subshell_id"]
    time.sleep(CLICK_AFTER_S)
    data = {"method": "custom", "content": {"event": "stop"}}
    click = kc.session.msg("comm_msg", {"comm_id": shown["comm"], "data": data})
    if subshell is not None:
        click["header"]["subshell_id"] = subshell
    kc.shell_channel.send(click)
    (done,) = _outputs(kc, busy)
    # heard while the cell ran: within a few ticks of the click, not when the cell gave up
    assert done["asked"] == [STOP_BUTTON] and done["stopping"], done
    assert done["after_s"] < BUSY_S / 2, done
    assert _outputs(kc, queued) == [{"queued": 1}]
    # the busy cell answered first, then the queued one: the order the cells were sent in
    assert _replies(kc, 2) == [busy, queued]


# -- the pool: the handler called while a run trains --------------------------------------------

RUN = dict(batch_size=2, epochs=200, live=False)  # ~19,000 tiny steps: time to press Stop


def test_the_stop_handler_ends_a_run_at_a_step_boundary(pool, monkeypatch):
    boards = []

    def dashboard(*args, **kwargs):
        boards.append(made(*args, **kwargs))
        return boards[-1]

    made = training_run._make_dashboard
    monkeypatch.setattr(training_run, "_make_dashboard", dashboard)

    def press_stop() -> None:  # from another thread, as ipykernel's shell-channel thread does
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if boards and len(boards[0].history.steps) >= 20:
                boards[0].stop_clicked()
                return
            time.sleep(0.05)

    presser = threading.Thread(target=press_stop, daemon=True)
    presser.start()
    result = sagenb.train(REGRESSION_CELL, **RUN)
    presser.join(timeout=5)
    steps, planned = len(result.history), 200 * 96
    assert result.status == "stopped" and result.stopped_by == STOP_BUTTON
    assert 20 <= steps < planned, steps
    assert [row["step"] for row in result.history] == list(range(1, steps + 1))
    # every rank reported the same last step, and the header names it
    last = {}
    for record in result.metrics:
        last[record.rank] = max(last.get(record.rank, 0), record.step)
    assert last == {0: steps, 1: steps}, last
    board = result.dashboard
    assert board.status == "stopped"
    assert board.header_text().startswith(
        f"stopped at step {steps} of {planned} by {STOP_BUTTON} |"
    )
    assert result.summary().startswith(f"stopped by {STOP_BUTTON}: ")
    # the ranks stopped together after that step: the parameters are those of that step
    model, _, _ = train_reference(REGRESSION_CELL, batch_size=2, epochs=200, steps=steps)
    assert_params_equal(result.state_dict(), model)
