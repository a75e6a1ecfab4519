"""Sharded (FSDP2) and tensor parallel, activation checkpointing and mixed precision, on real
engines, against the single-process reference of the contract."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.config.job import JobError
from sagenb.run.failures import TrainingError

from .helpers import assert_params_equal, check_equal
from .models import MAP_STYLE_CELL, SEQUENTIAL_CELL, SPLIT_GPT_CELL, UNSPLITTABLE_CELL
from .reference import eval_loss, train_reference

TOL = 1e-5
MODELS = {"mlp": SEQUENTIAL_CELL, "gpt": SPLIT_GPT_CELL}
CONV_CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 1, 3, padding=1))
X = torch.randn(64, 1, 8)
dataset = torch.utils.data.TensorDataset(X, X)
loss_fn = nn.functional.mse_loss
"""


@pytest.mark.parametrize("strategy", ["sharded", "tensor"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_reference(pool, strategy, name):
    options = dict(batch_size=32, epochs=2, steps=12)
    result = sagenb.train(MODELS[name], strategy=strategy, dashboard=False, **options)
    check_equal(result, MODELS[name], **options)
    if name == "gpt":  # the tied embedding and head are still one weight
        state = result.state_dict()
        assert torch.equal(state["wte.weight"], state["head.weight"])


@pytest.mark.parametrize("strategy", ["sharded", "tensor"])
def test_loop_options_and_eval(pool, strategy):
    options = dict(batch_size=16, epochs=2, grad_accum=2, clip_grad_norm=0.5)
    result = sagenb.train(
        MAP_STYLE_CELL, strategy=strategy, eval_every=10, dashboard=False, **options
    )
    model, ns = check_equal(result, MAP_STYLE_CELL, **options)
    assert [row["lr"] for row in result.history[:6]] == pytest.approx([0.02] * 5 + [0.01])
    assert [step for step, _ in result.eval_losses] == [10, 20]
    assert result.eval_losses[-1][1] == pytest.approx(
        eval_loss(model, ns["eval_dataset"], ns["loss_fn"]), abs=TOL
    )


def test_tensor_groups_with_data_parallel_across_them(pool4):
    options = dict(batch_size=32, steps=6, clip_grad_norm=1.0)
    result = sagenb.train(
        SPLIT_GPT_CELL, strategy="tensor", tensor_parallel=2, dashboard=False, **options
    )
    check_equal(result, SPLIT_GPT_CELL, **options)
    samples = {rec.rank: rec.values["samples"] for rec in result.metrics if rec.step == 1}
    assert samples == {r: 16 for r in range(4)}  # 2 replicas x 16, each group's pair alike


def test_tensor_plan_by_hand(pool):
    cell = SEQUENTIAL_CELL + '\ntp_plan = {"2": "colwise", "4": "rowwise"}\n'
    result = sagenb.train(cell, strategy="tensor", batch_size=32, steps=6, dashboard=False)
    check_equal(result, cell, batch_size=32, steps=6)
    split = [rec.values["memory/params(MiB)"] for rec in result.metrics if rec.step == 6]
    whole = sagenb.train(SEQUENTIAL_CELL, batch_size=32, steps=1, dashboard=False)
    assert max(split) < whole.metrics[-1].values["memory/params(MiB)"]


@pytest.mark.parametrize("strategy", ["sharded", "tensor"])
def test_delay_init(pool, strategy):
    options = dict(batch_size=32, steps=4, delay_init=True)
    result = sagenb.train(SPLIT_GPT_CELL, strategy=strategy, dashboard=False, **options)
    check_equal(result, SPLIT_GPT_CELL, **options)


def test_sharded_holds_a_half_per_engine(pool):
    memory = {}
    for strategy in ("data", "sharded"):
        result = sagenb.train(
            SPLIT_GPT_CELL, strategy=strategy, batch_size=32, steps=2, dashboard=False
        )
        memory[strategy] = [rec.values for rec in result.metrics if rec.step == 2]
    for kind in ("params", "grads", "optimizer"):
        key = f"memory/{kind}(MiB)"
        whole = memory["data"][0][key]
        for values in memory["sharded"]:  # FSDP pads each parameter to a multiple of 2 rows
            assert 0.45 * whole <= values[key] <= 0.56 * whole, (kind, values[key], whole)
    # the same samples per engine, so the same activations: the weights FSDP gathers for a
    # block's forward are parameters, not activations
    key = "memory/activations(MiB)"
    assert [v[key] for v in memory["sharded"]] == pytest.approx([memory["data"][0][key]] * 2)


@pytest.mark.parametrize("strategy", ["data", "sharded", "model"])
def test_activation_checkpointing_changes_no_gradient(pool, strategy):
    options = dict(batch_size=32, steps=4, clip_grad_norm=1.0)
    extra = {"partitions": 2} if strategy == "model" else {}
    peaks = {}
    for recompute in (False, True):
        result = sagenb.train(
            SPLIT_GPT_CELL,
            strategy=strategy,
            activation_checkpointing=recompute,
            dashboard=False,
            **extra,
            **options,
        )
        check_equal(result, SPLIT_GPT_CELL, **options)
        peaks[recompute] = max(rec.values["memory/activations(MiB)"] for rec in result.metrics)
    assert peaks[True] < 0.5 * peaks[False]  # only each block's input is kept


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_stays_close_to_fp32(pool, precision):
    options = dict(batch_size=32, epochs=3, steps=20)
    result = sagenb.train(SPLIT_GPT_CELL, precision=precision, dashboard=False, **options)
    _, losses, _ = train_reference(SPLIT_GPT_CELL, **options)
    # stated tolerance: every step's loss within 2% of fp32's (bf16 keeps 8 bits of mantissa)
    torch.testing.assert_close(result.losses, losses, rtol=0.02, atol=0)
    # and the reduced precision was really used: fp32 agrees to about 1e-7
    assert max(abs(a - b) for a, b in zip(result.losses, losses)) > 5e-6
    if precision == "fp16":
        assert all(row["loss_scale"] > 1 and row["skipped_step"] == 0 for row in result.history)


def test_sharded_resume_equals_an_uninterrupted_run(pool, tmp_path):
    options = dict(strategy="sharded", batch_size=32, epochs=4, dashboard=False)
    whole = sagenb.train(SPLIT_GPT_CELL, steps=10, **options)
    sagenb.train(SPLIT_GPT_CELL, steps=4, checkpoint_dir=str(tmp_path), **options)
    resumed = sagenb.train(
        SPLIT_GPT_CELL, steps=10, checkpoint_dir=str(tmp_path), resume=True, **options
    )
    assert resumed.history[0]["step"] == 5
    assert_params_equal(resumed.state_dict(), whole.state_dict(), tol=0)
    loaded = sagenb.load_checkpoint(tmp_path)  # the sharded checkpoint, whole, in one process
    assert_params_equal(loaded, whole.state_dict(), tol=0)


def test_errors_say_what_to_change(pool):
    with pytest.raises((JobError, TrainingError), match="splits nn.Linear layers"):
        sagenb.train(CONV_CELL, strategy="tensor", batch_size=16, steps=1, dashboard=False)
    with pytest.raises((JobError, TrainingError), match="no repeated blocks to checkpoint"):
        sagenb.train(
            UNSPLITTABLE_CELL, activation_checkpointing=True, batch_size=16, dashboard=False
        )
