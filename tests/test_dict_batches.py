"""transformers-style data: dict samples, ModelOutput outputs, the model's own loss, and labels of
-100 that leave pieces of the global batch with different numbers of counted tokens.

The reference is one process over the whole global batch in one forward (no accumulation), so
these tests fail if any strategy averages per-slice means (the gradient-accumulation bug of
transformers issue #34242)."""

from __future__ import annotations

import pytest

import sagenb

from .helpers import check_equal
from .models import llama_cell
from .reference import one_process_eval

TOL = 1e-5


@pytest.mark.parametrize("own_loss", [True, False], ids=["own-loss", "loss_fn"])
def test_data_parallel_dicts_and_padding_equal_one_process(pool, own_loss):
    cell = llama_cell(own_loss=own_loss, tied=not own_loss)  # untied and tied embeddings
    result = sagenb.train(cell, batch_size=16, grad_accum=2, steps=6, dashboard=False)
    check_equal(result, cell, steps=6, batch_size=16)
    # the pieces really counted different numbers of tokens
    counts = {m.values["counted"] for m in result.metrics if "counted" in m.values}
    assert len(counts) > 1


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sharded_dicts_equal_one_process(pool, tied):
    cell = llama_cell(tied=tied)
    result = sagenb.train(
        cell, strategy="sharded", batch_size=16, grad_accum=2, steps=5, dashboard=False
    )
    check_equal(result, cell, steps=5, batch_size=16)


@pytest.mark.parametrize("strategy", ["tensor", "model"])
def test_transformers_model_as_it_is_in_tensor_and_pipeline(pool, strategy):
    """No wrapper: the tensor plan is the model's own, and the pipeline, split through
    torch.export, computes the model's own loss (its forward's, traced) on its last
    stage from the logits and the labels."""
    cell = llama_cell(tied=strategy == "model")
    options = {"partitions": 2, "microbatches": 2} if strategy == "model" else {}
    result = sagenb.train(
        cell, strategy=strategy, batch_size=16, grad_accum=2, steps=4, dashboard=False, **options
    )
    model, _ = check_equal(result, cell, steps=4, batch_size=16)
    # evaluated in microbatch-sized chunks on the pipeline (export fixes the shapes; the last
    # chunk of 20 samples is filled up), as one forward over the whole eval set in one process
    assert result.history[-1]["eval_loss"] == pytest.approx(one_process_eval(cell, model), abs=TOL)


def test_eval_loss_is_the_mean_over_counted_tokens(pool):
    cell = llama_cell()
    result = sagenb.train(cell, batch_size=16, steps=3, eval_every=0, dashboard=False)
    model, _ = check_equal(result, cell, steps=3, batch_size=16)
    assert result.history[-1]["eval_loss"] == pytest.approx(one_process_eval(cell, model), abs=TOL)


# A model of the cell's own that takes keyword inputs and returns a dict with logits (fx can
# trace it, so a pipeline splits it): dict samples through every stage of a pipeline
KWARGS_GPT = """
import torch
from torch import nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            for _ in range(4)
        )
        self.head = nn.Linear(32, 64)
    def forward(self, input_ids, weights):
        x = self.wte(input_ids) * weights.unsqueeze(-1)
        for block in self.blocks:
            x = x + block(x)
        return {"logits": self.head(x)}

model = Net()
g = torch.Generator().manual_seed(5)
ids = torch.randint(0, 64, (64, 8), generator=g)
labels = torch.where(torch.rand(64, 8, generator=g) < 0.4, -100, ids.roll(-1, 1))
data = [{"input_ids": ids[i], "weights": torch.rand(8, generator=g), "labels": labels[i]}
        for i in range(64)]
dataset = data
def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
"""


@pytest.mark.parametrize("strategy", ["model", "tensor"])
def test_keyword_inputs_and_dict_outputs(pool, strategy):
    options = {"partitions": 2, "microbatches": 2} if strategy == "model" else {}
    result = sagenb.train(
        KWARGS_GPT,
        strategy=strategy,
        batch_size=16,
        grad_accum=2,
        steps=6,
        dashboard=False,
        **options,
    )
    check_equal(result, KWARGS_GPT, steps=6, batch_size=16)


def test_tuple_samples_without_loss_fn_are_refused(pool):
    cell = """
import torch
model = torch.nn.Linear(4, 1)
dataset = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
"""
    with pytest.raises(sagenb.JobError, match="defines no loss_fn, and its samples are tuples"):
        sagenb.train(cell, batch_size=8, steps=1, dashboard=False)
