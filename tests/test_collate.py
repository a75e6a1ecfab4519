"""A `collate_fn` in the cell: samples of unequal lengths, padded and labelled by a collator.

The engines collate each piece they cut (an engine's share of a grad-accum slice, a pipeline
microbatch) on its own, so pieces are padded to different lengths; one process (tests/
reference.py) collates the whole global batch at once. With padding masked (attention_mask,
labels of -100) both train the same model: that is what these tests check, against a reference
that trains in one forward per global batch (no accumulation). Samples are `input_ids` alone: the
collator builds the labels, which the model's own loss (a transformers Llama) needs.
"""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb import TrainConfig
from sagenb.config.job import Job
from sagenb.engine.data import collation, loader
from sagenb.engine.data.order import plan_steps
from sagenb.engine.model.equivalence import equivalence_warnings
from sagenb.engine.workspace import build_workspace

from .helpers import TOL, check_equal
from .reference import batch, contract_order, namespace

# A tiny Llama (random initialisation, nothing downloaded) and samples of 3 to 12 token ids,
# unpadded; {collator} defines collate_fn
CELL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                     use_cache=False)
model = LlamaForCausalLM(config)
PAD = 0

class Texts(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        # 3 to 12 tokens, mostly short: pieces of a few samples pad to different lengths
        lengths = (3 + 10 * torch.rand(n, generator=g) ** 3).long().tolist()
        self.ids = [torch.randint(1, 64, (k,), generator=g) for k in lengths]
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {{"input_ids": self.ids[i]}}

dataset = Texts(96, 3)
eval_dataset = Texts(20, 4)
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
{collator}
"""

# A collator as users write one: right padding to the batch's longest sample (or to `FIXED`),
# masked out of attention and out of the labels
OWN = """
FIXED = {fixed}
def collate_fn(samples):
    longest = FIXED or max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
        mask[row, : len(s["input_ids"])] = 1
    return {{"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}}
"""

# transformers' collator with a tokenizer built here: a word-level vocabulary, nothing downloaded
HF = """
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

vocab = {{"<pad>": PAD, **{{f"t{{i}}": i for i in range(1, 64)}}}}
tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="<pad>"
)
collate_fn = transformers.DataCollatorForLanguageModeling(
    tokenizer, mlm=False, pad_to_multiple_of={fixed}
)
"""


def cell(collator: str, fixed: int | None = None) -> str:
    return CELL.format(collator=(OWN if collator == "own" else HF).format(fixed=fixed))


# -- on the engines ------------------------------------------------------------------------------


def piece_lengths(ns: dict, *, steps: int, batch_size: int, grad_accum: int, shares: int):
    """[step][piece] -> (samples, padded length) of each piece the engines collate: each
    engine's share (`shares` per slice) of each grad-accum slice, computed from the contract's
    order and the cell's data, not from sagenb's engine code."""
    dataset, order = ns["dataset"], contract_order(len(ns["dataset"]), 0)
    found = []
    for b in range(steps):
        pieces = []
        for piece in order(b * batch_size, (b + 1) * batch_size).chunk(grad_accum):
            for share in piece.chunk(shares):
                pieces.append((len(share), max(len(dataset[i]["input_ids"]) for i in share)))
        found.append(pieces)
    return found


@pytest.mark.parametrize(
    "strategy, collator, workers",
    [("data", "transformers", 1), ("sharded", "own", 0), ("tensor", "own", 0)],
)
def test_variable_lengths_equal_one_process(pool, strategy, collator, workers):
    """Pieces padded to their own longest sample train as one process padding the whole
    global batch to its longest; --data-workers collates in the workers."""
    source = cell(collator)
    options = dict(steps=5, batch_size=16)
    result = sagenb.train(
        source, strategy=strategy, grad_accum=2, data_workers=workers, dashboard=False, **options
    )
    model, ns = check_equal(result, source, **options)
    shares = 1 if strategy == "tensor" else 2  # a tensor group's engines load the same samples
    lengths = piece_lengths(ns, steps=5, batch_size=16, grad_accum=2, shares=shares)
    assert all(len({k for _, k in step}) > 1 for step in lengths)  # a step's pieces differ
    # each engine collated its own pieces: the token ids it fed are theirs, padded
    for m in result.metrics:
        mine = lengths[m.step - 1][m.rank % shares :: shares]
        assert m.values["tokens"] == sum(n * k for n, k in mine), (m.step, m.rank)
    if strategy == "data":  # evaluated in batches of their own padding, as in one forward
        expected = one_process_eval(ns, model)
        assert result.history[-1]["eval_loss"] == pytest.approx(expected, abs=TOL)


def one_process_eval(ns: dict, model) -> float:
    """The model's own loss over the whole eval set, collated at once, in one forward."""
    data = batch(ns["eval_dataset"], torch.arange(len(ns["eval_dataset"])), ns["collate_fn"])
    model.eval()
    with torch.no_grad():
        return float(model(**data).loss)


def test_pipeline_with_fixed_length_equals_one_process(pool):
    """Padded to one length (12, the longest sample), microbatches fit the traced stages."""
    source = cell("transformers", fixed=12)
    options = dict(steps=4, batch_size=16)
    result = sagenb.train(
        source,
        strategy="model",
        partitions=2,
        microbatches=2,
        grad_accum=2,
        dashboard=False,
        **options,
    )
    model, ns = check_equal(result, source, **options)
    assert {m.values["tokens"] for m in result.metrics} == {16 * 12}
    assert result.history[-1]["eval_loss"] == pytest.approx(one_process_eval(ns, model), abs=TOL)


def test_pipeline_with_variable_lengths_is_refused_before_the_first_step(pool):
    with pytest.raises(sagenb.JobError) as caught:
        sagenb.train(
            cell("own"),
            strategy="model",
            partitions=2,
            microbatches=2,
            batch_size=16,
            steps=2,
            dashboard=False,
        )
    text = str(caught.value)
    assert "--strategy model: dataset[0], collated alone, has input_ids of shape" in text
    assert "pad every batch to one fixed length in collate_fn" in text
    assert "max_length" in text


# -- before any engine: the workspace's checks, collation, the loader ----------------------------


def workspace(source: str):
    return build_workspace(Job.of(source), 0)


def test_labels_a_collator_builds_are_accepted():
    ws = workspace(cell("transformers"))
    assert ws.objective.dict_samples and ws.objective.shifted  # the Llama's own, shifted loss
    assert ws.objective.collate_fn is ws.collate_fn
    assert not ws.collate_draws  # mlm=False: nothing drawn, nothing to warn


def test_a_collator_that_builds_no_labels_is_refused_without_loss_fn():
    source = CELL.format(collator=HF.format(fixed=None)) + (
        "collate_fn = transformers.DataCollatorWithPadding(tokenizer)\n"
    )
    with pytest.raises(sagenb.JobError) as caught:
        workspace(source)
    assert str(caught.value) == (
        "the cell defines no loss_fn, and the batches its collate_fn returns carry no targets "
        "its model takes: sagenb looks for 'labels', else for the one key forward takes as an "
        "option, and of their keys (input_ids, attention_mask) none is 'labels', which "
        "LlamaForCausalLM.forward(input_ids=None, attention_mask=None, position_ids=None, "
        "cache=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, ...) "
        "takes. Make collate_fn add labels (transformers' DataCollatorForLanguageModeling("
        "tokenizer, mlm=False) copies input_ids, padding as -100), or define "
        "loss_fn(logits, labels)"
    )


def test_samples_without_labels_and_no_collator_name_the_collator():
    with pytest.raises(sagenb.JobError, match="define a collate_fn\\(samples\\) whose batches"):
        workspace(CELL.format(collator=""))


def test_a_failing_or_uncallable_collator_is_named():
    with pytest.raises(sagenb.JobError, match=r"collate_fn failed on \[dataset\[i\] for i in "):
        workspace(CELL.format(collator="def collate_fn(samples):\n    return torch.stack(samples)"))
    with pytest.raises(sagenb.JobError, match="collate_fn must be callable, got int"):
        workspace(CELL.format(collator="collate_fn = 3"))


def test_checking_the_collator_leaves_the_random_stream_alone_and_says_it_draws():
    """The collations made before the first step draw nothing from the training's stream;
    a collator that draws is said not to train bit-for-bit as one process."""
    source = cell("own") + (
        "\ndef collate_fn(samples, pad=collate_fn):\n    torch.rand(1)\n    return pad(samples)\n"
    )
    namespace(source, 0)
    after_cell = torch.get_rng_state()
    ws = workspace(source)
    assert torch.equal(torch.get_rng_state(), after_cell)
    assert ws.collate_draws
    two = TrainConfig(batch_size=16, engines=2)
    warned = equivalence_warnings(ws.model, two, collate_draws=ws.collate_draws)
    assert warned == [
        "collate_fn draws random numbers (masked-LM masking, random crops): each engine draws "
        "for its own pieces of the global batch (with --data-workers, from each worker's "
        "generator), so the batches differ from those one process would draw for the whole "
        "global batch: this run trains correctly but not bit-for-bit like one process; for an "
        "exact comparison draw nothing in collate_fn (e.g. mlm=False, or masks fixed in the "
        "dataset)"
    ]
    # one engine collating the whole global batch itself draws as one process does
    one = TrainConfig(batch_size=16, engines=1)
    assert equivalence_warnings(ws.model, one, collate_draws=ws.collate_draws) == []


def test_microbatches_collated_one_by_one_are_the_rows_of_a_fixed_length_batch():
    ns = namespace(cell("own", fixed=12), 0)
    indices = torch.tensor([5, 9, 1, 30])
    whole = collation.collate(ns["dataset"], indices, ns["collate_fn"])
    parts = collation.collate(ns["dataset"], indices, ns["collate_fn"], parts=2)
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_microbatches_of_unequal_lengths_are_refused_naming_the_fix():
    ns = namespace(cell("own"), 0)
    lengths = [len(s["input_ids"]) for s in ns["dataset"]]
    short, long = lengths.index(min(lengths)), lengths.index(max(lengths))
    with pytest.raises(sagenb.JobError) as caught:
        collation.collate(ns["dataset"], torch.tensor([short, long]), ns["collate_fn"], parts=2)
    assert str(caught.value).startswith(
        f"collate_fn made the microbatches of one step with input_ids of different shapes "
        f"([-1, {min(lengths)}] and [-1, {max(lengths)}]): a pipeline runs every microbatch "
        "through stages fixed to one shape; pad every batch to one fixed length in collate_fn"
    )


def test_lengths_the_first_samples_hide_are_refused_at_the_step_that_shows_them():
    """The samples collated alone before the first step can all be of one length; the step
    whose batch is longer is refused, before its microbatches reach the stages."""
    collate_fn = namespace(cell("own"), 0)["collate_fn"]
    data = [{"input_ids": torch.arange(1, 4)}] * collation.PROBES + [{"input_ids": torch.arange(5)}]
    first = collation.shapes_of(collation.collate(data, torch.arange(2), collate_fn))
    collation.require_one_length(data, collate_fn, first, strategy="hybrid")
    later = collation.collate(data, torch.tensor([7, 8]), collate_fn)
    with pytest.raises(sagenb.JobError) as caught:
        collation.require_shapes(first, later, strategy="hybrid", what="this step's batch")
    assert str(caught.value).startswith(
        "--strategy hybrid: this step's batch has input_ids of shape [-1, 5], the first "
        "microbatch [-1, 3]: a pipeline's stages are traced and their messages sized for one "
        "shape; pad every batch to one fixed length in collate_fn"
    )


class _Whole:
    def local_indices(self, piece: torch.Tensor) -> torch.Tensor:
        return piece


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_collate_as_the_training_thread(monkeypatch, method):
    """--data-workers: the cell's collate_fn (a function of the cell, by value when spawned)
    collates in the workers exactly what the training thread would."""
    monkeypatch.setattr(loader, "START_METHOD", method)
    ns = Job(source=cell("own")).namespace()  # in a module of its own, as on an engine

    def run(workers: int):
        plan = plan_steps(96, batch_size=16, epochs=1, steps=3, seed=0)
        loading = loader.batches_of(
            ns["dataset"],
            _Whole(),
            plan,
            grad_accum=2,
            workers=workers,
            device=torch.device("cpu"),
            collate_fn=ns["collate_fn"],
        )
        with loading as steps:
            return [b for d in steps for b in d.batches]

    inline, loaded = run(0), run(1)
    assert len(inline) == len(loaded) == 6
    for a, b in zip(loaded, inline):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
