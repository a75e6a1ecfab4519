"""The model's own loss by the model's own convention (sagenb/engine/model/own_loss.py): nanoGPT's
`forward(idx, targets=None)` returning `(logits, loss)` with `ignore_index=-1`, in dict and tuple
samples, trains to one process's parameters in every strategy; what cannot be read is refused
with what was looked for and what was found."""

from __future__ import annotations

import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

import sagenb
from sagenb.config.job import Job
from sagenb.engine.model import own_loss
from sagenb.engine.objective import Objective

from .helpers import check_equal
from .models import nanogpt_cell

# SGD (lr 0.5), 3 steps of 8 samples: the split strategies read 1e-7-3e-7 off one process in
# the losses and parameters on this machine, alone and beside a busy one (5 runs each); Adam
# is left out, as its first steps turn such rounding into full-size updates (docs/contract.md)
TOL = 1e-5
OPTIONS = dict(batch_size=8, steps=3)


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 3)

    def forward(self, idx, targets=None, mask=None):
        return self.w(idx.float())


def test_the_targets_keyword_is_read_from_forward():
    model = Job.of(nanogpt_cell("dict")).namespace()["model"]
    assert own_loss.target_key(model, ["idx", "targets"]) == ("targets", "")
    assert own_loss.target_key(model, ["idx", "labels"]) == ("labels", "")  # the contract's
    key, why = own_loss.target_key(TwoArgs(), ["idx", "targets", "mask"])
    assert key is None and why == (
        "sagenb looks for 'labels', else for the one key forward takes as an option, and of "
        "their keys (idx, targets, mask) targets and mask are all optional parameters of "
        "TwoArgs.forward(idx, targets=None, mask=None), so which one holds the targets is not "
        "known"
    )


def test_the_loss_is_found_in_the_output_whatever_its_place():
    logits, loss = torch.randn(2, 3), torch.tensor(1.5)
    assert own_loss.loss_in((logits, loss)) is loss
    assert own_loss.loss_in((loss, logits)) is loss
    assert own_loss.loss_in(OrderedDict(loss=loss, logits=logits)) is loss
    assert own_loss.loss_in((logits, None)) is None  # forward given no targets
    assert own_loss.loss_in((loss, loss.clone())) is None  # two scalars: which is not known
    assert own_loss.loss_in(logits) is None


def test_ignore_index_is_read_from_forward_pasted_or_imported(tmp_path, monkeypatch):
    """A pasted cell's source is kept in linecache (config/job.py), as IPython keeps a
    cell's; a model file beside the notebook is read from its file."""
    pasted = Job.of(nanogpt_cell("dict")).namespace()["model"]
    assert own_loss.ignore_index(pasted) == -1
    (tmp_path / "copied_gpt.py").write_text(
        "import torch\nfrom torch.nn import functional as F\n"
        "class Head(torch.nn.Linear):\n"
        "    def forward(self, x, targets=None):\n"
        "        logits = super().forward(x)\n"
        "        return logits, F.cross_entropy(logits, targets, ignore_index=-7)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import copied_gpt

    try:
        assert own_loss.ignore_index(copied_gpt.Head(2, 3)) == -7
    finally:
        sys.modules.pop("copied_gpt")
    assert own_loss.ignore_index(TwoArgs()) == own_loss.IGNORE_INDEX  # says none: torch's


def test_the_count_leaves_out_the_models_own_ignore_index():
    ns = Job.of(nanogpt_cell("dict")).namespace()
    objective = Objective.build(ns["model"], None, ns["dataset"][0])
    assert (objective.target_key, objective.ignore_index) == ("targets", -1)
    sample = ns["dataset"][0]  # sample 0's targets end in 4 padding -1s
    assert int(objective.count(sample["targets"])) == 12


def test_pairs_go_in_only_where_forward_takes_exactly_two():
    ns = Job.of(nanogpt_cell("tuple")).namespace()
    objective = Objective.build(ns["model"], None, ns["dataset"][0])
    args, kwargs, target = objective.split(next(iter(torch.utils.data.DataLoader(ns["dataset"]))))
    assert len(args) == 2 and kwargs == {} and args[1] is target
    with pytest.raises(sagenb.JobError) as caught:
        Objective.build(nn.Linear(4, 1), None, (torch.randn(4), torch.randn(1)))
    assert str(caught.value) == (
        "the cell defines no loss_fn, and its samples are tuples: define loss_fn(output, "
        "target); or give dict samples with 'labels' to use the model's own loss. (input, "
        "target) pairs go in as model(input, target) only when forward takes exactly those two "
        "parameters (Linear.forward takes (input))"
    )


def test_a_batch_without_readable_targets_is_refused_naming_what_was_found():
    with pytest.raises(sagenb.JobError) as caught:
        Objective.build(TwoArgs(), None, {"idx": torch.zeros(4), "y": torch.ones(4)})
    assert str(caught.value) == (
        "the cell defines no loss_fn, and its dict samples carry no targets its model takes: "
        "sagenb looks for 'labels', else for the one key forward takes as an option, and of "
        "their keys (idx, y) none is an optional parameter of TwoArgs.forward(idx, "
        "targets=None, mask=None) but its first. Add labels, or define a collate_fn(samples) "
        "whose batches have them, or define loss_fn(logits, labels)"
    )


def test_an_output_without_a_loss_is_named_with_what_it_holds():
    objective = Objective.build(TwoArgs(), None, {"idx": torch.zeros(4), "targets": 1})
    with pytest.raises(sagenb.JobError) as caught:
        objective.loss((torch.randn(2, 3), None), None)
    assert str(caught.value) == (
        "the cell defines no loss_fn, and the model's output (a tuple of Tensor, NoneType), "
        "given the targets as 'targets', carries no loss: sagenb reads its 'loss' (a "
        "ModelOutput or dict) or a tuple's one scalar tensor. Define loss_fn(logits, labels), "
        "or return the loss so when forward is given targets"
    )


@pytest.mark.parametrize(
    "options",
    [dict(strategy="data"), dict(strategy="model", partitions=2, microbatches=2)],
    ids=["data", "model"],
)
def test_a_nanogpt_on_pairs_trains_with_its_own_loss_as_one_process(pool, options):
    """(x, y) samples go in as model(x, y). Dict samples, in every strategy, are
    tests/test_cell_module.py's (the same GPT on its own loss)."""
    cell = nanogpt_cell("tuple")
    result = sagenb.train(cell, dashboard=False, **OPTIONS, **options)
    check_equal(result, cell, tol=TOL, **OPTIONS)
    assert result.warnings == []
