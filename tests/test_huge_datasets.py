"""Huge datasets (sagenb issue 19): a map-style dataset of 10**9 samples trains its first steps
in seconds, in the contract's order for large datasets (a Feistel permutation computed per
position, engine/data/order.py), on the pool and under an exported torchrun script alike, equal to
the single-process reference (streams, read in order, are tests/test_streams.py's). A huge eval
set is evaluated the same way (issue 28): in order, from the first batch on, with no index list
of the whole set, and in the batches evaluation took before."""

from __future__ import annotations

import itertools
import re
import time

import pytest
import torch

import sagenb
from sagenb.engine.data.order import EAGER_MAX, FeistelOrder, epoch_order, eval_batches, plan_steps
from sagenb.engine.objective import Objective
from sagenb.engine.strategies.data_parallel import eval_sums

from .helpers import TORCHRUN, assert_params_equal, run
from .lab import free_port
from .reference import feistel_index, train_reference

#: a behaviour bound, not a speed target: randperm(10**9) took 165 s and 8 GB per engine
SECONDS = 60
RSS_MIB = 2048

HUGE_CELL = """
import torch
from torch import nn

class Lazy(torch.utils.data.Dataset):
    # 10**9 samples, none stored: sample i is built from i when asked for
    def __len__(self):
        return 10**9
    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)

model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
dataset = Lazy()
loss_fn = nn.functional.mse_loss
"""
OPTIONS = dict(batch_size=8, steps=3, lr=0.01)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 1000, 4099])
def test_lazy_order_is_a_permutation(n):
    for seed in (0, 1, -5, 2**40):
        order = FeistelOrder(n, seed)[:]
        assert sorted(order.tolist()) == list(range(n))
        assert torch.equal(order, FeistelOrder(n, seed)[:])  # deterministic
        assert torch.equal(order[n // 3 : n // 2], FeistelOrder(n, seed)[n // 3 : n // 2])


def test_lazy_order_differs_by_epoch_and_shuffles():
    n = 100_000
    first, second = FeistelOrder(n, 0)[:], FeistelOrder(n, 1)[:]
    assert (first == second).float().mean() < 0.01
    assert (first == torch.arange(n)).float().mean() < 0.01
    correlation = torch.corrcoef(torch.stack([first.double(), torch.arange(n).double()]))[0, 1]
    assert abs(correlation) < 0.02


def test_large_datasets_switch_to_the_lazy_order_and_small_ones_keep_randperm():
    small = epoch_order(10, seed=4, epoch=1)
    assert torch.equal(small, torch.randperm(10, generator=torch.Generator().manual_seed(5)))
    assert isinstance(epoch_order(EAGER_MAX + 1, seed=4, epoch=1), FeistelOrder)
    started = time.perf_counter()
    steps = list(plan_steps(10**9, batch_size=64, epochs=2, steps=3, seed=4))
    assert time.perf_counter() - started < 5  # was randperm(10**9): 8 GB, a minute or more
    assert [s.indices.tolist() for s in steps] == [lazy_batch(b, seed=4) for b in range(3)]
    # resuming after step 10**7 computes that step's indices only
    late = 10**7
    (step,) = plan_steps(10**9, batch_size=64, epochs=2, steps=late + 1, seed=4, start_after=late)
    assert (step.number, step.epoch) == (late + 1, 0)
    assert step.indices.tolist() == lazy_batch(late, seed=4)


def lazy_batch(b: int, *, seed: int, size: int = 64) -> list[int]:
    """Global batch b of 10**9 samples' first epoch, by the reference's own permutation."""
    return [feistel_index(i, 10**9, seed) for i in range(size * b, size * (b + 1))]


def check_reference(state: dict) -> None:
    model, _, _ = train_reference(HUGE_CELL, **OPTIONS)
    assert_params_equal(state, model)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_billion_samples_train_their_steps_in_seconds(pool, workers):
    started = time.perf_counter()
    result = sagenb.train(HUGE_CELL, data_workers=workers, dashboard=False, **OPTIONS)
    assert time.perf_counter() - started < SECONDS
    assert len(result.history) == 3
    # each engine's resident memory after step 1 (randperm(10**9) alone is 7629 MiB)
    rss = [m.values["memory/rss(MiB)"] for m in result.metrics if m.step == 1]
    assert len(rss) == 2 and max(rss) < RSS_MIB
    check_reference(result.state_dict())


def test_exported_script_keeps_the_large_order(pool, tmp_path):
    options = dict(OPTIONS, threads=1, dashboard=False)
    sagenb.export(HUGE_CELL, tmp_path / "train.py", **options)
    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port())]
    run([*command, "train.py"], cwd=tmp_path)
    check_reference(torch.load(tmp_path / "train_state.pt", weights_only=True))


class _Whole:
    """Where a strategy would take this engine's share of a piece: all of it (one engine)."""

    def local_indices(self, piece: torch.Tensor) -> torch.Tensor:
        return piece


