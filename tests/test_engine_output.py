"""Library output on the engines never breaks a run (issue 28, item 3).

The engines are ipykernels, so tqdm.auto (transformers' from_pretrained, datasets.map, a cell's
own loops) drew its bars there as ipywidgets: comm messages that ipyparallel's client forwards
to `get_ipython().kernel`. Under an IPython without a kernel that raised AttributeError in the
client's IOPub handler and every later message of the run was lost ("rank 0 published 5 metric
messages but 0 arrived within 10 s"). Now the bars are text on the engines
(engine/wire/output.py), a stray comm message is ignored by the client (pool/cluster.py), and
rank 0's output is shown once under the cell (run/output.py).
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import comm
import ipyparallel as ipp
import pytest
import tqdm.asyncio
import tqdm.auto
import tqdm.autonotebook
import tqdm.notebook
import tqdm.std

import sagenb
from sagenb.engine.wire.output import text_output
from sagenb.pool.ipyparallel_private import iopub_guarded
from sagenb.run.output import RankOutput

from .conftest import REGRESSION_CELL

#: before the regression cell, so the same seeded tensors follow: a bar, a log line, a warning
CHATTY = """
import logging, warnings
from tqdm.auto import tqdm
for _ in tqdm(range(3), desc="prep"):
    pass
logging.getLogger("cell").warning("a log line from the cell")
warnings.warn("a warning from the cell")
print("printed by the cell")
"""
CHATTY_CELL = CHATTY + REGRESSION_CELL
LINE = "--batch-size 32 --steps 5 --no-dashboard"
BAR = "prep: 100%"  # the bar's last state, as tqdm's text bar draws it
QUICK = dict(batch_size=32, steps=5, dashboard=False)


def test_a_cell_with_a_bar_trains_under_ipython_without_a_kernel(shell, pool, capsys):
    """`%%smp_train` in a plain InteractiveShell (no `.kernel`), as terminal ipython runs it."""
    assert getattr(shell, "kernel", None) is None
    shell.run_cell_magic("smp_train", f"{LINE} --out plain", REGRESSION_CELL)
    capsys.readouterr()
    shell.run_cell_magic("smp_train", f"{LINE} --out chatty", CHATTY_CELL)
    out, err = capsys.readouterr()
    plain, chatty = shell.user_ns["plain"], shell.user_ns["chatty"]
    assert chatty.status == "done" and len(chatty.history) == 5
    assert chatty.losses == plain.losses  # exactly: the bar changed nothing the run computes
    assert_shown_once(out, err)
    # the warm engines warn again in the next run, as a fresh process would
    shell.run_cell_magic("smp_train", f"{LINE} --out again", CHATTY_CELL)
    assert_shown_once(*capsys.readouterr())
    assert shell.user_ns["again"].losses == plain.losses


def assert_shown_once(out: str, err: str) -> None:
    """Rank 0's output, once: the bar as text, the log line, the warning, the print."""
    assert err.count(BAR) == 1, err
    assert err.count("a log line from the cell") == 1, err
    assert err.count("UserWarning: a warning from the cell") == 1, err
    assert out.count("printed by the cell") == 1, out


def test_equivalence_warnings_come_once_from_the_notebook(pool, capsys):
    """Rank 0 warns them on its engine too (for torchrun scripts); under the pool its copy is
    not among the output shown, where the notebook's own warning already is."""
    cell = REGRESSION_CELL.replace("nn.Tanh(),", "nn.Tanh(), nn.Dropout(0.1),")
    with pytest.warns(sagenb.EquivalenceWarning, match="draws its masks"):
        result = sagenb.train(cell, **QUICK)
    assert len(result.warnings) == 1
    assert "draws its masks" not in capsys.readouterr().err


def test_a_stray_comm_message_does_not_stop_the_metrics(shell, pool, caplog):
    """A widget the engine side cannot stop (a comm opened through ipykernel itself) reaches
    the client, whose guard drops it instead of losing the run's later messages."""
    stray = "from ipykernel.comm import Comm\nComm(target_name='stray')\n"
    shell.run_cell_magic("smp_train", f"{LINE} --out plain", REGRESSION_CELL)
    with caplog.at_level(logging.WARNING, logger="sagenb.pool"):
        shell.run_cell_magic("smp_train", f"{LINE} --out stray", stray + REGRESSION_CELL)
    result = shell.user_ns["stray"]
    assert result.status == "done" and result.losses == shell.user_ns["plain"].losses
    assert "could not handle a message from an engine (AttributeError" in caplog.text


