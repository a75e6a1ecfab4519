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
their descendants, SIGTERM first, SIGKILL two seconds later; then it removes the shared memory
of engines that died holding it (engine/wire/segments.py). A pool stopped normally is
forgotten first; an attached pool (`ipcluster`) is never handed to the watcher: not ours.

The watcher itself can die (an OOM kill picks the largest process, but a stray `kill` does not
choose): a thread here waits on it and, the moment it ends while this process runs on, starts
a new one and hands it the whole list (kept here, as sent), with a warning naming the dead
watcher's pid; `check()`, made each time the pool is used, does the same should that thread be
gone.

Engines started on other hosts through ssh or Slurm are not this machine's processes: the
watcher is handed the command that ends them (`watch_remote`: a kill over ssh, a job's
scancel; remote.py) and runs it.

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
import threading
import time
import warnings
from collections.abc import Iterable
from typing import IO, Any

import psutil

from sagenb.engine.wire import segments
from sagenb.pool.remote import end_remote as _end_remote

__all__ = [
    "watch",
    "forget",
    "watch_remote",
    "forget_remote",
    "check",
    "watcher_pid",
    "identities",
    "end",
    "main",
]

#: seconds between SIGTERM and SIGKILL for whatever is still alive
GRACE_S = 2.0

_lock = threading.RLock()  # the pool starts in a background thread too (prewarm)
_pipe: IO[str] | None = None
_watcher: subprocess.Popen[str] | None = None
#: what the watcher was told to guard, {pid: [pid, start time, process group]}: a restarted
#: watcher is handed it whole
_watched: dict[int, list[Any]] = {}
#: engines on other hosts, {key: [key, argv, env]}: the command that ends each (remote.enders)
_remote: dict[str, list[Any]] = {}
_closing = False  # this process exits normally: the watcher ends on purpose
_exit_registered = False


def watch(processes: Iterable[psutil.Process]) -> None:
    """Have the watcher end `processes` (and their groups and descendants) if this process
    dies before it forgets them; starts the watcher on first use."""
    entries = [e for e in map(_identity, processes) if e is not None]
    with _lock:
        _watched.update({e[0]: e for e in entries})
        _send({"watch": entries})


def forget(processes: Iterable[psutil.Process]) -> None:
    """The pool was stopped normally: nothing of it to end any more."""
    entries = [e for e in map(_identity, processes) if e is not None]
    with _lock:
        for e in entries:
            _watched.pop(e[0], None)
        _send({"forget": entries})


def watch_remote(entries: Iterable[list[Any]]) -> None:
    """Have the watcher run these commands (remote.enders' rows: a kill over ssh, a Slurm
    job's scancel) if this process dies before it forgets them."""
    entries = list(entries)
    if not entries:
        return
    with _lock:
        _remote.update({e[0]: e for e in entries})
        _send({"remote": entries})


def forget_remote(entries: Iterable[list[Any]]) -> None:
    """Those engines were stopped normally."""
    entries = list(entries)
    if not entries:
        return
    with _lock:
        for e in entries:
            _remote.pop(e[0], None)
        _send({"forget_remote": entries})


def check() -> int | None:
    """Restart the watcher if it died (an OOM kill, a stray `kill`), handing the new one the
    same processes to guard; the dead one's pid when it did. The thread that waits on each
    watcher (`_guard`) does so within milliseconds of its death; this check, cheap (one read of
    /proc), is made each time the pool is used, should that thread have been stopped."""
    with _lock:
        if _watcher is None or _closing or _running(_watcher):
            return None
        return _restart()


def watcher_pid() -> int | None:
    """The pid of the running watcher (None before the first pool, or once it has ended)."""
    with _lock:
        return _watcher.pid if _watcher is not None and _running(_watcher) else None


