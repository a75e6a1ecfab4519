"""Checkpoints: atomic writes, resume after a killed engine, the same final parameters as an
uninterrupted run, for data parallel and for pipelines; one-process loading; a newest checkpoint
that cannot be read skipped for the older one; a crafted checkpoint runs nothing."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import sagenb
from sagenb.config import ConfigError
from sagenb.config.job import JobError
from sagenb.engine.checkpoint.distributed import candidates, latest
from sagenb.engine.checkpoint.reader import CheckpointError, SafePlanner, SafeReader
from sagenb.metrics import keys
from sagenb.run.failures import EngineDiedError, TrainingError, TrainingInterrupted

from .conftest import REGRESSION_CELL
from .helpers import LONG, assert_params_equal, fault_cell, interrupt_after
from .models import GPT_CELL


def killed_once(marker) -> str:
    """Rank 1's engine dies at its 13th loss (step 13), once: the marker file remembers."""
    m = repr(str(marker))
    kill = f"(open({m}, 'w').close(), os.kill(os.getpid(), signal.SIGKILL))"
    once = f"{kill} if not os.path.exists({m}) else None"
    return fault_cell(once, at_call=13)


def test_resume_after_a_killed_engine_equals_an_uninterrupted_run(pool, tmp_path):
    options = dict(batch_size=16, epochs=2, steps=20, dashboard=False)
    cell = killed_once(tmp_path / "killed")
    whole = sagenb.train(REGRESSION_CELL, **options)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(EngineDiedError):
        sagenb.train(cell, checkpoint_dir=str(ckpt), checkpoint_every=5, **options)
    assert latest(ckpt).name == "step-00000010"  # the last one before the engine died
    resumed = sagenb.train(cell, checkpoint_dir=str(ckpt), resume=True, **options)
    assert [row["step"] for row in resumed.history] == list(range(11, 21))
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=0)
    torch.testing.assert_close(resumed.losses, whole.losses[10:], rtol=0, atol=0)
    assert_params_equal(sagenb.load_checkpoint(ckpt), whole.state_dict(), tol=0)


def test_pipeline_resume_and_one_process_load(pool, tmp_path):
    options = dict(strategy="model", partitions=2, batch_size=32, epochs=4, dashboard=False)
    whole = sagenb.train(GPT_CELL, steps=12, **options)
    sagenb.train(GPT_CELL, steps=5, checkpoint_dir=str(tmp_path), **options)
    resumed = sagenb.train(GPT_CELL, steps=12, checkpoint_dir=str(tmp_path), resume=True, **options)
    assert resumed.history[0]["step"] == 6
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=0)
    loaded = sagenb.load_checkpoint(tmp_path)  # both stages' parts, tied names included
    assert_params_equal(loaded, whole.state_dict(), tol=0)
    assert torch.equal(loaded["wte.weight"], loaded["head.weight"])


