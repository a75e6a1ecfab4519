"""Data parallel on 2 real engines equals the single-process reference of the contract."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.config import ConfigError
from sagenb.engine.data.order import plan_steps

from .conftest import REGRESSION_CELL, SGD_MOMENTUM
from .helpers import check_equal
from .models import MAP_STYLE_CELL
from .reference import eval_loss

TOL = 1e-5


def test_sgd_momentum_matches_reference(pool):
    cell = REGRESSION_CELL + SGD_MOMENTUM
    result = sagenb.train(cell, batch_size=32, epochs=4, dashboard=False)
    assert len(result.history) == 24  # 192 // 32 per epoch, 4 epochs
    check_equal(result, cell, batch_size=32, epochs=4)
    assert result.engines == 2
    # the ranks really saw different samples: their losses differ
    assert all(row["rank_losses"][0] != row["rank_losses"][1] for row in result.history)


def test_default_adamw_matches_reference(pool):
    result = sagenb.train(
        REGRESSION_CELL, batch_size=16, epochs=3, steps=25, lr=0.01, dashboard=False
    )
    assert len(result.history) == 25
    check_equal(result, REGRESSION_CELL, batch_size=16, epochs=3, steps=25, lr=0.01)


def test_two_epochs_drop_the_incomplete_batch(pool):
    # 192 samples in batches of 40: 4 full batches per epoch, 32 samples dropped each epoch
    cell = REGRESSION_CELL + SGD_MOMENTUM
    result = sagenb.train(cell, batch_size=40, epochs=2, dashboard=False)
    assert [row["epoch"] for row in result.history] == [0] * 4 + [1] * 4
    check_equal(result, cell, batch_size=40, epochs=2)


def test_grad_accum_clipping_scheduler_and_eval(pool):
    options = dict(batch_size=16, epochs=2, grad_accum=2, clip_grad_norm=0.5)
    result = sagenb.train(MAP_STYLE_CELL, eval_every=10, dashboard=False, **options)
    model, ns = check_equal(result, MAP_STYLE_CELL, **options)
    # the scheduler stepped once per optimizer step: lr halves every 5 steps
    assert [row["lr"] for row in result.history[:11]] == pytest.approx(
        [0.02] * 5 + [0.01] * 5 + [0.005]
    )
    # clipping was active (the reference clipped too, so equality above covers the values)
    assert max(row["grad_norm"] for row in result.history) > 0.5
    # evaluated at steps 10 and 20 (the last step); the final value equals the reference's
    assert [step for step, _ in result.eval_losses] == [10, 20]
    assert result.eval_losses[-1][1] == pytest.approx(
        eval_loss(model, ns["eval_dataset"], ns["loss_fn"]), abs=TOL
    )


def test_eval_once_after_training_by_default(pool):
    result = sagenb.train(MAP_STYLE_CELL, batch_size=32, steps=4, dashboard=False)
    assert [step for step, _ in result.eval_losses] == [4]


def test_uneven_split_is_refused_before_training(pool):
    with pytest.raises(
        ConfigError, match=r"--batch-size 30: must be divisible by engines x grad-accum = 2 x 2"
    ):
        sagenb.train(REGRESSION_CELL, batch_size=30, grad_accum=2, dashboard=False)


def test_callable_job_trains_like_the_cell(pool):
    def job():
        from torch import nn

        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        X = torch.randn(192, 8)
        Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(192, 1)
        return dict(
            model=model,
            dataset=torch.utils.data.TensorDataset(X, Y),
            loss_fn=nn.functional.mse_loss,
        )

    result = sagenb.train(job, batch_size=32, steps=6, dashboard=False)
    check_equal(result, REGRESSION_CELL, batch_size=32, steps=6)


CLASSES_CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
X = torch.randn(64, 8)
y = torch.randint(0, 4, (64,))
y[{ignored}] = -100
dataset = {dataset}
loss_fn = nn.CrossEntropyLoss()
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
"""


@pytest.mark.parametrize(
    "grad_accum, dataset",
    [
        (1, "torch.utils.data.TensorDataset(X, y)"),
        (2, "torch.utils.data.TensorDataset(X, y)"),
        (2, "list(zip(X, y))"),
    ],
)
def test_class_labels_that_one_engine_never_counts(pool, grad_accum, dataset):
    """Integer class labels. A TensorDataset's are counted for the whole global batch on
    every engine, with no collective (engine/loop.py _counted_here); other datasets' counts
    are all-reduced while the step runs, the step weighing its pieces as if every sample
    counted, then rescaling the gradients once the sum is in (_GlobalCount). Here engine 0's
    share of every slice is all -100 and engine 1's holds one more: were the weight each
    rank's own guess (0 on engine 0), the engines' gradients would disagree and neither would
    equal one process."""
    steps, size = 4, 8
    plan = plan_steps(64, batch_size=size, epochs=1, steps=steps, seed=0)
    slices = [piece for step in plan for piece in step.indices.chunk(grad_accum)]
    ignored = [int(i) for piece in slices for i in piece[: len(piece) // 2 + 1]]
    cell = CLASSES_CELL.format(ignored=ignored, dataset=dataset)
    result = sagenb.train(
        cell, batch_size=size, steps=steps, grad_accum=grad_accum, dashboard=False
    )
    counted = {(m.rank, m.values["counted"]) for m in result.metrics if "counted" in m.values}
    assert counted == {(0, 0.0), (1, size // 2 - grad_accum)}  # fewer than the samples
    check_equal(result, cell, batch_size=size, steps=steps)
