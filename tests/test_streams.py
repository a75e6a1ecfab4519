"""Streams: a torch IterableDataset and a Hugging Face streaming dataset read from local JSON
Lines files, in every strategy, against one process reading the stream in order
(tests/reference.py's global_batches): global batch k of an epoch holds items k*B to (k+1)*B - 1,
an incomplete last batch is dropped, --epochs reads the stream again, --steps bounds an endless
one, --resume continues mid-stream."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import sagenb
from sagenb.config.job import JobError
from sagenb.engine.data import agreement
from sagenb.engine.data.stream import ReadOnce, StreamSource, as_source, stream_steps

from .helpers import TOL, check_equal
from .reference import of_samples

# 70 (x, y) items in order, a class target each; an nn.Sequential that every strategy splits.
# `Stream` restarts at each iter(); `endless` never ends
TORCH_CELL = """
import torch
from torch import nn

class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n, seed, endless=False):
        g = torch.Generator().manual_seed(seed)
        self.x, self.endless = torch.randn(n, 8, generator=g), endless
        self.y = (self.x.sum(1) > 0).long()
    def __iter__(self):
        while True:
            yield from zip(self.x, self.y)
            if not self.endless:
                return

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
dataset = Stream(70, 1, endless={endless})
eval_dataset = Stream(20, 2)
loss_fn = nn.functional.cross_entropy
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
"""

# instruction-style records in {shards} JSON Lines files, streamed by datasets (nothing
# downloaded), tokenised on the fly by a word-level map, padded by the cell's collate_fn: to each
# batch's longest sample, or to FIXED tokens for a pipeline (its stages are traced for one shape)
HF_CELL = """
import torch
import datasets
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
model = LlamaForCausalLM(config)  # as it comes: use_cache=True, which training turns off
files = {files!r}
def tokenize(record):
    words = (record["prompt"] + " " + record["answer"]).split()
    return {{"input_ids": [int(w[1:]) for w in words]}}
dataset = (datasets.load_dataset("json", data_files=files, split="train", streaming={streaming},
                                 cache_dir={cache!r})
           .map(tokenize, remove_columns=["prompt", "answer"]))