def test_a_crash_mid_write_keeps_the_last_good_checkpoint(pool, tmp_path):
    sagenb.train(
        REGRESSION_CELL,
        batch_size=16,
        steps=6,
        epochs=1,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=3,
        dashboard=False,
    )
    good = latest(tmp_path)
    # what a crash while writing step 9 leaves: a half-written temporary directory
    (tmp_path / ".step-00000009.tmp").mkdir()
    (tmp_path / ".step-00000009.tmp" / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert latest(tmp_path) == good
    resumed = sagenb.train(
        REGRESSION_CELL,
        batch_size=16,
        steps=9,
        epochs=1,
        checkpoint_dir=str(tmp_path),
        resume=True,
        dashboard=False,
    )
    assert resumed.history[0]["step"] == 7 and latest(tmp_path).name == "step-00000009"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000009"]


def test_each_step_that_wrote_a_checkpoint_reports_its_write_time(pool, tmp_path):
    """checkpoint_write(s), the cost notebook 05's checkpoint interval is computed from: on
    every rank, on the steps that wrote one (every 3rd and the last), and on no other."""
    run = sagenb.train(
        REGRESSION_CELL,
        batch_size=16,
        steps=7,
        epochs=1,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=3,
        dashboard=False,
    )
    wrote = {(m.step, m.rank) for m in run.metrics if keys.CHECKPOINT_WRITE in m.values}
    assert wrote == {(step, rank) for step in (3, 6, 7) for rank in (0, 1)}
    assert all(
        m.values[keys.CHECKPOINT_WRITE] > 0 for m in run.metrics if (m.step, m.rank) in wrote
    )


def test_interrupt_writes_a_checkpoint(pool, tmp_path):
    interrupt_after(3.0)
    with pytest.raises(TrainingInterrupted) as info:
        sagenb.train(REGRESSION_CELL, checkpoint_dir=str(tmp_path), **LONG)
    steps = len(info.value.result.history)
    assert latest(tmp_path).name == f"step-{steps:08d}"
    assert_params_equal(sagenb.load_checkpoint(tmp_path), info.value.result.state_dict(), tol=0)


def test_checkpoint_flags_need_a_directory():
    with pytest.raises(ConfigError, match="--resume True: needs --checkpoint-dir"):
        sagenb.TrainConfig(resume=True)
    with pytest.raises(ConfigError, match="--checkpoint-every 5: needs --checkpoint-dir"):
        sagenb.TrainConfig(checkpoint_every=5)


# -- checkpoints that cannot be read, and checkpoints that must not be trusted ---------------

SHORT = dict(batch_size=16, epochs=1, dashboard=False)


def two_checkpoints(directory) -> None:
    """step-00000003 and step-00000006 of the regression cell, `latest` naming the second."""
    sagenb.train(
        REGRESSION_CELL, steps=6, checkpoint_dir=str(directory), checkpoint_every=3, **SHORT
    )
    assert [p.name for p in candidates(directory)] == ["step-00000006", "step-00000003"]


def data_file(checkpoint) -> Path:
    return sorted(checkpoint.glob("*.distcp"))[0]


def garble_a_tensor(checkpoint) -> None:
    """Overwrite the first tensor record of the checkpoint's data with zeros, its size kept:
    what `check` cannot see (it reads no tensor), so the ranks' load fails and falls back."""
    meta = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own, trusted file
    info = next(meta.storage_data[i] for i in meta.storage_data if i.fqn.startswith("model/"))
    path = checkpoint / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + info.length] = bytes(info.length)
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    # a write cut short (a full disk, a copy interrupted): half of the metadata file
    "metadata cut short": lambda c: (c / ".metadata").write_bytes(
        (c / ".metadata").read_bytes()[:200]
    ),
    "data file cut short": lambda c: data_file(c).write_bytes(data_file(c).read_bytes()[:500]),
    "data file missing": lambda c: data_file(c).unlink(),
    "metadata not readable": lambda c: (c / ".metadata").write_bytes(b"not a pickle"),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_resume_skips_a_newest_checkpoint_that_cannot_be_read(pool, tmp_path, damage):
    whole = sagenb.train(REGRESSION_CELL, steps=9, **SHORT)
    two_checkpoints(tmp_path)
    CORRUPTIONS[damage](tmp_path / "step-00000006")
    with pytest.warns(RuntimeWarning, match=r"skipped the checkpoint step-00000006") as caught:
        resumed = sagenb.train(
            REGRESSION_CELL, steps=9, checkpoint_dir=str(tmp_path), resume=True, **SHORT
        )
    note = str(next(w.message for w in caught if "step-00000006" in str(w.message)))
    assert "resuming from the older step-00000003" in note and str(tmp_path) in note
    assert note in resumed.warnings
    assert resumed.history[0]["step"] == 4  # from the older checkpoint
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=0)


def test_resume_falls_back_when_the_ranks_cannot_load_the_newest(pool, tmp_path):
    """Damage only the ranks' load finds (a tensor record garbled, sizes intact): they skip to
    the older checkpoint together and train on to the same parameters."""
    whole = sagenb.train(REGRESSION_CELL, steps=9, **SHORT)
    two_checkpoints(tmp_path)
    garble_a_tensor(tmp_path / "step-00000006")
    with pytest.warns(RuntimeWarning, match="skipped the checkpoint step-00000006.*loaded the"):
        older = sagenb.load_checkpoint(tmp_path)  # in one process, the same fall back
    assert list(older) == list(whole.state_dict())
    with pytest.warns(RuntimeWarning, match="skipped the checkpoint step-00000006"):
        resumed = sagenb.train(
            REGRESSION_CELL, steps=9, checkpoint_dir=str(tmp_path), resume=True, **SHORT
        )
    # only the engines found it: their note travels with the first step into the result
    assert any("skipped the checkpoint step-00000006" in w for w in resumed.warnings)
    assert resumed.history[0]["step"] == 4
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=0)