def _running(watcher: subprocess.Popen[str]) -> bool:
    """Whether `watcher` still runs. Not Popen.poll(): it answers None while another thread
    (`_guard`) waits on the same process."""
    if watcher.returncode is not None:
        return False
    try:  # our child, not yet reaped: its pid cannot have been reused
        return psutil.Process(watcher.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def identities(processes: Iterable[psutil.Process]) -> dict[int, tuple[float, int]]:
    """{pid: (start time, process group)} of the processes still running."""
    entries = (_identity(p) for p in processes)
    return {e[0]: (e[1], e[2]) for e in entries if e is not None}


def with_descendants(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes and their descendants: a cell's child in a session of its own is in no
    engine's process group, and once its engine has stopped no longer its descendant."""
    procs = list(processes)
    return procs + [child for proc in procs for child in _children(proc)]


def end(watched: dict[int, tuple[float, int]], *, grace: float = GRACE_S) -> None:
    """End the `identities` here and now, as the watcher would: their groups and descendants
    too, SIGTERM then SIGKILL after `grace` seconds; bounded whatever state they are in. Then
    the shared memory of engines that died holding it (engine/wire/segments.py)."""
    reap(watched, spare_pgids={os.getpgrp()}, grace=grace)
    segments.remove_orphans()


def _identity(proc: psutil.Process) -> list[Any] | None:
    try:
        return [proc.pid, proc.create_time(), os.getpgid(proc.pid)]
    except (psutil.Error, ProcessLookupError):
        return None


def _send(message: dict[str, Any]) -> None:
    """Write to the watcher (caller holds _lock), starting it first when there is none; a
    watcher found dead is replaced and handed the whole list, this message's changes included."""
    if _watcher is None:
        _start()
    if not _write(message) and not _closing:
        _restart()  # it is sent _watched, which already holds this message's changes


def _write(message: dict[str, Any]) -> bool:
    """Write one line to the watcher; False when it has died (its end of the pipe is closed)."""
    if _pipe is None or _pipe.closed:
        return False
    try:
        _pipe.write(json.dumps(message) + "\n")
        _pipe.flush()
        return True
    except (BrokenPipeError, OSError):
        return False


def _start() -> None:
    """Start a watcher (caller holds _lock) and a thread that waits for its end."""
    global _pipe, _watcher
    _watcher = subprocess.Popen(
        [sys.executable, "-m", "sagenb.pool.reaper", str(os.getpid()), str(os.getpgrp())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # a signal to this process's group must not reach it
    )
    # Popen sets .stdin to a file exactly when stdin=PIPE, as here
    assert _watcher.stdin is not None, "Popen(stdin=PIPE) gives no stdin"
    _pipe = _watcher.stdin
    if not _exit_registered:
        _register_exit()
    threading.Thread(target=_guard, args=(_watcher,), name="sagenb-reaper", daemon=True).start()


def _restart() -> int:
    """Replace a dead watcher (caller holds _lock) by one that guards the same processes, and
    say so; the dead one's pid."""
    assert _watcher is not None, "only a started watcher can be restarted"
    old, status = _watcher.pid, _watcher.returncode  # set once _guard has reaped it
    if _pipe is not None:
        try:
            _pipe.close()
        except OSError:  # flushing what the dead watcher never read
            pass
    _start()
    how = f" (exit status {status})" if status is not None else ""
    warnings.warn(
        f"sagenb: the watcher process {old}, which ends the engine pool if this kernel dies, "
        f"has died{how}; started watcher {_watcher.pid}, guarding the same "
        f"{len(_watched)} processes",
        RuntimeWarning,
        stacklevel=2,
    )
    # a new watcher that died at once: next check
    _write({"watch": list(_watched.values()), "remote": list(_remote.values())})
    return old


def _guard(watcher: subprocess.Popen[str]) -> None:
    """Wait (in a daemon thread, no polling) for `watcher` to end; replace it if this process
    did not end it (it ends only when the pipe closes: this process's normal exit)."""
    watcher.wait()
    with _lock:
        if not _closing and watcher is _watcher:
            _restart()


def _register_exit() -> None:
    global _exit_registered
    _exit_registered = True
    atexit.register(_close)


def _close() -> None:
    """At a normal exit: close the pipe, so the watcher ends (and is not replaced)."""
    global _closing
    with _lock:
        _closing = True
        if _pipe is not None:
            _pipe.close()


def main(argv: list[str]) -> None:
    """The watcher: keep a list from the pipe; at its end, end what is on the list."""
    _, parent_pgid = int(argv[0]), int(argv[1])
    watched: dict[int, tuple[float, int]] = {}
    remote: dict[str, list[Any]] = {}
    for line in sys.stdin:  # ends when the starting process closes the pipe or dies
        message = json.loads(line)
        for pid, created, pgid in message.get("watch", []):
            watched[pid] = (created, pgid)
        for pid, _, _ in message.get("forget", []):
            watched.pop(pid, None)
        remote.update({e[0]: e for e in message.get("remote", [])})
        for e in message.get("forget_remote", []):
            remote.pop(e[0], None)
    hosts = None
    if remote:  # over ssh, while the local processes end
        hosts = threading.Thread(target=_end_remote, args=(list(remote.values()),))
        hosts.start()
    if watched:
        reap(watched, spare_pgids={parent_pgid, os.getpgrp()})
        segments.remove_orphans()  # the engines' just ended
    if hosts is not None:
        hosts.join()


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
