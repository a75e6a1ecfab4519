"""What sagenb writes outside the user's own folders ($TMPDIR: the ranks' stack dumps) goes
into a directory private to the user, so another local user cannot point it at the user's
files (issue 32). The tests run as root and play the other user with uid 65534 (nobody)."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from sagenb.engine.scratch import UnsafeDirectory, read_private
from sagenb.engine.wire.tracing import Tracer, stack_path

OTHER = 65534  # nobody


@pytest.fixture
def store():
    """The run's store, which the rank's tracer thread connects to (and is released by)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store
    # the tracer's threads end once released through the store: joined while it still
    # answers, since a thread still connecting when pytest exits aborts the process (torch's
    # C++ store, "terminate called without an active exception": exit status 134)
    for thread in threading.enumerate():
        if thread.name.startswith("sagenb-trace"):
            thread.join(timeout=10)
    del store


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """A $TMPDIR of the test's own, and a file of the user's that a dump must never touch."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "notebook.ipynb"
    victim.write_text("the user's work")
    victim.chmod(0o600)
    return tmp_path, victim


def _tracer(store) -> Tracer:
    return Tracer(addr="127.0.0.1", port=store.port, rank=0, timeout=timedelta(seconds=1))


@pytest.mark.parametrize(
    "made_by, reason",
    [
        ("another user, full of symlinks", f"is owned by uid {OTHER}, not by this user"),
        ("a symlink to another user's directory", "is a symlink to"),
        ("this user, open to others", "has mode 0777: others may enter it"),
    ],
)
def test_a_stack_directory_another_user_could_prepare_is_refused(tmp, store, made_by, reason):
    """The directory existed before the run, planted so that the dump of rank 0 truncates
    and overwrites the user's file (as it did): the rank refuses it, and so does the reader."""
    root, victim = tmp
    path = stack_path(store.port, 0)
    planted = root / "planted" if "symlink to" in made_by else os.path.dirname(path)
    os.mkdir(planted)
    os.chmod(planted, 0o777)
    os.symlink(victim, os.path.join(planted, os.path.basename(path)))
    if planted != os.path.dirname(path):
        os.symlink(planted, os.path.dirname(path))
    if "another user" in made_by:
        os.lchown(os.path.join(planted, os.path.basename(path)), OTHER, OTHER)
        os.chown(planted, OTHER, OTHER)
    with pytest.raises(UnsafeDirectory, match=f"{reason}.*Remove it, or set TMPDIR"):
        _tracer(store)
    with pytest.raises(UnsafeDirectory, match=reason):
        read_private(path)  # what the notebook reads of a stalled rank (run/stacks.py)
    assert victim.read_text() == "the user's work"


def test_a_stack_file_is_the_users_own_and_never_a_link(tmp, store):
    """Made 0700, the dump 0600; a link left in the directory is replaced, not followed."""
    root, victim = tmp
    path = stack_path(store.port, 0)
    os.mkdir(os.path.dirname(path), 0o700)
    os.symlink(victim, path)
    tracer = _tracer(store)
    try:
        folder, dump = os.lstat(os.path.dirname(path)), os.lstat(path)
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
        assert stat.S_ISREG(dump.st_mode) and stat.S_IMODE(dump.st_mode) == 0o600
        assert read_private(path).startswith("rank thread 0x")
    finally:
        tracer.close()
    assert victim.read_text() == "the user's work" and not os.path.exists(path)