def test_no_readable_checkpoint_fails_before_training(pool, tmp_path):
    with pytest.raises(CheckpointError, match=r"--checkpoint-dir \S+ holds no checkpoint"):
        sagenb.train(REGRESSION_CELL, steps=9, checkpoint_dir=str(tmp_path), resume=True, **SHORT)
    two_checkpoints(tmp_path)
    for name in ("step-00000006", "step-00000003"):
        (tmp_path / name / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        sagenb.train(REGRESSION_CELL, steps=9, checkpoint_dir=str(tmp_path), resume=True, **SHORT)
    message = str(info.value)
    assert f"no checkpoint in --checkpoint-dir {tmp_path} can be read" in message
    assert "step-00000006: " in message and "step-00000003: " in message
    assert "EOFError" in message  # the cause, in one line
    assert "Traceback" not in message


def test_load_checkpoint_raises_an_exception_naming_the_directory_and_cause(pool, tmp_path):
    assert issubclass(sagenb.CheckpointError, Exception)
    with pytest.raises(sagenb.CheckpointError, match="is not a directory"):
        sagenb.load_checkpoint(tmp_path / "nowhere")
    two_checkpoints(tmp_path)
    data_file(tmp_path / "step-00000006").unlink()
    with pytest.warns(RuntimeWarning, match="skipped the checkpoint step-00000006"):
        older = sagenb.load_checkpoint(tmp_path)
    assert list(older) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    (tmp_path / "step-00000003" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(sagenb.CheckpointError) as info:
        sagenb.load_checkpoint(tmp_path)
    assert f"no checkpoint in {tmp_path} can be read" in str(info.value)
    assert ".metadata cannot be read" in str(info.value)


class _Payload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted(tmp_path, where: str) -> tuple[Path, Path]:
    """A checkpoint directory holding a payload in its `.metadata` or in a non-tensor entry of
    its data (DCP reads those with torch.load(weights_only=False)), and the payload's marker."""
    marker, directory = tmp_path / "marker", tmp_path / "ckpt"
    two_checkpoints(directory)
    newest = directory / "step-00000006"
    if where == "metadata":
        (newest / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    else:  # its tensors, with the payload as the step and the key order
        meta = pickle.loads((newest / ".metadata").read_bytes())
        target = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
        dcp.load(target, checkpoint_id=newest, no_dist=True)
        target.update(step=_Payload(marker), key_order=_Payload(marker))
        shutil.rmtree(newest)
        dcp.save(target, checkpoint_id=newest, no_dist=True)
    (directory / "step-00000003").rename(tmp_path / "older")  # nothing to fall back to
    return directory, marker


@pytest.mark.parametrize("where", ["metadata", "entry"])
def test_a_crafted_checkpoint_runs_nothing(pool, tmp_path, monkeypatch, where):
    directory, marker = crafted(tmp_path, where)
    refused = "refused" if where == "metadata" else "weights_only"
    with pytest.raises(sagenb.CheckpointError, match=refused):
        sagenb.load_checkpoint(directory)
    with pytest.raises(sagenb.CheckpointError, match=refused):  # in the notebook, early
        sagenb.train(REGRESSION_CELL, steps=9, checkpoint_dir=str(directory), resume=True, **SHORT)
    # the engines refuse it too (under torchrun no notebook looks first)
    monkeypatch.setattr("sagenb.run.training_run.resume_warnings", lambda config, engines: [])
    with pytest.raises(TrainingError, match=refused):
        sagenb.train(REGRESSION_CELL, steps=9, checkpoint_dir=str(directory), resume=True, **SHORT)
    # the reader and planner themselves, past the checks (defence in depth)
    with pytest.raises(CheckpointException):
        dcp.load(
            {"step": 0},
            storage_reader=SafeReader(directory / "step-00000006"),
            planner=SafePlanner(),
            no_dist=True,
        )
    time.sleep(0.5)  # a shell started by a payload would have touched it by now
    assert not marker.exists()


# -- a checkpoint folder is one run's ---------------------------------------------------------

WIDER = REGRESSION_CELL.replace(
    "nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)", "nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)"
)


def test_a_run_keeps_its_own_checkpoints_and_refuses_another_runs(pool, tmp_path):
    """A 3-step run into a folder holding a 6-step run's step 4 and step 6 pruned by step
    number: it deleted its own step 3, `latest` named a folder that was gone, and
    load_checkpoint handed back the 6-step run's parameters. A run of the same seed, batch
    size and model starts over, says so, and its checkpoints replace the folder's; another
    seed or model is refused before it trains, the folder left as it was; --resume goes on."""
    ckpt = dict(checkpoint_dir=str(tmp_path), **SHORT)
    sagenb.train(REGRESSION_CELL, steps=6, checkpoint_every=2, **ckpt)
    short = sagenb.train(REGRESSION_CELL, steps=3, **ckpt)
    assert latest(tmp_path) is not None and latest(tmp_path).name == "step-00000003"
    assert_params_equal(sagenb.load_checkpoint(tmp_path), short.state_dict(), tol=0)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003"]
    assert any(
        "step-00000006 of an earlier run" in w and "starts over" in w for w in short.warnings
    )
    with pytest.raises(ConfigError, match=r"--checkpoint-dir .* written with --seed 0, not 1"):
        sagenb.train(REGRESSION_CELL, steps=2, seed=1, **ckpt)
    with pytest.raises(JobError, match="checkpoints of another model") as info:
        sagenb.train(WIDER, steps=2, **ckpt)
    assert "0.weight is [16, 8] in the checkpoint, [32, 8] in this model" in str(info.value)
    assert "another --checkpoint-dir" in str(info.value)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003"]
    resumed = sagenb.train(REGRESSION_CELL, steps=5, resume=True, **ckpt)
    assert resumed.history[0]["step"] == 4 and latest(tmp_path).name == "step-00000005"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000005"]


# -- `latest`: a small file naming a folder inside the checkpoint directory -------------------


def one_process_checkpoint(path: Path, value: float) -> None:
    """A checkpoint load_checkpoint reads: one model entry and the key order."""
    state = {"model/w": torch.full((2,), value), "key_order": ["w"], "step": 1}
    dcp.save(state, checkpoint_id=path, no_dist=True)


LATEST_KINDS = {
    "device": "a character device",
    "fifo": "a FIFO",
    "oversized": "2147483648 bytes",
    "outside": "'../elsewhere' is not a folder inside",
    "absolute": "is not a folder inside",
    "linked outside": "'step-00000002' is not a folder inside",
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(LATEST_KINDS))
def test_latest_must_be_a_small_file_naming_a_folder_inside(tmp_path, kind):
    """/dev/zero as `latest` grew load_checkpoint and --resume until MemoryError, a FIFO hung
    both, and a folder outside the checkpoint directory was followed (and loaded)."""
    from sagenb.run.checkpoints import resume_warnings

    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    one_process_checkpoint(ckpt / "step-00000001", 1.0)
    one_process_checkpoint(elsewhere, 2.0)
    pointer = ckpt / "latest"
    if kind == "device":
        pointer.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(pointer)
    elif kind == "oversized":
        with open(pointer, "wb") as f:
            f.truncate(2 * 2**30)  # sparse
    elif kind == "linked outside":
        (ckpt / "step-00000002").symlink_to(elsewhere)
        pointer.write_text("step-00000002")
    else:
        pointer.write_text("../elsewhere" if kind == "outside" else str(elsewhere))
    message = f"{re.escape(str(pointer))}: must be a (regular|small) file.*{LATEST_KINDS[kind]}"
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=message):
        sagenb.load_checkpoint(ckpt)
    config = sagenb.TrainConfig(checkpoint_dir=str(ckpt), resume=True)
    with pytest.raises(CheckpointError, match=message):
        resume_warnings(config, 2)
    assert time.monotonic() - started < 5  # refused, not read
