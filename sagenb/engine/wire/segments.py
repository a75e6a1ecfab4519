"""The names of data parallel's shared-memory segments (shared_memory.py), and the removal of
those whose creator died before unlinking them.

A segment lives in /dev/shm from its creation by rank 0 until every rank has mapped it, then
rank 0 unlinks it: milliseconds, but an engine killed in them (an OOM kill, a SIGKILL from a
stall, a kernel's death) leaves 16 MiB of the host's memory in /dev/shm for good, which nothing
else frees until a reboot. Its name says who made it, `sagenb-<pid>-<12 hex>`, so the
notebook removes each segment whose creator is no longer running and that belongs to this
user (`remove_orphans`): at the start of every run (run/session.py) and when the pool stops or
its kernel dies (pool/reaper.py's `end` and watcher). A live creator's segment is never
touched, whosever pool it is from; another user's is not ours to remove (and /dev/shm's sticky
bit would refuse it anyway).

Its limit: engines in a container of their own that shares this /dev/shm but not the pid
namespace have pids this process cannot see; a sweep in the milliseconds between such a
segment's creation and its mapping would unlink it, and that run then reduces over gloo
(shared_memory.attach falls back when a rank cannot map it). Nothing is lost but the speed.

No torch here: the watcher process imports this, and it must start in milliseconds.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

import psutil

__all__ = ["DIRECTORY", "new_path", "creator", "remove_orphans"]

DIRECTORY = "/dev/shm"
_NAME = re.compile(r"sagenb-(\d+)-[0-9a-f]{12}")


def new_path(pid: int) -> str:
    """Where process `pid` creates a segment: its pid, then 48 random bits."""
    return f"{DIRECTORY}/sagenb-{pid}-{secrets.token_hex(6)}"


def creator(name: str) -> int | None:
    """The pid in a segment's file name, or None for a name that is not a segment's."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def remove_orphans(directory: str = DIRECTORY) -> list[str]:
    """Remove this user's segments in `directory` whose creator no longer runs; the paths
    removed. Errors are skipped: a segment unlinked meanwhile (its run's rank 0), a directory
    that is missing."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = creator(name)
        if pid is None or _alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: only its exit status is left)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # one we may not inspect: it runs
        return True