def test_worker_loading_walks_a_whole_huge_epoch_lazily():
    """--data-workers without --steps: the loader hands out a billion-sample epoch's steps as
    they are loaded, never listing the epoch's indices first."""
    from sagenb.engine.data.loader import batches_of

    data = torch.utils.data.TensorDataset(torch.arange(64).float())

    class Huge(torch.utils.data.Dataset):
        def __len__(self):
            return 10**9

        def __getitem__(self, i):
            return data[i % 64]

    plan = plan_steps(10**9, batch_size=8, epochs=1, steps=None, seed=0)
    started = time.perf_counter()
    with batches_of(
        Huge(), _Whole(), plan, grad_accum=2, workers=1, device=torch.device("cpu")
    ) as steps:
        first = [next(steps) for _ in range(3)]
    assert [s.step.number for s in first] == [1, 2, 3] and len(first[0].batches) == 2
    assert time.perf_counter() - started < 60


# -- evaluation (issue 28, item 4) -----------------------------------------------------------------


def old_eval_batches(n: int, size: int, parts: int, part: int) -> list[torch.Tensor]:
    """How evaluation cut its batches before: from the whole eval set's arange."""
    mine = torch.tensor_split(torch.arange(n), parts)[part]
    return [mine[start : start + size] for start in range(0, len(mine), size)]


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 3, 8, 64])
def test_eval_batches_are_the_batches_evaluation_took_before(n, parts, size):
    for part in range(parts):
        new = list(eval_batches(n, size, parts=parts, part=part))
        old = old_eval_batches(n, size, parts, part)
        assert len(new) == len(old)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(new, old))


class Asked(torch.utils.data.Dataset):
    """An eval set of 2**40 samples that records the indices it is asked for, and ends the
    evaluation after `limit` of them (evaluating 2**40 samples is unbounded)."""

    class Enough(Exception):
        pass

    def __init__(self, limit: int) -> None:
        self.limit, self.asked = limit, []

    def __len__(self) -> int:
        return 2**40

    def __getitem__(self, i: int):
        if len(self.asked) == self.limit:
            raise Asked.Enough
        self.asked.append(i)
        x = torch.full((4,), float(i % 7))
        return x, x.sum(0, keepdim=True)


def test_a_huge_eval_set_costs_one_batch_of_indices():
    """The 2**40-sample eval set is cut lazily: its first batches arrive at once, from each
    part's first sample on, and eval_sums asks for them in order."""
    started = time.perf_counter()
    batches = list(itertools.islice(eval_batches(2**40, 8, parts=2, part=1), 3))
    assert [b.tolist() for b in batches] == [
        list(range(2**39 + 8 * k, 2**39 + 8 * k + 8)) for k in range(3)
    ]
    dataset = Asked(limit=20)
    model = torch.nn.Linear(4, 1)
    objective = Objective.build(
        model, torch.nn.functional.mse_loss, (torch.zeros(4), torch.zeros(1))
    )
    with pytest.raises(Asked.Enough):
        eval_sums(model, dataset, objective, eval_batches(2**40, 8), torch.device("cpu"))
    assert dataset.asked == list(range(20))
    assert time.perf_counter() - started < 5  # arange(2**40) alone would need 8 TiB


def test_the_eval_loss_is_the_same_sum_as_before():
    """Bit for bit: the same batches in the same order, over a normal eval set."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(203, 4, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x @ torch.randn(4, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    objective = Objective.build(model, torch.nn.functional.mse_loss, dataset[0])
    cpu = torch.device("cpu")
    for parts in (1, 2, 3):
        for part in range(parts):
            new = eval_batches(len(dataset), 32, parts=parts, part=part)
            old = old_eval_batches(len(dataset), 32, parts, part)
            assert torch.equal(
                eval_sums(model, dataset, objective, new, cpu),
                eval_sums(model, dataset, objective, old, cpu),
            )


#: a huge eval set: evaluating all of it is unbounded, so the cell's eval set ends the run at
#: the 17th sample it is asked for, saying which samples came before and whether in order
HUGE_EVAL = """
class HugeEval(torch.utils.data.Dataset):
    def __init__(self):
        self.asked = []
    def __len__(self):
        return 2**40
    def __getitem__(self, i):
        if len(self.asked) == 16:
            first, last = self.asked[0], self.asked[-1]
            in_order = self.asked == list(range(first, first + 16))
            raise LookupError(f"eval asked for {i} after {first}..{last}, in order: {in_order}")
        self.asked.append(i)
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)

eval_dataset = HugeEval()
"""
STRATEGIES = {
    "data": dict(strategy="data"),
    "sharded": dict(strategy="sharded"),
    "model": dict(strategy="model", partitions=2, microbatches=2),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_huge_eval_set_is_evaluated_in_order_lazily(pool, strategy):
    """Evaluation starts at once, in order from the rank's first sample, holding one batch's
    indices: it built arange(len(eval_dataset)) first, 8 TiB here, and failed as out of
    memory (or, for a mere 10**9 samples, spent 8 GB per engine before the first sample)."""
    started = time.perf_counter()
    with pytest.raises(sagenb.TrainingError, match="eval asked for") as failed:
        sagenb.train(HUGE_CELL + HUGE_EVAL, dashboard=False, **OPTIONS, **STRATEGIES[strategy])
    assert time.perf_counter() - started < SECONDS
    asked, first, last, in_order = re.search(
        r"eval asked for (\d+) after (\d+)\.\.(\d+), in order: (\w+)", str(failed.value)
    ).groups()
    # data parallel splits the eval set between its 2 engines; sharded and the pipeline's
    # single replica evaluate all of it
    starts = {0, 2**39} if strategy == "data" else {0}
    assert int(first) in starts and in_order == "True"
    assert (int(last), int(asked)) == (int(first) + 15, int(first) + 16)
