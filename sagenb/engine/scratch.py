"""The one directory sagenb writes to outside the user's own folders: `$TMPDIR/<name>-<uid>`,
private to the user, for files two processes of the user find by name (a rank's stack dump,
engine/wire/tracing.py, read by the notebook, run/stacks.py).

$TMPDIR is shared (/tmp): another local user can create `sagenb-stacks-<uid>` first, full of
symlinks to the notebook user's files, and an `open(path, "w")` there truncates and overwrites
whatever they point to. So the directory is made with mode 0700 and, made now or found, used
only when `lstat` says it is a directory (not a symlink) owned by this user that no one else
may enter; a file in it is created anew with `O_CREAT | O_EXCL | O_NOFOLLOW` (never through a
link, never someone else's file). A directory that fails the check is refused with
`UnsafeDirectory`: a fresh `mkdtemp` would not do, as the two processes derive the path each
on its own. In a sticky /tmp no one else can rename or remove a directory this user owns, so
what was checked stays so.
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import IO

__all__ = ["UnsafeDirectory", "dir_path", "private_dir", "create_private", "read_private"]


class UnsafeDirectory(OSError):
    """A directory sagenb would write to is not private to this user; says why and what to do."""


def dir_path(name: str) -> str:
    """`$TMPDIR/<name>-<uid>`: where private_dir(name) is, made and checked or not."""
    return os.path.join(tempfile.gettempdir(), f"{name}-{os.getuid()}")


def private_dir(name: str) -> str:
    """`$TMPDIR/<name>-<uid>`, made with mode 0700 when missing, and checked, made or found
    (UnsafeDirectory when it is a symlink, not a directory, someone else's, or open to
    others)."""
    path = dir_path(name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # checked below, as if made
    check_private(path)
    return path


def check_private(path: str) -> None:
    """Raise UnsafeDirectory unless `path` itself (not what a symlink points to) is a
    directory owned by this user with no permission for group or others."""
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = f"is a symlink to {os.readlink(path)!r}"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    elif stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}: others may enter it"
    if problem:
        raise UnsafeDirectory(
            f"{path} {problem}, so sagenb will not write there (another user could point its "
            f"files at yours). Remove it, or set TMPDIR to a directory of your own."
        )


def create_private(path: str) -> IO[str]:
    """A new file at `path` (in a private_dir), mode 0600, open for writing text: a file left
    there before is removed first, and a link is never followed."""
    try:
        os.unlink(path)  # a stale dump of this port and rank; the directory is ours
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "w")


def read_private(path: str) -> str:
    """The text of the file at `path` when its directory is private and it is no link; ''
    when it is missing or unreadable (UnsafeDirectory when its directory is not private)."""
    check_private(os.path.dirname(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd) as f:
        return f.read()
