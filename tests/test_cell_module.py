"""The cell runs in a real module, as a kernel's `__main__` is (sagenb/config/cell_module.py):
`@dataclass` (default_factory, kw_only, slots), `enum`, `typing.get_type_hints` and pickling a
cell's classes work on the engines, in the estimate, in DataLoader workers and in the kernel's
rebuilt model; the module is fresh for every run and gone with it. A nanoGPT-style GPT (a
dataclass config, tied embeddings, `(logits, loss)` out) trains to one process in every
strategy. And a module beside the notebook that was edited between two runs is imported again
(sagenb/engine/edited_modules.py)."""

from __future__ import annotations

import os
import pickle
import sys
import uuid

import pytest
import torch

import sagenb
from sagenb.config import cell_module
from sagenb.config.job import Job
from sagenb.engine import edited_modules
from sagenb.engine.data import loader
from sagenb.engine.data.order import plan_steps
from sagenb.run.trained import CellModel

from .helpers import assert_params_equal, check_equal, run
from .models import nanogpt_cell
from .reference import train_reference

#: what people paste from nanoGPT-style files, in one cell (no `from __future__` here: the
#: test that the cell does not inherit sagenb's own checks what annotations it sees)
TYPES_CELL = """
import dataclasses, enum, typing
from dataclasses import dataclass, field

class Act(enum.Enum):
    GELU = "gelu"
    RELU = "relu"

@dataclass
class GPTConfig:
    block_size: int = 8
    vocab_size: int = 16
    n_layer: int = 1
    act: Act = Act.GELU
    tags: list = field(default_factory=list)

@dataclass(kw_only=True, slots=True)
class Extra:
    dropout: float = 0.0
    names: typing.ClassVar[tuple] = ("a",)

ANNOTATION = GPTConfig.__annotations__["block_size"]
HINTS = typing.get_type_hints(GPTConfig)
"""

#: nanoGPT's model.py as people paste it (tests/models.py): a dataclass config, tied
#: embeddings, forward(idx, targets=None) -> (logits, loss) trained on its own loss, a Dataset
#: class of the cell's own (DataLoader workers load it), SGD
GPT_CELL = nanogpt_cell("dict")


def cell_modules() -> set[str]:
    return {n for n in sys.modules if n.startswith(cell_module.PREFIX)}


# -- Job.namespace, without engines ---------------------------------------------------------------


def test_a_cell_s_dataclasses_enums_and_type_hints_work_as_in_a_kernel():
    before = cell_modules()
    with cell_module.scope():
        ns = Job(source=TYPES_CELL).namespace()
        name = ns["__name__"]
        assert sys.modules[name].__dict__ is ns
        assert ns["GPTConfig"]().tags == [] and ns["GPTConfig"]().tags is not ns["GPTConfig"]().tags
        assert ns["GPTConfig"].__module__ == name
        extra = ns["Extra"](dropout=0.5)
        assert not hasattr(extra, "__dict__") and extra.dropout == 0.5  # slots
        with pytest.raises(TypeError):
            ns["Extra"](0.5)  # kw_only
        assert ns["HINTS"]["act"] is ns["Act"]
        # the cell's own compile flags: sagenb's `from __future__ import annotations` not inherited
        assert ns["ANNOTATION"] is int
    assert cell_modules() == before  # gone with its scope


def test_a_cell_s_classes_pickle_and_each_run_has_a_module_of_its_own():
    with cell_module.scope():
        first = Job(source=TYPES_CELL).namespace()
        second = Job(source=TYPES_CELL).namespace()
        assert first["__name__"] != second["__name__"]
        config = first["GPTConfig"](tags=[1], act=first["Act"].RELU)
        back = pickle.loads(pickle.dumps(config))
        assert type(back) is first["GPTConfig"] and back == config
        assert pickle.loads(pickle.dumps(first["Act"].RELU)) is first["Act"].RELU
        names = first["__name__"], second["__name__"]
    assert not any(n in sys.modules for n in names)


def test_a_cell_that_raises_leaves_no_module_behind():
    """Outside any scope too (the kernel's rebuild): a cell that fails keeps no module."""
    before = cell_modules()
    with pytest.raises(ZeroDivisionError):
        Job(source="import sys\nassert sys.modules[__name__]\n1 / 0").namespace()
    assert cell_modules() == before


