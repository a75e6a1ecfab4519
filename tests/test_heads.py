"""Every transformers head as it comes, on its own loss (no loss_fn), equals one process: BERT
sequence classifiers (single-label, multi-label, regression, by config.problem_type), a masked
LM and a token classifier, a ViT image classifier, GPT-2 with its default use_cache=True and a
Llama sequence classifier (issue 29).

A pipeline's last stage computes the loss the model's own forward computes (the labels travel
with the inputs); each piece is weighted by what its head counts: tokens other than -100 for
language-model and token heads, samples for sequence and image heads (engine/objective.py)."""

from __future__ import annotations

import pytest

import sagenb

from .helpers import check_equal
from .models import head_cell
from .reference import eval_loss, namespace

OPTIONS = dict(batch_size=8, steps=2)
PIPELINE = dict(partitions=2, microbatches=2)
TOL = 1e-5


def train(head: str, strategy: str, **extra):
    cell = head_cell(head)
    options = {**OPTIONS, **(PIPELINE if strategy == "model" else {}), **extra}
    result = sagenb.train(cell, strategy=strategy, dashboard=False, **options)
    model, _ = check_equal(result, cell, **OPTIONS)
    return result, model


@pytest.mark.parametrize("strategy", ["data", "sharded", "model"])
@pytest.mark.parametrize("head", ["sequence", "masked-lm", "token", "image"])
def test_heads_train_on_their_own_loss(pool, head, strategy):
    train(head, strategy)


@pytest.mark.parametrize(
    ("head", "strategy"),
    [
        ("multi-label", "model"),
        ("regression", "model"),
        ("causal-lm", "model"),  # GPT-2 with use_cache=True, as its config comes
        ("llama-sequence", "tensor"),
    ],
)
def test_more_heads(pool, head, strategy):
    """The pipeline's eval chunks: 8 eval samples in chunks of the microbatch (4) here, so
    the chunk arithmetic runs; one process reads the whole eval set in one forward."""
    result, model = train(head, strategy)
    ns = namespace(head_cell(head), 0)
    expected = eval_loss(model, ns["eval_dataset"], None)
    assert result.history[-1]["eval_loss"] == pytest.approx(expected, abs=TOL)
