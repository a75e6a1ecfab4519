"""Who held a pool's lock, and whether that holder has provably ended (pool/run_lock.py): the
next run ends the tasks a holder left only when it has (pool/orphans.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from sagenb.pool.run_lock import Holder, hold


def test_a_holder_is_gone_only_when_its_process_here_has_ended(tmp_path):
    me = Holder.here("model = ...", session="s1")
    assert not me.gone()  # this process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    assert dataclasses.replace(me, pid=child.pid).gone()
    # another host's holder cannot be seen from here: never taken for gone
    assert not dataclasses.replace(me, pid=child.pid, host="elsewhere").gone()
    # a pid that names a process started after the holder took the lock was reused
    assert dataclasses.replace(me, since=0.0).gone()


def test_the_next_holder_reads_a_holder_that_never_let_go(tmp_path):
    path = str(tmp_path / "run.lock")
    first = Holder.here("first", session="s1")
    with hold(path, first) as previous:
        assert previous is None  # a fresh lock
    with hold(path, Holder.here("second")) as previous:
        assert previous is None  # the first let go: it cleared the file
    # a holder killed while it held the lock leaves its line (written here as it would)
    (tmp_path / "run.lock").write_text(
        '{"pid": 1, "host": "h", "user": "u", "process": "p", "thread": "t", "what": "w", '
        '"run_id": "r", "since": 0.0, "session": "s9"}'
    )
    with hold(path, Holder.here("third")) as previous:
        assert previous is not None and previous.session == "s9" and previous.pid == 1