def test_the_engines_are_as_they_were_after_a_run(shell, pool):
    """What a run patched on the engines is put back: the next run, or a %px cell, finds the
    kernel's widget bar and ipykernel's comms, also after a failed run."""

    def kernel_choices():
        import comm
        import tqdm.auto

        return tqdm.auto.tqdm.__mro__[1].__name__, comm.create_comm.__module__

    expected = ("tqdm_notebook", "ipykernel.ipkernel")
    with pytest.raises(sagenb.TrainingError, match="ValueError: after the bar"):
        sagenb.train(CHATTY_CELL + "raise ValueError('after the bar')\n", **QUICK)
    for eid in pool.engine_ids:
        assert pool.client[eid].apply_sync(kernel_choices) == expected


def test_a_failing_rank_keeps_its_traceback_and_rank_0_its_output(shell, pool, capsys):
    cell = CHATTY_CELL + "raise ValueError('after the bar')\n"
    with pytest.raises(sagenb.TrainingError) as failed:
        sagenb.train(cell, **QUICK)
    assert 'File "<smp_train cell>", line 17, in <module>' in str(failed.value)
    assert "ValueError: after the bar" in str(failed.value)
    assert_shown_once(*capsys.readouterr())


SCRIPT = """
import json, os, sys
os.environ["SAGENB_PREWARM"] = "0"
import sagenb
from sagenb.pool import cluster

pool = cluster.start_pool(2)
# every IOPub message type the run's tasks sent, as the client handled them (a script has no
# IPython, so ipyparallel's client hands comm messages to nobody but does see them)
seen = []
submit = pool.submit
def recording(fn, per_rank_args):
    ars = submit(fn, per_rank_args)
    for ar in ars:
        for future in ar._children:
            future.iopub_callbacks.append(lambda msg: seen.append(msg["header"]["msg_type"]))
    return ars
pool.submit = recording
cells = json.loads(sys.argv[1])
losses = {
    name: sagenb.train(cell, batch_size=32, steps=5, dashboard=False).losses
    for name, cell in cells.items()
}
cluster.stop_pool()
print(json.dumps({"losses": losses, "comm": sorted({t for t in seen if "comm" in t})}))
"""


@pytest.mark.pool  # the script starts a pool of its own
def test_a_cell_with_a_bar_trains_from_a_script(tmp_path: Path):
    """`sagenb.train` from a plain script: no widget message leaves an engine, and the text
    reaches the script's own stdout and stderr."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cells = json.dumps({"plain": REGRESSION_CELL, "chatty": CHATTY_CELL})
    done = subprocess.run(
        [sys.executable, str(script), cells], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["comm"] == []
    assert report["losses"]["chatty"] == report["losses"]["plain"]
    assert len(report["losses"]["chatty"]) == 5
    assert done.stderr.count(BAR) == 1, done.stderr
    assert done.stderr.count("a log line from the cell") == 1, done.stderr
    assert done.stderr.count("UserWarning: a warning from the cell") == 1, done.stderr
    assert done.stdout.count("printed by the cell") == 1, done.stdout


@pytest.mark.pool  # the kernel starts a pool of its own
def test_a_cell_with_a_bar_trains_in_a_jupyter_kernel():
    """In a kernel ipyparallel forwards the engines' comm messages to the notebook: none come,
    so no widget per rank; the text arrives under the cell as stream output, once."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    messages: list[dict] = []

    def execute(code: str) -> None:
        reply = kc.execute_interactive(code, timeout=180, output_hook=messages.append)
        assert reply["content"]["status"] == "ok", messages[-1:]

    try:
        execute("%load_ext sagenb\n%smp_cluster start -n 2")
        execute(f"%%smp_train {LINE} --out plain\n{REGRESSION_CELL}")
        messages.clear()
        execute(f"%%smp_train {LINE} --out chatty\n{CHATTY_CELL}")
        shown = messages[:]
        messages.clear()
        execute("print('LOSSES', chatty.losses == plain.losses, len(chatty.history))")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    kinds = {m["header"]["msg_type"] for m in shown}
    assert not {k for k in kinds if k.startswith("comm")}, kinds
    assert_shown_once(streamed(shown, "stdout"), streamed(shown, "stderr"))
    assert "LOSSES True 5" in streamed(messages, "stdout")


def streamed(messages: list[dict], name: str) -> str:
    """The text of the stream messages to `name` among a kernel's IOPub messages."""
    return "".join(
        m["content"]["text"]
        for m in messages
        if m["header"]["msg_type"] == "stream" and m["content"]["name"] == name
    )


