"""Every transformers head as it comes, on its own loss (no loss_fn), equals one process: BERT
sequence classifiers (single-label, multi-label, regression, by config.problem_type), a masked
LM and a token classifier, a ViT image classifier, GPT-2 with its default use_cache=True and a
Llama sequence classifier (issue 29).

A pipeline's last stage computes the loss the model's own forward computes (the labels travel
with the inputs); each piece is weighted by what its head counts: tokens other than -100 for
language-model and token heads, samples for sequence and image heads (engine/objective.py)."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.engine.model.kv_cache import cache_off
from sagenb.engine.objective import Objective
from sagenb.engine.strategies.pipeline.partition import split_model

from .helpers import check_equal
from .models import head_cell
from .reference import batch, eval_loss, namespace

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


@pytest.mark.parametrize("head", ["sequence", "causal-lm"])
def test_last_exported_stage_returns_the_models_output(head):
    """Split through torch.export with the labels among the inputs, the stages run one after
    another give the model's own output, its loss included (the head's code, not sagenb's);
    GPT-2 as its config comes (use_cache=True) splits once the cache is off, and gets it back."""
    ns = namespace(head_cell(head), 0)
    model, data = ns["model"], batch(ns["dataset"], torch.arange(4))
    cached = getattr(model.config, "use_cache", None)
    restore = cache_off(model)
    stages, _ = split_model(model, [0, 1], ((), data))
    value = stages[0](**data)
    out = stages[1](*value)
    restore()
    assert getattr(model.config, "use_cache", None) == cached
    expected = model(**data)
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=TOL)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=TOL)


@pytest.mark.parametrize(
    ("head", "shifted", "counted"),
    [
        ("causal-lm", True, None),
        ("masked-lm", False, None),
        ("regression", False, 4),
        ("t5", False, None),
    ],
)
def test_each_head_counts_what_its_loss_averages(head, shifted, counted):
    """Tokens other than -100 (after the shift for GPT-2, whose class names no head: its
    loss_function is the causal LM's all the same), samples for a regression head; T5's
    labels are aligned with its logits (it is given the causal LM's loss_function by its
    class name, ...ForConditionalGeneration, but its forward computes cross_entropy itself)."""
    ns = namespace(head_cell(head), 0)
    data = batch(ns["dataset"], torch.arange(4))
    objective = Objective.build(ns["model"], None, ns["dataset"][0])
    assert objective.shifted == shifted
    labels = data["labels"]
    kept = labels[:, 1:] if shifted else labels
    expected = counted if counted is not None else int((kept != -100).sum())
    assert int(objective.count(labels)) == expected
