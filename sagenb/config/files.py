"""Reading a small file that a user, or another local user, may have put there: a price or
hardware table (--price-table, --hardware-table), a checkpoint directory's `latest` pointer, a
pretrained index. Each is refused by what it is before anything is read: /dev/zero never ends
(a kernel grew to 22 GB on it), a FIFO blocks until a writer comes, and a large file is
refused by its size, never read whole. It imports nothing of sagenb's, so the engine side and
the notebook side read through the one helper.
"""

from __future__ import annotations

import os
import stat

__all__ = ["read_small", "size_text"]


def read_small(path: str | os.PathLike, limit: int) -> str:
    """The text of the regular file at `path` (a link is followed to what it names), or a
    ValueError saying what is allowed: "must be a regular file of at most 4 MiB; this is a
    FIFO". OSError as open raises it (a file that is not there)."""
    allowed = f"must be a regular file of at most {size_text(limit)}"
    # O_NONBLOCK: opening a FIFO without a writer would block; a regular file ignores it
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)  # of what was opened: no swap between a check and the open
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{allowed}; this is {_kind(info.st_mode)}")
        data = f.read(limit + 1)  # bounded even if the file grows after the fstat
        if info.st_size > limit or len(data) > limit:
            raise ValueError(f"{allowed}; this one has {max(info.st_size, len(data))} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"must be UTF-8 text; byte {exc.start} is not") from None


def size_text(size: int) -> str:
    """4194304 -> "4 MiB", 4096 -> "4 KiB", 100 -> "100 bytes"."""
    for unit, name in ((2**20, "MiB"), (2**10, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")
