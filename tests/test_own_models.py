"""Data parallel and sharded on transformers' GPT-2 (Conv1D layers, a tied head) and BERT,
wrapped to return logits, equal one process: the models of the pipeline tests, in the
strategies that keep every layer whole or shard it by blocks (the Llama's own cases, as it
is, are in test_dict_batches.py)."""

from __future__ import annotations

import pytest

import sagenb

from .helpers import check_equal
from .models import LM_CELLS


@pytest.mark.parametrize("strategy", ["data", "sharded"])
@pytest.mark.parametrize("name", ["gpt2-tied", "bert"])
def test_transformers_models_in_data_and_sharded(pool, name, strategy):
    cell = LM_CELLS[name]
    options = dict(batch_size=8, steps=6, grad_accum=2)
    result = sagenb.train(cell, strategy=strategy, dashboard=False, **options)
    check_equal(result, cell, **options)
    assert result.warnings == []  # dropout set to 0 in these configs: nothing to warn
