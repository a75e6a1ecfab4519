"""Checkpoints: atomic writes, resume after a killed engine, the same final parameters as an
uninterrupted run, for data parallel and for pipelines; one-process loading."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.config import ConfigError
from sagenb.engine.checkpoint import latest
from sagenb.failures import EngineDiedError, TrainingInterrupted

from .conftest import REGRESSION_CELL
from .models import GPT_CELL
from .test_reliability import LONG, fault_cell, interrupt_after


def same(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


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
    assert same(resumed.state_dict(), whole.state_dict()) == 0.0
    torch.testing.assert_close(resumed.losses, whole.losses[10:], rtol=0, atol=0)
    assert same(sagenb.load_checkpoint(ckpt), whole.state_dict()) == 0.0


def test_pipeline_resume_and_one_process_load(pool, tmp_path):
    options = dict(strategy="model", partitions=2, batch_size=32, epochs=4, dashboard=False)
    whole = sagenb.train(GPT_CELL, steps=12, **options)
    sagenb.train(GPT_CELL, steps=5, checkpoint_dir=str(tmp_path), **options)
    resumed = sagenb.train(GPT_CELL, steps=12, checkpoint_dir=str(tmp_path), resume=True, **options)
    assert resumed.history[0]["step"] == 6
    assert same(resumed.state_dict(), whole.state_dict()) == 0.0
    loaded = sagenb.load_checkpoint(tmp_path)  # both stages' parts, tied names included
    assert same(loaded, whole.state_dict()) == 0.0
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


def test_interrupt_writes_a_checkpoint(pool, tmp_path):
    interrupt_after(3.0)
    with pytest.raises(TrainingInterrupted) as info:
        sagenb.train(REGRESSION_CELL, checkpoint_dir=str(tmp_path), **LONG)
    steps = len(info.value.result.history)
    assert latest(tmp_path).name == f"step-{steps:08d}"
    assert same(sagenb.load_checkpoint(tmp_path), info.value.result.state_dict()) == 0.0


def test_checkpoint_flags_need_a_directory():
    with pytest.raises(ConfigError, match="--resume True: needs --checkpoint-dir"):
        sagenb.TrainConfig(resume=True)
    with pytest.raises(ConfigError, match="--checkpoint-every 5: needs --checkpoint-dir"):
        sagenb.TrainConfig(checkpoint_every=5)
