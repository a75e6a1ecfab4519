"""One run per pool at a time: a lock every run takes before it touches an engine.

Two notebooks attached to one `ipcluster` pool, or a second `%%smp_train` started from a thread
of the same kernel, used to share the engines: the second run's tasks queued behind the
first's, its stall handling then signalled engines busy with the first run (which died of the
KeyboardInterrupt), and the second was told its rank 0 was "busy in its own code".

The lock is an advisory `flock` (man 2 flock) on a file beside the pool's connection file, in
the profile's security directory, where every process that attaches to the pool reads that
file, so all of them find the same lock. Why flock and not a lease with a heartbeat:

- the kernel drops it when the holder's process ends, however it ends (SIGKILL included: its
  descriptors close), so a dead kernel never leaves the pool locked and there is no lease time
  to tune between "a slow heartbeat" and "a dead holder";
- a flock belongs to one open file description, not to the process, so two threads of one
  kernel, each opening the file for its own run, exclude each other as two kernels do;
- Python opens files non-inheritable (PEP 446), so engines or watchers the kernel starts while
  it holds the lock do not keep it after the kernel dies.

Its limit: the processes must share the file, so kernels on other machines attached to the
same pool (each with its own copy of the connection file) are not kept apart by it.

The file also says who holds it (process, user, host, thread, the cell's first line, since
when, its ipyparallel client's session), written by the holder once it has the lock and cleared
before it lets go; a run that finds the pool busy shows that and waits (`--if-busy wait`, the
default) or raises `PoolBusyError` (`--if-busy fail`). A holder killed by a signal cannot clear
it: the next holder reads who that was (`hold` yields it), and pool/orphans.py ends the tasks
that dead holder left running.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import IO

import psutil

from sagenb.pool import waits

__all__ = ["Holder", "PoolBusyError", "hold", "holder_of"]


class PoolBusyError(RuntimeError):
    """Another run holds the pool and this one was asked not to wait (--if-busy fail)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or asks for) a pool: enough to find the run and its owner."""

    pid: int
    host: str
    user: str
    process: str  # the kernel's connection file, or the script's command line
    thread: str
    what: str  # the cell's first line, or the callable's name
    run_id: str
    since: float  # seconds since the epoch
    session: str = ""  # its ipyparallel client's session id: the tasks it submits carry it

    @classmethod
    def here(cls, what: str, *, session: str = "") -> Holder:
        """This thread of this process, about to run `what` through the ipyparallel client
        whose session id is `session`."""
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            user=_user(),
            process=_process_name(),
            thread=threading.current_thread().name,
            what=what,
            run_id=secrets.token_hex(4),  # not the run's token: this file is readable
            since=time.time(),
            session=session,
        )

    def gone(self) -> bool:
        """Whether the holder's process has provably ended: it ran on this host, and its pid
        names no process now, a zombie, or one started after it took the lock (a pid reused).
        A holder on another host is never known to be gone."""
        if self.host != socket.gethostname():
            return False
        try:
            proc = psutil.Process(self.pid)
            return proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() > self.since
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # not ours to inspect: it exists
            return False

    def describe(self, *, me: Holder | None = None) -> str:
        """'run 1f2e3d4c (`model = ...`) of user ann, pid 812 on vm (kernel-5f.json),
        since 19:02:11 UTC (42 s ago)'; 'of this process, thread T' when it is `me`'s."""
        started = datetime.fromtimestamp(self.since, timezone.utc).strftime("%H:%M:%S UTC")
        ago = max(0.0, time.time() - self.since)
        if me is not None and (me.pid, me.host) == (self.pid, self.host):
            whose = f"of this process (thread {self.thread!r})"
        else:
            whose = f"of user {self.user}, pid {self.pid} on {self.host} ({self.process})"
        return f"run {self.run_id} (`{self.what}`) {whose}, since {started} ({ago:.0f} s ago)"


def holder_of(path: str) -> Holder | None:
    """Who holds the lock at `path`, as its holder wrote it (None: nobody said, or the file
    is being rewritten)."""
    try:
        with open(path, encoding="utf-8") as file:
            return Holder(**json.loads(file.read()))
    except (OSError, ValueError, TypeError):
        return None


@contextmanager
def hold(
    path: str, me: Holder, *, if_busy: str = "wait", note: Callable[[str], None] | None = None
) -> Iterator[Holder | None]:
    """Hold the pool's lock at `path` for the block: at once when it is free; else, as
    `if_busy` says, wait (`note(text)` each second says for whom and how long, "" once the
    lock is ours) or raise PoolBusyError naming the holder. Yields the last holder when it
    ended without letting go (killed: the file still names it), else None."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the block
    try:
        _acquire(file, path, me, if_busy, note or _STDERR_NOTE)
        previous = holder_of(path)  # a holder that let go cleared the file
        try:
            _write(file, me)
            yield previous
        finally:
            file.truncate(0)  # nobody holds it: a waiter reads no stale holder
            file.flush()
            fcntl.flock(file, fcntl.LOCK_UN)
    finally:
        file.close()


def _acquire(file: IO[str], path: str, me: Holder, if_busy: str, note: Callable) -> None:
    """The lock, taken at once or once its holder lets go (waits.while_busy)."""

    def busy(waited: float) -> str:
        if _try(file):
            return ""
        holder = holder_of(path)
        busy = holder.describe(me=me) if holder else "another run (it has not said whose yet)"
        if if_busy == "fail":
            raise PoolBusyError(
                f"the engine pool is busy with {busy}. --if-busy fail: this run did not wait "
                f"and touched no engine. Run it again once that run has ended, or with "
                f"--if-busy wait (the default) to start when the pool is free."
            )
        return (
            f"sagenb: the engine pool is busy with {busy}; waited {waited:.0f} s "
            f"(--if-busy wait; interrupt to give up, or --if-busy fail)"
        )

    waits.while_busy(busy, note)


def _try(file: IO[str]) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _write(file: IO[str], me: Holder) -> None:
    file.seek(0)
    file.truncate(0)
    file.write(json.dumps(asdict(me)))
    file.flush()


_STDERR_NOTE = waits.stderr_note("the engine pool is free: this run starts")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (some containers)
        return str(os.getuid())


def _process_name() -> str:
    """The Jupyter kernel's connection file (which names the kernel), else the script's name."""
    kernel = sys.modules.get("ipykernel.connect")
    try:
        if kernel is not None:
            return os.path.basename(kernel.get_connection_file())
    except Exception:  # noqa: BLE001 - IPython without a kernel: the command line says enough
        pass
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else sys.executable
