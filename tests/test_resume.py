"""--resume never goes back in time or changes what the run trains without saying so: a newer
checkpoint this run's engines cannot read is skipped with a warning in the run's result, the
options it was written with are checked (refused or warned about), a model of other shapes is
named as such, leftovers of a crash never block it, and a full disk says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

import sagenb
from sagenb.config import ConfigError
from sagenb.engine.checkpoint.distributed import candidates, latest
from sagenb.engine.checkpoint.reader import check
from sagenb.engine.checkpoint.resume import RECORD, saved_options
from sagenb.run.failures import TrainingError

from .conftest import REGRESSION_CELL
from .helpers import assert_params_equal

SHORT = dict(batch_size=16, epochs=1, dashboard=False)


def test_resume_skips_a_newer_checkpoint_written_on_fewer_engines(pool, tmp_path):
    """Step 3 on 2 engines, step 6 on 1: resumed on 2, the run goes back to step 3, and the
    cell's result says so, naming both steps and why."""
    whole = sagenb.train(REGRESSION_CELL, steps=9, **SHORT)
    ckpt = dict(checkpoint_dir=str(tmp_path), **SHORT)
    sagenb.train(REGRESSION_CELL, steps=3, engines=2, **ckpt)
    sagenb.train(REGRESSION_CELL, steps=6, engines=1, resume=True, **ckpt)
    assert latest(tmp_path).name == "step-00000006"
    with pytest.warns(RuntimeWarning, match="skipped the checkpoint step-00000006"):
        resumed = sagenb.train(REGRESSION_CELL, steps=9, engines=2, resume=True, **ckpt)
    note = next(w for w in resumed.warnings if "step-00000006" in w)
    assert "written on 1 engine and holds no state for rank 1 of this run's 2" in note
    assert "resuming from the older step-00000003: steps 4-6 are trained again" in note
    assert resumed.history[0]["step"] == 4
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=0)


WIDER = REGRESSION_CELL.replace(
    "nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)", "nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)"
)


def test_resume_checks_the_options_and_model_it_was_written_with(pool, tmp_path):
    ckpt = dict(checkpoint_dir=str(tmp_path), resume=True, **SHORT)
    sagenb.train(REGRESSION_CELL, steps=3, checkpoint_dir=str(tmp_path), **SHORT)
    # another batch size moves the sample position, another seed the order: refused, early
    with pytest.raises(ConfigError, match="--batch-size 8: differs from the 16 the checkpoint"):
        sagenb.train(REGRESSION_CELL, steps=6, **{**ckpt, "batch_size": 8})
    with pytest.raises(ConfigError, match="--seed 1: differs from the 0 the checkpoint"):
        sagenb.train(REGRESSION_CELL, steps=6, seed=1, **ckpt)
    with pytest.raises(Exception, match="the model differs from the checkpoint's") as info:
        sagenb.train(WIDER, steps=6, **ckpt)
    assert "0.weight is [16, 8] in the checkpoint, [32, 8] in the model" in str(info.value)
    assert "cannot be read" not in str(info.value)
    # another lr: the optimizer's saved state keeps the old one; another grad-accum: rounding
    whole = sagenb.train(REGRESSION_CELL, steps=6, **SHORT)
    with pytest.warns(RuntimeWarning, match="--lr 0.5 differs from the 0.001"):
        resumed = sagenb.train(REGRESSION_CELL, steps=6, lr=0.5, grad_accum=2, **ckpt)
    assert any("trains on with it (--lr 0.5 is not used)" in w for w in resumed.warnings)
    assert any("--grad-accum 2 differs from the 1" in w for w in resumed.warnings)
    # 1e-6: two half-batch slices sum in another order than one batch (float32 rounding)
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=1e-6)
    newest = tmp_path / "step-00000006"  # records the lr its optimizer went on with
    assert saved_options(newest, check(newest))["lr"] == 0.001
    # a checkpoint written before the record resumes as it did: nothing to compare
    without_record(tmp_path / "step-00000006")
    sagenb.train(REGRESSION_CELL, steps=9, seed=1, **ckpt)
    assert latest(tmp_path).name == "step-00000009"


def without_record(checkpoint) -> None:
    """Rewrite `checkpoint` without its options record, as sagenb wrote them before."""
    flat = checkpoint.parent / "flat.pt"
    dcp_to_torch_save(checkpoint, flat)
    state = torch.load(flat, weights_only=False)  # our own, trusted file
    del state[RECORD]
    torch.save(state, flat)
    shutil.rmtree(checkpoint)
    torch_save_to_dcp(flat, checkpoint)


def test_a_crash_leftover_never_blocks_a_resume(pool, tmp_path):
    """A file where a checkpoint's temporary directory goes, a directory where the `latest`
    pointer's temporary file goes (a half-written directory: test_checkpoints.py)."""
    sagenb.train(
        REGRESSION_CELL, steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=3, **SHORT
    )
    good = latest(tmp_path)
    (tmp_path / ".step-00000009.tmp").write_bytes(b"\0" * 10)
    (tmp_path / ".latest.tmp").mkdir()
    (tmp_path / ".latest.tmp" / "x").write_bytes(b"")
    assert latest(tmp_path) == good
    resumed = sagenb.train(
        REGRESSION_CELL, steps=9, checkpoint_dir=str(tmp_path), resume=True, **SHORT
    )
    assert resumed.history[0]["step"] == 7 and latest(tmp_path).name == "step-00000009"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000009"]


@pytest.fixture
def full_disk(tmp_path):
    """A 16 KiB tmpfs: a checkpoint does not fit (the tests run as root)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_a_full_disk_says_disk_full(pool, full_disk):
    with pytest.raises(TrainingError) as info:
        sagenb.train(REGRESSION_CELL, steps=3, checkpoint_dir=str(full_disk), **SHORT)
    message = str(info.value)
    assert f"disk full: no space left in {full_disk}" in message
    assert "unexpected pos" not in message
    assert not list(full_disk.glob(".*.tmp"))  # the half-written checkpoint is gone


def test_a_checkpoint_renamed_into_place_but_not_pointed_at_comes_first(tmp_path):
    """A crash between renaming step 9 into place and replacing `latest` (still naming step
    6): step 9 is complete, finished after the pointer was written, and resumed from first."""
    for name in ("step-00000003", "step-00000006", "step-00000009"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest").write_text("step-00000006")
    past = time.time() - 60
    for name, when in (("step-00000003", past - 20), ("step-00000006", past - 10)):
        os.utime(tmp_path / name, (when, when))
    os.utime(tmp_path / "latest", (past, past))
    assert [p.name for p in candidates(tmp_path)] == [
        "step-00000009",
        "step-00000006",
        "step-00000003",
    ]