def test_the_kernel_s_rebuilt_model_pickles_with_its_dataclass_config():
    """run/trained.py: the model built again in the kernel keeps its module (as __main__ keeps
    a kernel's classes): torch.save of the whole model, and its config, work."""
    source = CellModel(Job.from_cell(GPT_CELL), seed=0)
    model = source.build()
    again = source.build()
    assert type(model).__module__ != type(again).__module__  # both pickle, each by its module
    for built in (model, again):
        copy = pickle.loads(pickle.dumps(built))
        assert type(copy) is type(built) and copy.config == built.config
        assert_params_equal(copy.state_dict(), built)


class _Half:
    def local_indices(self, piece: torch.Tensor) -> torch.Tensor:
        return piece[len(piece) // 2 :]


BATCH_CELL = """
from dataclasses import dataclass
import torch

@dataclass
class Batch:
    x: torch.Tensor

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.tensor([float(i * i)])

def collate_fn(samples):
    return Batch(torch.stack(samples))
"""


@pytest.mark.timeout(60)  # a batch a worker cannot pickle leaves the loader waiting
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_load_a_cell_s_classes(monkeypatch, method):
    """--data-workers: a forked worker inherits the cell's module; a spawned one gets the
    cell's classes by value and a stand-in module of the same name, so the batches it pickles
    back (a cell's dataclass) reach the engine as the engine's own class."""
    monkeypatch.setattr(loader, "START_METHOD", method)
    with cell_module.scope():
        ns = Job(source=BATCH_CELL).namespace()
        plan = plan_steps(16, batch_size=4, epochs=1, steps=None, seed=0, start_after=0)
        with loader.batches_of(
            ns["Squares"](),
            _Half(),
            plan,
            grad_accum=1,
            workers=1,
            device=torch.device("cpu"),
            collate_fn=ns["collate_fn"],
        ) as steps:
            batches = [b for d in steps for b in d.batches]
    assert len(batches) == 4 and all(type(b) is ns["Batch"] for b in batches)
    assert sorted(float(v) for b in batches for v in b.x.flatten()) == sorted(
        float(i * i)
        for s in plan_steps(16, batch_size=4, epochs=1, steps=None, seed=0)
        for i in s.indices[2:].tolist()
    )


def test_the_estimate_runs_a_cell_with_a_dataclass():
    """sizing/footprint.py builds the cell in the notebook's process: in a module, removed after."""
    before = cell_modules()
    est = sagenb.estimate(GPT_CELL, batch_size=8, steps=2)
    assert est.ranks and cell_modules() == before


# -- on the engines -------------------------------------------------------------------------------

#: each strategy's options, a few steps of the tiny GPT each (hybrid: two pipelines of two stages)
STRATEGIES = {
    "data": dict(strategy="data", data_workers=1),  # the cell's Dataset in a forked worker
    "sharded": dict(strategy="sharded"),
    "tensor": dict(strategy="tensor"),
    "model": dict(strategy="model", partitions=2, microbatches=2),
    "hybrid": dict(strategy="hybrid", partitions=2, microbatches=2),
}
STEPS = dict(batch_size=8, steps=3)


def trains_as_one_process(strategy: str, **extra) -> sagenb.TrainResult:
    result = sagenb.train(GPT_CELL, dashboard=False, **STRATEGIES[strategy], **STEPS, **extra)
    check_equal(result, GPT_CELL, **STEPS)
    return result


@pytest.mark.parametrize("strategy", ["data", "sharded", "tensor", "model"])
def test_a_nanogpt_style_cell_trains_as_one_process(pool, strategy, tmp_path):
    """The dataclass config, the tied GPT and the cell's Dataset class, on every rank: the same
    parameters as one process (SGD). Data parallel also writes a checkpoint of it and hands the
    model back to the kernel, where it pickles with its config."""
    extra = dict(checkpoint_dir=str(tmp_path), checkpoint_every=2) if strategy == "data" else {}
    result = trains_as_one_process(strategy, **extra)
    assert result.warnings == []
    if strategy == "data":
        assert any(tmp_path.iterdir())
        model = pickle.loads(pickle.dumps(result.model()))
        assert model.config.n_layer == 2 and type(model.config).__name__ == "GPTConfig"
        assert model.lm_head.weight is model.transformer.wte.weight
        assert_params_equal(model.state_dict(), result.state_dict(), tol=0)
    # the run's module stays on every engine with the state kept for --continue, and is gone
    # once that is released
    kept_modules = pool.client[pool.engine_ids].apply_sync(_cell_modules_here)
    assert [len(names) for names in kept_modules] == [1] * pool.size
    result.release()
    left = pool.client[pool.engine_ids].apply_sync(_cell_modules_here)
    assert left == [[]] * pool.size


def test_a_nanogpt_style_cell_trains_as_one_process_in_hybrid(pool4):
    trains_as_one_process("hybrid")


def _cell_modules_here() -> list[str]:
    import sys

    return [n for n in sys.modules if n.startswith("__smp_cell_")]


# -- a module beside the notebook, edited between two runs ----------------------------------------

BESIDE_CELL = """
import torch
from {user} import WIDTH
model = torch.nn.Linear(4, WIDTH)
dataset = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.zeros(16, 1))
def loss_fn(out, target):
    return out.pow(2).mean()
"""


def test_only_the_folder_s_edited_modules_leave_and_all_of_them(tmp_path, monkeypatch):
    """engine/edited_modules.py on its own: nothing leaves until a noted file changes; then
    every module of the folder does (the one that imported the edited one too), and a
    virtual environment inside the folder is left alone."""
    (tmp_path / "venv" / "site-packages").mkdir(parents=True)
    files = {
        "beside_a": tmp_path / "beside_a.py",
        "beside_b": tmp_path / "beside_b.py",
        "installed_c": tmp_path / "venv" / "site-packages" / "installed_c.py",
    }
    for path in files.values():
        path.write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "venv" / "site-packages"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in files:
        monkeypatch.setitem(sys.modules, name, None)  # so that it is gone after the test
        del sys.modules[name]
        __import__(name)
    assert set(edited_modules.folder_modules()) == {"beside_a", "beside_b"}
    edited_modules.note()
    assert edited_modules.drop_edited() == [] and "beside_a" in sys.modules
    files["beside_a"].write_text("X = 22\n")
    files["installed_c"].write_text("X = 22\n")
    assert edited_modules.drop_edited() == ["beside_a.py"]
    assert {"beside_a", "beside_b"}.isdisjoint(sys.modules) and "installed_c" in sys.modules


@pytest.fixture
def beside(pool):
    """Two modules in the engines' working directory (the notebook's folder): `<name>` holds
    WIDTH, `<name>_user` imports it from there; removed with their bytecode afterwards."""
    folder = pool.client[pool.engine_ids[0]].apply_sync(os.getcwd)
    name = f"smp_beside_{uuid.uuid4().hex[:8]}"
    files = [os.path.join(folder, f"{name}.py"), os.path.join(folder, f"{name}_user.py")]
    with open(files[1], "w") as f:
        f.write(f"from {name} import WIDTH  # the edited module's name, held here\n")
    yield name, files[0]
    for path in files:
        os.remove(path)
    cache = os.path.join(folder, "__pycache__")
    for entry in os.listdir(cache) if os.path.isdir(cache) else []:
        if entry.startswith(name):
            os.remove(os.path.join(cache, entry))


def test_a_module_beside_the_notebook_edited_between_runs_is_imported_again(beside, capsys):
    name, path = beside
    cell = BESIDE_CELL.format(user=f"{name}_user")
    widths = []
    for width in (3, 5, None):  # written, edited (another size), left as it is
        if width is not None:
            with open(path, "w") as f:
                f.write(f"WIDTH = {width}\n" + "# edited\n" * (width == 5))
        result = sagenb.train(cell, batch_size=8, steps=1, dashboard=False)
        widths.append(result.state_dict()["weight"].shape[0])
    assert widths == [3, 5, 5]
    said = capsys.readouterr()
    note = f"{name}.py changed since the engines imported it"
    assert (said.out + said.err).count(note) == 1  # the second run, not the third


@pytest.mark.pool  # starts a process of its own: the exported script
def test_the_exported_script_trains_the_cell(tmp_path):
    """notebook/export.py -> engine/launch.py: the script runs the cell in a module too; run
    with plain Python, it trains as one process (SGD: the reference's parameters)."""
    sagenb.export(GPT_CELL, tmp_path / "train.py", strategy="data", threads=1, **STEPS)
    run([sys.executable, "train.py", "--output", "model.pt"], cwd=tmp_path)
    reference, _, _ = train_reference(GPT_CELL, threads=1, **STEPS)
    assert_params_equal(torch.load(tmp_path / "model.pt", weights_only=True), reference)