FIXED = {fixed}
def collate_fn(samples):
    longest = FIXED or max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = torch.as_tensor(s["input_ids"])
        mask[row, : len(s["input_ids"])] = 1
    return {{"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}}
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
"""


def torch_cell(*, endless: bool = False) -> str:
    return TORCH_CELL.format(endless=endless)


def write_shards(folder, shards: int, records: int = 60) -> list[str]:
    """`records` prompt/answer records of 2 to 11 tokens, dealt into `shards` files of unequal
    sizes (the first files get one more)."""
    g = torch.Generator().manual_seed(5)
    files = [folder / f"part-{i}.jsonl" for i in range(shards)]
    lines: list[list[str]] = [[] for _ in files]
    for r in range(records):
        words = [
            f"t{int(t)}"
            for t in torch.randint(
                1, 64, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g
            )
        ]
        cut = max(1, len(words) // 2)
        record = {"prompt": " ".join(words[:cut]), "answer": " ".join(words[cut:])}
        lines[r * shards // records].append(json.dumps(record))
    for path, chunk in zip(files, lines):
        path.write_text("\n".join(chunk) + "\n")
    return [str(f) for f in files]


# -- on the engines ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("data", {"data_workers": 1, "eval_every": 2}),
        ("sharded", {"grad_accum": 2}),
        ("tensor", {}),
        ("model", {"partitions": 2, "microbatches": 2}),
    ],
)
def test_a_torch_stream_trains_as_one_process(pool, strategy, extra):
    """Two epochs over a 70-item stream in batches of 16: 4 steps each (6 items dropped at
    each end), the second reading the stream again. The data run collates in a worker process
    and evaluates a stream as eval_dataset."""
    cell = torch_cell()
    options = dict(batch_size=16, epochs=2)
    result = sagenb.train(cell, strategy=strategy, dashboard=False, **options, **extra)
    assert [row["step"] for row in result.history] == list(range(1, 9))
    assert [row["epoch"] for row in result.history] == [0] * 4 + [1] * 4
    assert result.status == "done"
    accum = {"grad_accum": extra["grad_accum"]} if "grad_accum" in extra else {}
    model, ns = check_equal(result, cell, **options, **accum)
    if "eval_every" in extra:
        data = of_samples(list(ns["eval_dataset"]))
        with torch.no_grad():
            expected = float(ns["loss_fn"](model(data[0]), data[1]))
        assert result.history[-1]["eval_loss"] == pytest.approx(expected, abs=TOL)


def test_an_endless_stream_stops_at_steps_and_resumes_mid_stream(pool, tmp_path):
    """--steps bounds a stream that never ends; a run stopped at step 3 and resumed to step 7
    continues with item 3 * 16, as the uninterrupted run (and one process) does."""
    cell = torch_cell(endless=True)
    options = dict(batch_size=16, strategy="data", dashboard=False)
    whole = sagenb.train(cell, steps=7, **options)
    assert [row["step"] for row in whole.history] == list(range(1, 8))
    check_equal(whole, cell, batch_size=16, steps=7)
    sagenb.train(cell, steps=3, checkpoint_dir=str(tmp_path), **options)
    resumed = sagenb.train(cell, steps=7, checkpoint_dir=str(tmp_path), resume=True, **options)
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]
    torch.testing.assert_close(resumed.losses, whole.losses[3:], rtol=0, atol=0)
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "map-style"])
@pytest.mark.parametrize(
    "strategy, shards, fixed",
    [("data", 3, None), ("sharded", 5, None), ("tensor", 3, None), ("model", 5, 12)],
)
def test_a_hugging_face_dataset_trains_as_one_process(
    pool, tmp_path, strategy, shards, fixed, streaming
):
    """datasets' JSON reader over 3 or 5 files, streamed or loaded map-style: 60 records in
    batches of 8 make 7 steps on every engine (4 dropped). Streamed, whatever the files divide
    by 2 engines, none hangs and no sample is seen twice (the losses and parameters are one
    process's, reading the stream in order)."""
    files = write_shards(tmp_path, shards)
    # map-style: datasets' Arrow cache in the test's folder
    cell = HF_CELL.format(files=files, fixed=fixed, streaming=streaming, cache=str(tmp_path))
    extra = {"partitions": 2, "microbatches": 2} if strategy == "model" else {}
    result = sagenb.train(cell, strategy=strategy, batch_size=8, dashboard=False, **extra)
    assert [row["step"] for row in result.history] == list(range(1, 8))
    assert result.status == "done"
    check_equal(result, cell, batch_size=8)


def test_hybrid_reads_a_stream_as_one_process(pool4):
    """Two pipeline replicas of 2 stages on 4 engines, each replica its half of each batch."""
    cell = torch_cell()
    options = dict(batch_size=16, epochs=1)
    result = sagenb.train(
        cell, strategy="hybrid", partitions=2, microbatches=2, dashboard=False, **options
    )
    assert len(result.history) == 4
    check_equal(result, cell, **options)


def test_a_generator_read_twice_is_refused_naming_the_fix(pool):
    cell = torch_cell().replace(
        "dataset = Stream(70, 1, endless=False)", "dataset = iter(Stream(70, 1))"
    )
    with pytest.raises(Exception, match="a generator object cannot start again"):
        sagenb.train(cell, batch_size=16, epochs=2, dashboard=False)


SHARDED_BY_RANK = """
import itertools
import torch.distributed as dist

class ByRank(Stream):
    def __iter__(self):  # every other item by rank, as many a cell shards its stream
        rank, world = dist.get_rank(), dist.get_world_size()
        yield from itertools.islice(super().__iter__(), rank, None, world)

dataset = ByRank(70, 1)
"""


@pytest.mark.parametrize(
    "strategy, extra",
    [("data", {}), ("data", {"data_workers": 1}), ("model", {"partitions": 2, "microbatches": 2})],
    ids=["data", "data-workers", "pipeline"],
)
def test_a_stream_that_shards_itself_by_rank_is_refused_naming_the_fix(pool, strategy, extra):
    """Each rank yielding every other item read 35 items and trained 2 steps of 16 instead of 4,
    on global batches no process reads, without a word: the first global batch's fingerprints
    differ across the ranks, so the run stops before its first step, naming the fix. With
    --data-workers the stream is read in the training process too, so the same check serves."""
    cell = torch_cell() + SHARDED_BY_RANK
    with pytest.raises(JobError) as refused:
        sagenb.train(cell, strategy=strategy, batch_size=16, dashboard=False, **extra)
    assert re.search(
        r"dataset: the stream reads differently on rank 1 than on rank 0 \(the items of global "
        r"batch 1, 0 to 15 of the stream, differ\).*get_rank\(\).*: yield every item on every "
        r"rank; sagenb keeps each rank's share itself",
        str(refused.value),
    ), str(refused.value)


# -- without engines -----------------------------------------------------------------------------


class _Counting(torch.utils.data.IterableDataset):
    def __init__(self, n: int | None) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        i = 0
        while self.n is None or i < self.n:
            yield i
            i += 1


def test_the_plan_reads_batches_in_order_and_holds_only_a_window():
    stream = _Counting(10)
    source = as_source("dataset", stream)
    seen, held = [], 0
    for step in stream_steps(source, batch_size=4, epochs=2, steps=None):
        seen.append(
            (step.number, step.epoch, [source[i] for i in step.indices.tolist()], step.total)
        )
        held = max(held, len(source.items))
    assert seen == [
        (1, 0, [0, 1, 2, 3], None),
        (2, 0, [4, 5, 6, 7], None),
        (3, 1, [0, 1, 2, 3], None),
        (4, 1, [4, 5, 6, 7], 4),  # read one batch ahead: the last step knows it is the last
    ]
    assert stream.epochs == [0, 1]  # set_epoch before each pass, as a shuffle buffer needs
    assert held <= 3 * 4  # this step, the next, and an epoch's dropped remainder


def test_steps_bound_an_endless_stream_and_a_resume_skips_what_was_trained():
    source = as_source("dataset", _Counting(None))
    plan = stream_steps(source, batch_size=3, epochs=1, steps=5, start_after=2)
    seen = [(s.number, s.total, [source[i] for i in s.indices.tolist()]) for s in plan]
    assert seen == [(3, 5, [6, 7, 8]), (4, 5, [9, 10, 11]), (5, 5, [12, 13, 14])]
    with pytest.raises(IndexError, match="item 6 of the stream is no longer held"):
        source[6]  # released once its step was loaded


def test_what_is_neither_a_dataset_nor_a_stream_is_refused_by_name():
    assert isinstance(as_source("dataset", _Counting(3)), StreamSource)
    assert isinstance(as_source("eval_dataset", _Counting(3)), ReadOnce)
    with pytest.raises(
        JobError, match="dataset must be a map-style Dataset .* or a stream .* it is a builtins.int"
    ):
        as_source("dataset", 7)
    with pytest.raises(
        JobError, match=r"dataset yielded 2 items, fewer than one global batch \(--batch-size 4\)"
    ):
        list(stream_steps(as_source("dataset", _Counting(2)), batch_size=4, epochs=1, steps=None))


def test_the_estimate_reads_a_streams_first_items_and_takes_its_steps_from_steps():
    """%%smp_plan on a stream: its length is unknown, so the run's hours follow --steps."""
    unsized = sagenb.estimate(torch_cell(), instance="ml.p4d.24xlarge", engines=2, batch_size=16)
    assert "run: steps unknown (pass --steps" in unsized.table()
    sized = sagenb.estimate(
        torch_cell(), instance="ml.p4d.24xlarge", engines=2, batch_size=16, steps=10
    )
    assert "run: 10 steps" in sized.table()


class _Record:  # its default repr holds its address, which differs for equal records
    def __init__(self, text: str, ids: torch.Tensor) -> None:
        self.text, self.ids = text, ids


def test_a_fingerprint_reads_values_not_identities():
    """Equal items give equal digests in any process (no id, no repr address, no salted hash);
    a changed value, an item moved, or an element of a large tensor changes it."""
    big = torch.randn(3, 224, 224)
    items = [
        (torch.arange(8.0), torch.tensor(1)),
        {"input_ids": [1, 2, 3], "text": "a b", "extra": None},
        _Record("x", torch.ones(2, dtype=torch.bfloat16)),
        big,
        np.arange(6, dtype=np.int16),
    ]
    same = [
        (torch.arange(8.0), torch.tensor(1)),
        {"text": "a b", "extra": None, "input_ids": [1, 2, 3]},
        _Record("x", torch.ones(2, dtype=torch.bfloat16)),
        big.clone(),
        np.arange(6, dtype=np.int16),
    ]
    assert agreement.fingerprint(items) == agreement.fingerprint(same)
    other_big = big.clone()
    other_big[2, 223, 223] += 1  # the last element, which the even sample reads
    for changed in (
        [items[1], items[0], *items[2:]],
        [*items[:3], other_big, items[4]],
        [*items[:2], _Record("y", torch.ones(2, dtype=torch.bfloat16)), *items[3:]],
        [*items[:4], np.arange(6, dtype=np.int32)],
    ):
        assert agreement.fingerprint(changed) != agreement.fingerprint(items)
    assert agreement.differing_ranks([5, 5, 7, 5, 8]) == [2, 4]


def test_a_fingerprint_is_the_same_in_another_process():
    """PYTHONHASHSEED differs between processes: the digest must not use hash()."""
    code = (
        "import torch; from sagenb.engine.data import agreement; "
        "print(agreement.fingerprint([('ab', {'k': 1.5}), torch.arange(5)]))"
    )
    here = agreement.fingerprint([("ab", {"k": 1.5}), torch.arange(5)])
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert int(there.stdout) == here
