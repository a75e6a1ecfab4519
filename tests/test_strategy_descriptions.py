"""One description per strategy (sagenb/engine/strategies/description.py): the rest of sagenb
asks it instead of comparing strategy names, and a new strategy, its options included, is one
new module."""

from __future__ import annotations

import ast
import dataclasses
import functools
import runpy
import sys
from pathlib import Path

import ipywidgets as widgets
import pytest
from IPython.core.error import UsageError

import sagenb
from sagenb.config import ConfigError, EngineConfig, Option, TrainConfig, flag_reference
from sagenb.display.dashboard import layout_text
from sagenb.engine import strategies
from sagenb.notebook.magics import parse_train_line, train_parser

from .conftest import REGRESSION_CELL
from .helpers import check_equal

SAGENB = Path(sagenb.__file__).parent
NAMES = ("data", "model", "hybrid", "sharded", "tensor", "own")

#: a made-up strategy, written as a user of the architecture page would: one module, its option
#: included. By default every engine trains on the whole global batch and DDP averages equal
#: gradients, so it trains as one process does (on twice the compute: a teaching example, not a
#: product); --mirror-shares 2 cuts each batch in two shares, one per engine, which trains as one
#: process does too, and gives each engine a loss of its own.
MADE_UP = """
from sagenb.config import ConfigError, Option
from sagenb.engine.strategies.data_parallel import DataParallel
from sagenb.engine.strategies.description import Description, plural


class Mirrored(DataParallel):
    def __init__(self, *, shares, **rest):
        super().__init__(**rest)
        self.shares = shares

    def local_indices(self, slice_indices):
        # engine r trains share r % shares of each slice: the whole slice when shares is 1
        size = len(slice_indices) // self.shares
        share = self.rank % self.shares
        return slice_indices[share * size : (share + 1) * size]

    @property
    def replicas(self):
        return self.shares


class MirroredDescription(Description):
    name = "mirrored"
    summary = "every engine trains on the whole batch (or on one of --mirror-shares)"
    options = (
        Option(
            "mirror_shares",
            "parallelism",
            1,
            "shares each batch is cut into, engine r training share r mod N (1: every engine "
            "trains the whole batch)",
        ),
    )

    def check(self, config):
        shares, engines = config.option("mirror_shares"), config.engines
        if shares < 1 or (engines is not None and engines % shares):
            raise ConfigError("mirror_shares", shares, "must be >= 1 and divide --engines")

    def replicas(self, config, engines):
        return config.option("mirror_shares")

    def layout(self, config, engines):
        shares = config.option("mirror_shares")
        each = "the whole batch" if shares == 1 else f"1/{shares} of it"
        return f"mirrored on {plural(engines, 'engine')}, each {each}"

    def build(self, config, *, rank, world_size, device):
        return Mirrored(
            shares=config.option("mirror_shares"),
            rank=rank,
            world_size=world_size,
            device=device,
            seed=config.seed,
        )


DESCRIPTIONS = (MirroredDescription(),)
"""
#: the help of its option, as the flag reference and the panel's tooltip show it
SHARES_HELP = (
    "shares each batch is cut into, engine r training share r mod N (1: every engine trains the "
    "whole batch)"
)


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


