"""One description per strategy (sagenb/engine/strategies/description.py): the rest of sagenb
asks it instead of comparing strategy names, and a new strategy is one new module."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import sagenb
from sagenb.config import ConfigError, TrainConfig
from sagenb.display.dashboard import layout_text
from sagenb.engine import strategies
from sagenb.notebook.magics import parse_train_line

from .conftest import REGRESSION_CELL
from .helpers import check_equal

SAGENB = Path(sagenb.__file__).parent
NAMES = ("data", "model", "hybrid", "sharded", "tensor")

#: a made-up strategy, written as a user of the architecture page would: one module. Every
#: engine trains on the whole global batch and DDP averages equal gradients, so it trains as one
#: process does (on twice the compute: a teaching example, not a product).
MADE_UP = '''
from sagenb.engine.strategies.data_parallel import DataParallel
from sagenb.engine.strategies.description import Description, plural


class Mirrored(DataParallel):
    def local_indices(self, slice_indices):
        return slice_indices  # the whole slice on every engine

    @property
    def replicas(self):
        return 1


class MirroredDescription(Description):
    name = "mirrored"
    summary = "every engine trains on the whole batch"

    def replicas(self, config, engines):
        return 1

    def layout(self, config, engines):
        return f"mirrored on {plural(engines, 'engine')}, each the whole batch"

    def build(self, config, *, rank, world_size, device):
        return Mirrored(rank=rank, world_size=world_size, device=device, seed=config.seed)


DESCRIPTIONS = (MirroredDescription(),)
'''


def _add_strategy_folder(folder: str) -> None:
    """Let the strategies package find modules in `folder` too (in this process or an
    engine's), as if they had been written into sagenb/engine/strategies/."""
    from sagenb.engine import strategies as package

    if folder not in package.__path__:
        package.__path__.append(folder)
    package._registry.cache_clear()


def _remove_strategy_folder(folder: str) -> None:
    from sagenb.engine import strategies as package

    if folder in package.__path__:
        package.__path__.remove(folder)
    package._registry.cache_clear()


@pytest.fixture
def made_up(tmp_path):
    (tmp_path / "made_up.py").write_text(MADE_UP)
    _add_strategy_folder(str(tmp_path))
    yield str(tmp_path)
    _remove_strategy_folder(str(tmp_path))


def test_every_strategy_is_described_once():
    assert strategies.names() == NAMES  # the default first, as --strategy's help lists them
    for name in NAMES:
        described = strategies.describe(name)
        assert described.name == name and described.summary
    assert [n for n in NAMES if strategies.describe(n).pipelined] == ["model", "hybrid"]
    with pytest.raises(ConfigError, match="--strategy 'pipeline': must be one of data, model"):
        strategies.describe("pipeline")


def _strategy_name_comparisons(path: Path) -> list[str]:
    """`x.strategy == "model"`, `strategy in ("model", "hybrid")` and the like in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        names_strategy = any(
            (isinstance(p, ast.Attribute) and p.attr == "strategy")
            or (isinstance(p, ast.Name) and p.id == "strategy")
            for p in parts
        )
        literals = [
            c.value
            for p in parts
            for c in ast.walk(p)
            if isinstance(c, ast.Constant) and c.value in NAMES
        ]
        if names_strategy and literals:
            found.append(f"{path.relative_to(SAGENB.parent)}:{node.lineno}")
    return found


def test_no_module_outside_the_strategies_compares_strategy_names():
    own = SAGENB / "engine" / "strategies"
    found = [
        where
        for path in sorted(SAGENB.rglob("*.py"))
        if own not in path.parents
        for where in _strategy_name_comparisons(path)
    ]
    assert found == [], "ask engine/strategies' describe(name) instead"


def test_the_checks_live_with_their_strategy():
    with pytest.raises(ConfigError, match="--partitions 2: needs --strategy model or hybrid"):
        TrainConfig(strategy="sharded", partitions=2)
    with pytest.raises(ConfigError, match="--no-reshard-after-forward needs --strategy sharded"):
        TrainConfig(strategy="tensor", reshard_after_forward=False)
    with pytest.raises(ConfigError, match="--engines 4: --strategy model uses one engine per"):
        TrainConfig(strategy="model", partitions=2, engines=4)
    with pytest.raises(ConfigError, match="replicas x grad-accum x microbatches = 2 x 1 x 4"):
        TrainConfig(strategy="hybrid", partitions=2, engines=4, batch_size=36)
    hybrid = TrainConfig(strategy="hybrid", partitions=3)
    assert (hybrid.engines_to_start(), hybrid.replicas(6)) == (6, 2)
    assert TrainConfig(strategy="tensor", tensor_parallel=4).engines_to_start() == 4


def test_a_made_up_strategy_is_one_module(made_up):
    page = (SAGENB.parent / "docs" / "architecture.md").read_text()
    assert MADE_UP.strip() in page  # the architecture page shows this very module
    assert strategies.names() == (*NAMES, "mirrored")
    config = parse_train_line("--strategy mirrored --engines 2 --batch-size 6")
    assert config.replicas(2) == 1  # 6 does not split over 2 engines, but need not
    assert layout_text(config) == "mirrored on 2 engines, each the whole batch"
    with pytest.raises(ConfigError, match="--partitions 2: needs --strategy model or hybrid"):
        TrainConfig(strategy="mirrored", partitions=2)


def test_a_made_up_strategy_trains_on_the_engines(pool, made_up):
    pool.client[:].apply_sync(functools.partial(_add_strategy_folder, made_up))
    try:
        options = dict(batch_size=16, epochs=1, steps=6, lr=0.01)
        result = sagenb.train(REGRESSION_CELL, strategy="mirrored", dashboard=False, **options)
        check_equal(result, REGRESSION_CELL, **options)
        # every engine saw the whole batch: their losses are the same
        assert all(row["rank_losses"][0] == row["rank_losses"][1] for row in result.history)
    finally:
        pool.client[:].apply_sync(functools.partial(_remove_strategy_folder, made_up))
