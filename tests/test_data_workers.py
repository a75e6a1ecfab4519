"""--data-workers: batches loaded by DataLoader worker processes train the same model as batches
loaded in the training thread, and as one process; the workers end with the run."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

import sagenb
from sagenb.config import ConfigError
from sagenb.config.job import Job
from sagenb.engine.data import loader
from sagenb.engine.data.order import plan_steps
from sagenb.pool import cluster

from .helpers import assert_params_equal, check_equal
from .models import llama_cell
from .reference import train_reference

TOL = 1e-5

# A map-style dataset of the cell's own (its class lives in the cell's namespace, which a
# spawned process could not import), with per-sample work in __getitem__: a deterministic
# "augmentation" (flip every other image, normalise each), and a file per loading process, so
# the test sees which processes loaded samples.
CELL = """
import os
import torch
from torch import nn
import torch.nn.functional as F

class Images(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        open(os.path.join(LOADERS, str(os.getpid())), "a").close()
        x = self.x[i].flip(-1) if i % 2 else self.x[i]
        return (x - x.mean()) / (x.std() + 1e-5), self.y[i]

model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
dataset = Images(160)
loss_fn = F.cross_entropy
"""


def cell_in(directory) -> str:
    return f"LOADERS = {str(directory)!r}\n" + CELL


def engine_children(pool: cluster.EnginePool) -> list[list[str]]:
    """Each engine's child processes but ipyparallel's own nanny (DataLoader workers left
    behind would be there)."""
    return [pool.client[e].apply_sync(_children) for e in pool.engine_ids]


def _children() -> list[str]:
    import psutil

    found = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    return [c for c in found if "ipyparallel.engine.nanny" not in c]


def engine_pids(pool: cluster.EnginePool) -> set[int]:
    return {pool.client[e].apply_sync(os.getpid) for e in pool.engine_ids}


def loader_pids(directory) -> set[int]:
    pids = {int(name) for name in os.listdir(directory)}
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    return pids


def test_workers_train_as_the_training_thread_and_one_process(pool, tmp_path):
    cell = cell_in(tmp_path)
    options = dict(batch_size=32, grad_accum=2, epochs=2, dashboard=False)
    engines = engine_pids(pool)
    without = sagenb.train(cell, data_workers=0, **options)
    assert loader_pids(tmp_path) <= engines  # loaded in the engines themselves
    with_workers = sagenb.train(cell, data_workers=2, **options)
    workers = loader_pids(tmp_path) - engines
    assert len(workers) == 4  # 2 per engine loaded the training samples
    assert engine_children(pool) == [[], []]  # and are gone
    assert not any(psutil.pid_exists(pid) for pid in workers)
    # the same batches in the same order: the same model, bit for bit
    assert with_workers.losses == without.losses
    state, state0 = with_workers.state_dict(), without.state_dict()
    assert all(torch.equal(state[k], state0[k]) for k in state0)
    model, losses, _ = train_reference(cell, batch_size=32, grad_accum=2, epochs=2)
    torch.testing.assert_close(with_workers.losses, losses, rtol=0, atol=TOL)
    assert_params_equal(state, model)
    assert len(losses) == 10 and all("data_wait(s)" in m.values for m in with_workers.metrics)


def test_dict_samples_with_workers(pool):
    cell = llama_cell(own_loss=True)
    result = sagenb.train(
        cell, batch_size=16, grad_accum=2, steps=4, data_workers=2, dashboard=False
    )
    check_equal(result, cell, steps=4, batch_size=16)
    assert engine_children(pool) == [[], []]


def test_resume_with_workers_starts_after_the_checkpoint(pool, tmp_path):
    cell = cell_in(tmp_path / "loaders")
    (tmp_path / "loaders").mkdir()
    options = dict(batch_size=32, grad_accum=2, epochs=2, data_workers=1, dashboard=False)
    sagenb.train(cell, steps=3, checkpoint_dir=str(tmp_path / "ckpt"), **options)
    resumed = sagenb.train(
        cell, steps=7, checkpoint_dir=str(tmp_path / "ckpt"), resume=True, **options
    )
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]
    model, losses, _ = train_reference(cell, batch_size=32, grad_accum=2, epochs=2, steps=7)
    torch.testing.assert_close(resumed.losses, losses[3:], rtol=0, atol=TOL)
    assert_params_equal(resumed.state_dict(), model)


def test_a_failing_worker_fails_the_run_and_leaves_no_process(pool, tmp_path):
    cell = cell_in(tmp_path) + (
        "\nclass Failing(Images):\n"
        "    def __getitem__(self, i):\n"
        "        if i == 7 and os.getpid() != ENGINE:\n"
        "            raise ValueError('sample 7 is broken')\n"
        "        return super().__getitem__(i)\n"
        "ENGINE = os.getpid()\n"
        "dataset = Failing(160)\n"
    )
    with pytest.raises(sagenb.TrainingError, match="sample 7 is broken"):
        sagenb.train(cell, batch_size=32, data_workers=2, dashboard=False)
    assert engine_children(cluster.current_pool()) == [[], []]


def test_a_negative_value_is_refused_before_any_engine_runs(tmp_path):
    before = cluster.current_pool()
    with pytest.raises(ConfigError, match="--data-workers -1: must be an integer >= 0") as err:
        sagenb.train(cell_in(tmp_path), data_workers=-1, dashboard=False)
    assert err.value.name == "data_workers"
    assert cluster.current_pool() is before  # no pool was started for it
    assert not os.listdir(tmp_path)  # and the cell ran nowhere
    with pytest.raises(ConfigError, match="--data-workers"):
        sagenb.TrainConfig(data_workers=1.5)


class _Strategy:
    """Two engines' data parallel split of each slice, seen from rank 1."""

    def local_indices(self, piece: torch.Tensor) -> torch.Tensor:
        return piece[len(piece) // 2 :]


CELL_DATASET = """
import os
import torch
class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "pid": torch.tensor(os.getpid())}
"""


def _cell_dataset():
    return Job(source=CELL_DATASET).namespace()["Pids"]()  # in a module, as on an engine


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_loader_yields_the_plan_in_order(monkeypatch, method):
    """batches_of with workers yields exactly the batches of the training thread, for a
    Dataset class defined in a cell, with either start method (spawn: the class by value)."""
    monkeypatch.setattr(loader, "START_METHOD", method)
    dataset = _cell_dataset()
    cpu = torch.device("cpu")

    def run(workers: int):
        plan = plan_steps(40, batch_size=8, epochs=2, steps=None, seed=3, start_after=2)
        with loader.batches_of(
            dataset, _Strategy(), plan, grad_accum=2, workers=workers, device=cpu
        ) as steps:
            return [(d.step.number, d.batches) for d in steps]

    before = {p.pid for p in psutil.Process().children()}  # the pool's, when it runs
    rng = torch.get_rng_state()
    inline, loaded = run(0), run(1 if method == "spawn" else 2)
    assert torch.equal(torch.get_rng_state(), rng)  # the training's RNG is left alone
    assert [n for n, _ in loaded] == [n for n, _ in inline] == list(range(3, 11))
    for (_, ours), (_, theirs) in zip(loaded, inline):
        assert len(ours) == len(theirs) == 2
        for a, b in zip(ours, theirs):
            assert torch.equal(a["x"], b["x"])
            assert set(b["pid"].tolist()) == {os.getpid()}
            assert os.getpid() not in a["pid"].tolist()
    # no worker left (spawn starts multiprocessing's resource tracker once, for good)
    left = [p.cmdline() for p in psutil.Process().children() if p.pid not in before]
    assert not [c for c in left if "resource_tracker" not in " ".join(c)]