# -- the pieces, without engines ------------------------------------------------------------------


def test_text_output_swaps_the_widget_bar_and_comms_for_the_block(monkeypatch):
    """As a kernel has them (the notebook bar, ipykernel's comms), text and silence inside the
    block, and each put back after it, also when the block raises."""

    def kernel_comm(*args, **kwargs):
        raise AssertionError("a widget's comm reached the kernel")

    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm)
    monkeypatch.setattr(tqdm.autonotebook, "tqdm", tqdm.notebook.tqdm)
    monkeypatch.setattr(tqdm.autonotebook, "trange", tqdm.notebook.trange)
    monkeypatch.setattr(comm, "create_comm", kernel_comm)
    drawn = io.StringIO()
    with pytest.raises(KeyError), text_output():
        assert tqdm.auto.tqdm is tqdm.asyncio.tqdm
        assert tqdm.autonotebook.tqdm is tqdm.std.tqdm
        for _ in tqdm.auto.trange(3, desc="bar", file=drawn):
            pass
        assert isinstance(comm.create_comm(target_name="w"), comm.DummyComm)
        raise KeyError("the run failed")
    assert "bar: 100%" in drawn.getvalue()
    assert tqdm.auto.tqdm is tqdm.notebook.tqdm
    assert tqdm.autonotebook.tqdm is tqdm.notebook.tqdm
    assert tqdm.autonotebook.trange is tqdm.notebook.trange
    assert comm.create_comm is kernel_comm


def test_text_output_gives_the_run_its_own_warning_filters(recwarn):
    class Quiet(UserWarning):
        pass

    before = list(warnings.filters)
    with text_output(ignore=(Quiet,)):
        warnings.simplefilter("error", DeprecationWarning)  # a cell's filter
        warnings.warn("not shown", Quiet, stacklevel=1)
    assert warnings.filters == before
    assert not [w for w in recwarn if issubclass(w.category, Quiet)]


class FakeResult:
    """An AsyncResult's metadata as ipyparallel fills it in."""

    def __init__(self) -> None:
        self.metadata: dict[str, str | None] = {"stdout": None, "stderr": ""}


def test_rank_output_writes_lines_as_they_complete(capsys):
    ar = FakeResult()
    output = RankOutput(ar)
    ar.metadata["stderr"] = "a log line\nbar  1%"
    output.drain()
    assert capsys.readouterr().err == "a log line\n"
    ar.metadata["stderr"] = "a log line\nbar 50%"  # ipyparallel folded the "\r" redraw
    output.drain()
    assert capsys.readouterr().err == ""
    ar.metadata["stderr"] = "a log line\nbar 99%\rbar 100%\nwarned\n"
    ar.metadata["stdout"] = "printed"
    output.drain()
    assert capsys.readouterr() == ("", "bar 100%\nwarned\n")
    ar.metadata["stdout"] = "printed\nunfinished"
    output.drain(final=True)
    output.drain(final=True)
    assert capsys.readouterr() == ("printed\nunfinished\n", "")


class Dispatching:
    """A stand-in for ipyparallel's Client, which binds its IOPub handler to its stream when it
    is made (Client._setup_streams): a handler that fails on every message."""

    def __init__(self) -> None:
        self.on_recv = self._dispatch_iopub

    def _dispatch_iopub(self, msg_parts):
        raise AttributeError("'InteractiveShell' object has no attribute 'kernel'")


def test_iopub_guarded_clients_log_a_failed_message_once_and_go_on(caplog):
    original = Dispatching.__dict__["_dispatch_iopub"]
    with iopub_guarded(Dispatching):
        client = Dispatching()
    handler = client.on_recv
    assert Dispatching.__dict__["_dispatch_iopub"] is original
    with caplog.at_level(logging.WARNING, logger="sagenb.pool"):
        handler([b"comm_open"])
        handler([b"comm_msg"])
    assert caplog.text.count("could not handle a message from an engine (AttributeError") == 1
    with pytest.raises(AttributeError):
        Dispatching().on_recv([])  # clients made after the block keep ipyparallel's handler


def test_iopub_guarded_puts_ipyparallels_handler_back():
    original = ipp.Client.__dict__["_dispatch_iopub"]
    with iopub_guarded(ipp.Client):
        assert ipp.Client.__dict__["_dispatch_iopub"] is not original
    assert ipp.Client.__dict__["_dispatch_iopub"] is original