def test_a_strategys_own_option_is_a_flag_and_a_keyword(made_up):
    """Declared in the strategy's module alone, --mirror-shares is a flag of the magic, a
    keyword of the config (dataclasses.replace too) that the config holds in
    strategy_options, written back by to_flags, and read with config.option."""
    assert "--mirror-shares MIRROR_SHARES" in train_parser().format_help()
    config = parse_train_line("--strategy mirrored --engines 2 --batch-size 6 --mirror-shares 2")
    assert config.option("mirror_shares") == 2
    assert config.strategy_options == (("mirror_shares", 2),)
    assert config == TrainConfig(strategy="mirrored", engines=2, batch_size=6, mirror_shares=2)
    assert config.replicas(2) == 2  # the description reads it too
    assert layout_text(config) == "mirrored on 2 engines, each 1/2 of it"
    line = config.to_flags()
    assert line == "%%smp_train --strategy mirrored --engines 2 --mirror-shares 2 --batch-size 6"
    assert parse_train_line(line.removeprefix("%%smp_train ")) == config
    assert config.for_engines().option("mirror_shares") == 2  # it travels to the engines
    # its default is held as no value at all: configs that train alike compare equal
    whole = dataclasses.replace(config, mirror_shares=1)
    assert whole.option("mirror_shares") == 1 and whole.strategy_options == ()
    assert whole == TrainConfig(strategy="mirrored", engines=2, batch_size=6)
    given = EngineConfig(strategy="mirrored", strategy_options={"mirror_shares": 2})
    assert given.strategy_options == config.strategy_options


def test_a_strategys_own_option_is_refused_like_the_others(made_up):
    """Under another strategy only its default is allowed; a value of the wrong type, one its
    strategy's check refuses and an option nobody declares are refused, naming the option,
    the value and what is allowed."""
    with pytest.raises(ConfigError, match="--mirror-shares 2: needs --strategy mirrored"):
        TrainConfig(mirror_shares=2)
    with pytest.raises(UsageError, match="--mirror-shares 2: needs --strategy mirrored"):
        parse_train_line("--strategy data --mirror-shares 2")
    assert TrainConfig(strategy="data", mirror_shares=1) == TrainConfig()
    with pytest.raises(ConfigError, match="--mirror-shares 'two': must be an integer"):
        TrainConfig(strategy="mirrored", mirror_shares="two")
    with pytest.raises(UsageError, match="--mirror-shares: invalid int value: 'two'"):
        parse_train_line("--strategy mirrored --mirror-shares two")
    with pytest.raises(ConfigError, match="--mirror-shares 3: must be >= 1 and divide --engines"):
        TrainConfig(strategy="mirrored", engines=2, mirror_shares=3)
    unknown = (
        r"--mirror-copies 2: is no option: did you mean --mirror-shares\? .* the strategies "
        r"declare .*--mirror-shares \(--strategy mirrored\)"
    )
    with pytest.raises(ConfigError, match=unknown):
        TrainConfig(strategy="mirrored", mirror_copies=2)
    with pytest.raises(ConfigError, match=unknown):
        sagenb.train(REGRESSION_CELL, strategy="mirrored", mirror_copies=2)  # before any engine
    with pytest.raises(ConfigError, match="--mirror-copies 2: is no option"):
        EngineConfig(strategy_options={"mirror_copies": 2})
    with pytest.raises(UsageError, match="unrecognized arguments: --mirror-copies 2"):
        parse_train_line("--strategy mirrored --mirror-copies 2")


def test_a_strategys_own_option_is_in_the_reference_the_panel_and_the_export(made_up, tmp_path):
    """The flag reference lists it in its section with its strategy named; the control panel
    shows it in that section's tab, greyed out under other strategies; an exported script
    rebuilds the config with it."""
    parallelism = flag_reference().split("## Training")[0]
    row = f"| `--mirror-shares` | 1 | {SHARES_HELP} (--strategy mirrored) |"
    assert row in parallelism.splitlines()
    panel = sagenb.ControlPanel(strategy="mirrored")
    widget = panel.controls["mirror_shares"]
    assert type(widget) is widgets.IntText and not widget.disabled
    assert widget.tooltip == f"--mirror-shares (--strategy mirrored): {SHARES_HELP}"
    tabs = dict(zip(panel.sections.titles, panel.sections.children, strict=True))
    assert widget in tabs["Parallelism"].children[1].children
    widget.value = 2
    assert panel.config is not None and panel.config.option("mirror_shares") == 2
    line = "%%smp_train --strategy mirrored --engines 2 --mirror-shares 2"
    assert panel.line.value == f"<code>{line}</code>"
    panel.controls["strategy"].value = "data"
    assert widget.disabled and widget.value == 2  # kept as typed, not used
    assert panel.config is not None and panel.config.option("mirror_shares") == 1
    config = TrainConfig(strategy="mirrored", engines=2, steps=4, mirror_shares=2)
    sagenb.export(REGRESSION_CELL, tmp_path / "job.py", config)
    text = (tmp_path / "job.py").read_text()
    assert "    mirror_shares=2,\n" in text.split("CONFIG = EngineConfig(")[1]
    assert runpy.run_path(str(tmp_path / "job.py"), run_name="not_main")["CONFIG"] == (
        config.for_engines()
    )


