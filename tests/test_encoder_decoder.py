"""Encoder-decoders as they come, on their own loss: T5 and BART (issue 29, item 3).

Their blocks are the encoder's then the decoder's; a pipeline cut anywhere between them carries
to later stages what those read: the encoder's output (every decoder block's cross-attention
reads it, and the output returns it), T5's relative position biases (made by the first block of
each stack and handed on), the masks and the labels the decoder's inputs are made from. The
shared embedding (the encoder's, the decoder's, the tied head's) is one Parameter per stage.
Their loss is cross_entropy on labels aligned with the logits: unshifted counts."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.engine.model.blocks import find_blocks, tied_groups
from sagenb.engine.model.kv_cache import cache_off
from sagenb.engine.strategies.pipeline.partition import split_model

from .helpers import check_equal
from .models import head_cell
from .reference import batch, eval_loss, namespace

OPTIONS = dict(batch_size=8, steps=2)
#: T5 cut inside its decoder: the encoder's output and both stacks' position biases cross;
#: BART cut inside its encoder: the shared embedding is read by both stages
CUTS = {"t5": (3,), "bart": (1,)}


@pytest.mark.parametrize("strategy", ["data", "sharded", "model"])
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_equals_one_process(pool, family, strategy):
    """Losses, parameters (1e-5, as every strategy's test) and the evaluation loss of one
    process. Before this, data and sharded counted each sequence's first label out of the
    weights (the causal LM's shift): the second loss was 4.8e-3 (T5) and 5.9e-4 (BART) off."""
    cell = head_cell(family)
    pipeline = dict(partitions=2, microbatches=2, partition_by="manual", cuts=CUTS[family])
    options = {**OPTIONS, **(pipeline if strategy == "model" else {})}
    result = sagenb.train(cell, strategy=strategy, dashboard=False, **options)
    model, ns = check_equal(result, cell, **OPTIONS)
    expected = eval_loss(model, ns["eval_dataset"], None)
    assert result.history[-1]["eval_loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_every_cut_gives_the_models_output(family):
    """Split at every block boundary at once, and with the encoder and the decoder's first
    block in one stage: chained, the stages return the model's loss and logits exactly; each
    stage holds one Parameter per tied weight, whatever the names it reads it by."""
    ns = namespace(head_cell(family), 0)
    model, data = ns["model"], batch(ns["dataset"], torch.arange(4))
    blocks = find_blocks(model).names
    assert [name.split(".")[-3] for name in blocks] == ["encoder"] * 2 + ["decoder"] * 2
    restore = cache_off(model)
    expected = model(**data)
    (tied,) = tied_groups(model)
    for starts in ([0, 1, 2, 3], [0, 3]):
        stages, _ = split_model(model, starts, ((), data))
        value = stages[0](**data)
        for stage in stages[1:]:
            value = stage(*value) if isinstance(value, tuple) else stage(value)
        torch.testing.assert_close(value.loss, expected.loss, rtol=0, atol=0)
        torch.testing.assert_close(value.logits, expected.logits, rtol=0, atol=0)
        for stage in stages:
            held = dict(stage.named_parameters(remove_duplicate=False))
            assert len({id(held[n]) for n in tied if n in held}) <= 1
    restore()
