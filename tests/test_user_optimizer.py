"""A cell's make_optimizer is checked against the parameters it was given
(sagenb/engine/user_optimizer.py): nanoGPT's `model.configure_optimizers(...)` closure and a
parameter list taken at the top of the cell are mapped onto the strategy's parameters by name,
keeping each group's hyperparameters; an optimizer over strangers, or one that leaves trainable
parameters out, is refused before the first step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sagenb
from sagenb.engine import user_optimizer

from .helpers import check_equal
from .models import nanogpt_cell

#: nanoGPT's own AdamW groups (decay on matrices, none on biases and norms), through a closure
#: over the cell's model, as its train.py calls it
OWN_GROUPS = """
def make_optimizer(params):
    return model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
"""
#: SGD over a list taken before any strategy touched the model
STALE_LIST = """
params_list = list(model.parameters())
def make_optimizer(params):
    return torch.optim.SGD(params_list, lr=0.5)
"""
OPTIONS = dict(batch_size=8, steps=3)
# SGD: 1e-5, as tests/test_own_loss.py measured. AdamW's groups: 3 steps of 2 engines read
# 2e-7-6e-7 off one process (5 runs, alone and beside a busy machine); a stage whose
# optimizer updated nothing reads lr x steps = 3e-3 off, so 1e-4 tells the two apart
SGD_TOL, ADAMW_TOL = 1e-5, 1e-4


def _gpt():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    decay = [model[0].weight, model[1].weight]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": [model[1].bias, *model[2].parameters()], "weight_decay": 0.0, "lr": 0.5},
    ]
    return model, groups


def test_an_optimizer_over_the_given_parameters_is_left_as_it_is():
    model, groups = _gpt()
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    same, notes = user_optimizer.checked(optimizer, model.named_parameters(), {})
    assert same is optimizer and notes == []


def test_the_cells_models_parameters_are_mapped_by_name_keeping_each_groups_options():
    model, groups = _gpt()
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    stage = copy.deepcopy(model[1:])  # a pipeline stage: other objects, the same names
    given = list(stage.named_parameters())
    known = {id(p): n for n, p in model.named_parameters()}
    mapped, notes = user_optimizer.checked(optimizer, given, known)
    assert mapped is optimizer
    decay, nodecay = mapped.param_groups
    ids = [[id(p) for p in g["params"]] for g in mapped.param_groups]
    linear, norm = stage  # named 1.* and 2.*, as in the model
    assert ids == [[id(linear.weight)], [id(p) for p in (linear.bias, *norm.parameters())]]
    assert decay["weight_decay"] == 0.1
    assert (nodecay["weight_decay"], nodecay["lr"]) == (0.0, 0.5)
    assert notes == [
        "make_optimizer's AdamW holds the cell's model's parameters, not the params it was "
        "given: its 2 parameter group(s) were mapped onto this run's parameters by name (5 "
        "parameter(s) on rank 0, e.g. 0.weight, 1.weight, 1.bias, 2.weight, ...), each group "
        "keeping its hyperparameters"
    ]


def test_strangers_and_left_out_parameters_are_refused_naming_them():
    model, _ = _gpt()
    strangers = torch.optim.SGD([nn.Parameter(torch.zeros(3, 2))], lr=0.1)
    with pytest.raises(sagenb.JobError) as caught:
        user_optimizer.checked(strangers, model.named_parameters(), {})
    assert str(caught.value) == (
        "make_optimizer's SGD holds 1 parameters that are neither the params it was given nor "
        "the cell's model's (shapes (3, 2)): build it over the params argument (or over the "
        "model's named_parameters()), so it updates what this run trains"
    )
    head_only = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with pytest.raises(sagenb.JobError) as caught:
        user_optimizer.checked(head_only, model.named_parameters(), {})
    assert str(caught.value).startswith(
        "make_optimizer's SGD leaves out 3 of the 5 trainable parameters it was given "
        "(0.weight, 1.weight, 1.bias), which would get gradients and never change"
    )
    model[0].weight.requires_grad_(False)
    model[1].requires_grad_(False)  # frozen ones may be left out
    assert user_optimizer.checked(head_only, model.named_parameters(), {})[1] == []


@pytest.mark.parametrize(
    "optimizer, tol, options",
    [
        (OWN_GROUPS, ADAMW_TOL, dict(strategy="model", partitions=2, microbatches=2)),
        (OWN_GROUPS, ADAMW_TOL, dict(strategy="sharded")),
        (STALE_LIST, SGD_TOL, dict(strategy="sharded")),
        (STALE_LIST, SGD_TOL, dict(strategy="tensor")),
    ],
    ids=["own-groups-model", "own-groups-sharded", "stale-list-sharded", "stale-list-tensor"],
)
def test_a_make_optimizer_that_ignores_its_argument_trains_as_one_process(
    pool, optimizer, tol, options
):
    cell = nanogpt_cell("dict", optimizer=optimizer)
    result = sagenb.train(cell, dashboard=False, **OPTIONS, **options)
    check_equal(result, cell, tol=tol, **OPTIONS)
    mapped = [w for w in result.warnings if "were mapped onto this run's parameters" in w]
    assert len(mapped) == (0 if options["strategy"] == "sharded" and optimizer is OWN_GROUPS else 1)