def test_an_option_converts_and_checks_its_values():
    """An Option checks a value by its type (the default's, unless given) and choices, reads a
    flag's text with its `parse`, and names the option, the value and what is allowed."""
    assert Option("shares", "parallelism", 1, "h").type is int
    rate = Option("rate", "training", 0.5, "h").convert(1)
    assert rate == 1.0 and isinstance(rate, float)
    with pytest.raises(ConfigError, match="--shares True: must be an integer"):
        Option("shares", "parallelism", 1, "h").convert(True)
    mode = Option("mode", "parallelism", "a", "h", choices=lambda: ("a", "b"))
    with pytest.raises(ConfigError, match="--mode 'c': must be one of a, b"):
        mode.convert("c")
    cap = Option("cap", "memory", None, "h", type=float)
    assert cap.convert(None) is None
    with pytest.raises(ConfigError, match="--cap 'x': must be a finite number or None"):
        cap.convert("x")
    ints = Option("ints", "parallelism", (), "h", parse=lambda t: tuple(map(int, t.split(","))))
    assert ints.convert("1,2") == (1, 2)
    with pytest.raises(ValueError, match="a default of None needs type="):
        Option("cap", "memory", None, "h")


@pytest.mark.parametrize(
    "option, message",
    [
        ('Option("grad_accum", "training", 1, "h")', "'grad_accum', which is a field"),
        ('Option("mirror_note", "output", "", "h")', "'mirror_note' in section 'output'"),
    ],
)
def test_an_option_that_cannot_be_like_the_others_is_refused(tmp_path, option, message):
    """A strategy's option may not take a field's name, nor a section that stays in the
    notebook (the config that holds it travels to the engines)."""
    module = MADE_UP.replace("    options = (\n", f"    options = (\n        {option},\n", 1)
    module = module.replace('name = "mirrored"', 'name = "mirrored_badly"')
    (tmp_path / "made_up_badly.py").write_text(module)
    _add_strategy_folder(str(tmp_path))
    try:
        refused = f"strategy mirrored_badly declares option {message}"
        with pytest.raises(RuntimeError, match=refused):
            TrainConfig()
    finally:
        _remove_strategy_folder(str(tmp_path))
        sys.modules.pop(f"{strategies.__name__}.made_up_badly")  # the next case writes its own


@pytest.mark.parametrize("shares", [1, 2])
def test_a_made_up_strategy_trains_on_the_engines(pool, made_up, shares):
    """Its option reaches the engines, which read it with config.option: --mirror-shares 1 has
    every engine train the whole batch (their losses are the same), 2 each its own half (their
    losses differ); both train as one process does."""
    pool.client[:].apply_sync(functools.partial(_add_strategy_folder, made_up))
    try:
        options = dict(batch_size=16, epochs=1, steps=6, lr=0.01)
        result = sagenb.train(
            REGRESSION_CELL, strategy="mirrored", dashboard=False, mirror_shares=shares, **options
        )
        check_equal(result, REGRESSION_CELL, **options)
        assert result.config.option("mirror_shares") == shares
        same = [row["rank_losses"][0] == row["rank_losses"][1] for row in result.history]
        assert all(same) if shares == 1 else not any(same)
    finally:
        pool.client[:].apply_sync(functools.partial(_remove_strategy_folder, made_up))
