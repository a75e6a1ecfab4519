"""Huge datasets (sagenb issue 19): a map-style dataset of 10**9 samples trains its first steps
in seconds, in the contract's order for large datasets (a Feistel permutation computed per
position, engine/data.py), on the pool and under an exported torchrun script alike, equal to
the single-process reference; an IterableDataset is refused with the reason and what to do."""

from __future__ import annotations

import time

import pytest
import torch

import sagenb
from sagenb.engine.data import EAGER_MAX, FeistelOrder, epoch_order, plan_steps

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


STREAM_CELL = """
import torch
from torch import nn

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for _ in range(64):
            x = torch.randn(4)
            yield x, x.sum(0, keepdim=True)
    def __len__(self):  # even with a length, there is no sample i to ask for
        return 64

model = nn.Linear(4, 1)
dataset = Stream()
loss_fn = nn.functional.mse_loss
"""


def test_an_iterable_dataset_is_refused_with_the_alternative(pool):
    with pytest.raises(sagenb.JobError, match=r"dataset .* it is an IterableDataset, .*wrap it"):
        sagenb.train(STREAM_CELL, batch_size=8, steps=1, dashboard=False)
    generator = STREAM_CELL.replace("dataset = Stream()", "dataset = iter(Stream())")
    with pytest.raises(sagenb.JobError, match=r"it is a generator, .*map-style Dataset"):
        sagenb.train(generator, batch_size=8, steps=1, dashboard=False)


class _Whole:
    """Where a strategy would take this engine's share of a piece: all of it (one engine)."""

    def local_indices(self, piece: torch.Tensor) -> torch.Tensor:
        return piece


def test_worker_loading_walks_a_whole_huge_epoch_lazily():
    """--data-workers without --steps: the loader hands out a billion-sample epoch's steps as
    they are loaded, never listing the epoch's indices first."""
    from sagenb.engine.loader import batches_of

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
