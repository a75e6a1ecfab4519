"""A watcher that stops the engine pool when the process that started it dies, however it dies.

`atexit` runs only when Python exits on its own: a kernel ended by SIGTERM (`kill PID`, process
managers, CI timeouts) or by SIGKILL (what Jupyter sends a busy kernel that will not shut down)
runs no cleanup at all, and its controller, engines and nannies, each in a session of its own
(ipyparallel starts them with `start_new_session=True`), would run on, holding memory and ports.

So the first pool a process starts also starts this watcher: `python -m sagenb.pool.reaper`, in a
session of its own, reading the pool's processes from a pipe whose other end only the starting
process holds. The operating system closes that end when the process dies, by any signal, so
the watcher's next read ends (no polling), and it ends the processes it was told of: the process
group of each (a killed controller leaves its children in its group, re-parented to init) and
their descendants, SIGTERM first, SIGKILL two seconds later. A pool stopped normally is
forgotten first; an attached pool (`ipcluster`) is never handed to the watcher: not ours.

Each process is identified by pid and start time, so a pid the system has reused since is never
touched, and neither is the group of the process that started the pool.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

import psutil

__all__ = ["watch", "forget", "identities", "end", "main"]

#: seconds between SIGTERM and SIGKILL for whatever is still alive
GRACE_S = 2.0

_pipe: IO[str] | None = None


def watch(processes: Iterable[psutil.Process]) -> None:
    """Have the watcher end `processes` (and their groups and descendants) if this process
    dies before it forgets them; starts the watcher on first use."""
    entries = [_identity(p) for p in processes]
    _send({"watch": [e for e in entries if e is not None]})


def forget(processes: Iterable[psutil.Process]) -> None:
    """The pool was stopped normally: nothing of it to end any more."""
    entries = [_identity(p) for p in processes]
    _send({"forget": [e for e in entries if e is not None]})


def identities(processes: Iterable[psutil.Process]) -> dict[int, tuple[float, int]]:
    """{pid: (start time, process group)} of the processes still running."""
    entries = (_identity(p) for p in processes)
    return {e[0]: (e[1], e[2]) for e in entries if e is not None}


def end(watched: dict[int, tuple[float, int]], *, grace: float = GRACE_S) -> None:
    """End the `identities` here and now, as the watcher would: their groups and descendants
    too, SIGTERM then SIGKILL after `grace` seconds; bounded whatever state they are in."""
    reap(watched, spare_pgids={os.getpgrp()}, grace=grace)


def _identity(proc: psutil.Process) -> list[Any] | None:
    try:
        return [proc.pid, proc.create_time(), os.getpgid(proc.pid)]
    except (psutil.Error, ProcessLookupError):
        return None


def _send(message: dict[str, Any]) -> None:
    global _pipe
    if _pipe is None or _pipe.closed:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "sagenb.pool.reaper", str(os.getpid()), str(os.getpgrp())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a signal to this process's group must not reach it
        )
        # Popen sets .stdin to a file exactly when stdin=PIPE, as here
        assert watcher.stdin is not None, "Popen(stdin=PIPE) gives no stdin"
        _pipe = watcher.stdin
        atexit.register(_pipe.close)  # a normal exit closes it too; the watcher then ends
    try:
        _pipe.write(json.dumps(message) + "\n")
        _pipe.flush()
    except (BrokenPipeError, OSError):  # the watcher died: start a new one next time
        _pipe = None


def main(argv: list[str]) -> None:
    """The watcher: keep a list from the pipe; at its end, end what is on the list."""
    _, parent_pgid = int(argv[0]), int(argv[1])
    watched: dict[int, tuple[float, int]] = {}
    for line in sys.stdin:  # ends when the starting process closes the pipe or dies
        message = json.loads(line)
        for pid, created, pgid in message.get("watch", []):
            watched[pid] = (created, pgid)
        for pid, _, _ in message.get("forget", []):
            watched.pop(pid, None)
    if watched:
        reap(watched, spare_pgids={parent_pgid, os.getpgrp()})


def reap(
    watched: dict[int, tuple[float, int]], *, spare_pgids: set[int], grace: float = GRACE_S
) -> None:
    """SIGTERM every watched process still alive, its group and descendants; SIGKILL what is
    left after `grace` seconds, and wait (bounded) until they are gone."""
    groups = {pgid for _, pgid in watched.values()} - spare_pgids
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = _alive(watched) + _members(groups)
        procs += [c for p in list(procs) for c in _children(p)]
        procs = list({p.pid: p for p in procs}.values())
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _wait_gone(procs, grace)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Poll until every process has exited (a zombie child of ours is reaped), or timeout:
    psutil.wait_procs was seen blocking past its timeout on a killed controller's children."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = []
        for proc in procs:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(proc.pid, os.WNOHANG)  # ours: reap it; not ours: raises
                else:
                    running.append(proc)
            except (psutil.Error, ChildProcessError, OSError):
                pass
        if not running:
            return
        procs = running
        time.sleep(0.05)


def _alive(watched: dict[int, tuple[float, int]]) -> list[psutil.Process]:
    out = []
    for pid, (created, _) in watched.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.01:  # not a reused pid
                out.append(proc)
        except psutil.Error:
            pass
    return out


def _members(groups: set[int]) -> list[psutil.Process]:
    """Processes in the given process groups (children a killed controller left behind)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups:
                out.append(proc)
        except (psutil.Error, ProcessLookupError):
            pass
    return out


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook's interrupt is not for us
    main(sys.argv[1:])
