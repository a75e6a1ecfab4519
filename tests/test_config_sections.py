"""The config in sections (issue 18): every field says its section; only the engine sections
(EngineConfig) travel to the engines, the planner and an exported script; the flags follow
from each field's type and default, with no per-name cases; validation reads no file."""

from __future__ import annotations

import dataclasses
import json

import pytest

import sagenb
from sagenb.config import SECTIONS, ConfigError, EngineConfig, TrainConfig, notebook_only_flags
from sagenb.notebook.magics import parse_train_line

from .conftest import REGRESSION_CELL

NOTEBOOK_ONLY = {
    f.name for f in dataclasses.fields(TrainConfig) if not SECTIONS[f.metadata["section"]].engines
}


def test_every_field_has_a_section_and_the_engine_sections_are_engine_config():
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["section"] in SECTIONS, f.name
        assert f.metadata["help"], f.name
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert engine == {
        f.name for f in dataclasses.fields(TrainConfig) if SECTIONS[f.metadata["section"]].engines
    }
    assert NOTEBOOK_ONLY == {"dashboard", "instance", "price_per_hour", "price_table",
                             "hardware_table", "spot_discount", "out", "log_dir",
                             "if_busy", "continue_"}  # fmt: skip


def test_for_engines_keeps_the_engine_options_only():
    config = TrainConfig(strategy="sharded", batch_size=64, reshard_after_forward=False,
                         dashboard=False, out="mine", spot_discount=0.5)  # fmt: skip
    sent = config.for_engines()
    assert type(sent) is EngineConfig
    assert not NOTEBOOK_ONLY & {f.name for f in dataclasses.fields(sent)}
    for f in dataclasses.fields(EngineConfig):
        assert getattr(sent, f.name) == getattr(config, f.name), f.name
    assert sent.for_engines() is sent
    assert sent.with_engines(2).engines == 2 and type(sent.with_engines(2)) is EngineConfig


@pytest.mark.parametrize(
    "options",
    [
        dict(dashboard=False, out="r", engines=2, batch_size=64),
        dict(strategy="sharded", reshard_after_forward=False, stop_on_nonfinite=True),
        dict(strategy="model", partitions=3, partition_by="manual", cuts=(1, 2), delay_init=True),
        dict(activation_checkpointing=True, precision="bf16", instance="ml.g5.xlarge"),
    ],
)
def test_flags_follow_from_the_fields(options):
    """A bool off by default is a `--x` switch, one on by default `--x/--no-x`, and every
    line to_flags writes reads back as the same config."""
    config = TrainConfig(**options)
    line = config.to_flags().removeprefix("%%smp_train ")
    assert parse_train_line(line) == config
    assert parse_train_line("--dashboard --reshard-after-forward") == TrainConfig()


def test_validation_reads_no_file(tmp_path):
    """A missing price table or an instance it lacks is refused where the table is read
    (cost.check_price: sagenb.train, plan, export, the panel), not when the config is built."""
    from sagenb.sizing.cost import check_price

    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"instances": {"my.box": {"usd_per_hour": 1, "accelerators": 0}}}))
    missing = TrainConfig(price_table=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="--price-table .*missing.json.*cannot be read"):
        check_price(missing)
    unknown = TrainConfig(price_table=str(table))  # ml.p4d.24xlarge is not in it
    with pytest.raises(ConfigError, match="--instance 'ml.p4d.24xlarge': must be one of my.box"):
        sagenb.plan(REGRESSION_CELL, unknown, strategy="model", partitions=2)
    with pytest.raises(ConfigError, match="--instance 'ml.p4d.24xlarge': must be one of my.box"):
        sagenb.export(REGRESSION_CELL, tmp_path / "job.py", unknown)
    assert not (tmp_path / "job.py").exists()
    assert check_price(TrainConfig(price_table=str(table), instance="my.box")).name == "my.box"


def test_the_export_writes_engine_options_and_names_what_it_left_out(tmp_path):
    sagenb.export(REGRESSION_CELL, tmp_path / "job.py", engines=2, out="r", dashboard=False)
    text = (tmp_path / "job.py").read_text()
    assert "CONFIG = EngineConfig(" in text and "TrainConfig" not in text
    assert "dashboard=" not in text and "out=" not in text
    for flag in notebook_only_flags():
        assert flag in text.split("CONFIG =")[0], flag
    assert "--no-dashboard" in notebook_only_flags() and "--out" in notebook_only_flags()


# the cell looks up the RankSpec its engine was given (run_rank's `spec`) and writes what its
# config holds: what the notebook sent, seen where it arrived
SPY = """
import dataclasses, json, sys
_frame = sys._getframe()
while _frame is not None and type(_frame.f_locals.get("spec")).__name__ != "RankSpec":
    _frame = _frame.f_back
_config = _frame.f_locals["spec"].config
with open({path!r}, "w") as _out:
    json.dump([type(_config).__name__, [f.name for f in dataclasses.fields(_config)]], _out)
"""


def test_the_engines_get_no_notebook_only_option(pool, tmp_path):
    path = tmp_path / "spec.json"
    cell = REGRESSION_CELL + SPY.format(path=str(path))
    result = sagenb.train(cell, steps=1, dashboard=False, out="mine", instance="ml.g5.xlarge")
    assert len(result.history) == 1 and result.config.out == "mine"  # the notebook keeps them
    kind, names = json.loads(path.read_text())
    assert kind == "EngineConfig"
    assert names == [f.name for f in dataclasses.fields(EngineConfig)]
    assert not NOTEBOOK_ONLY & set(names)


def test_engine_code_knows_only_the_engine_config():
    """sagenb/engine/** annotates and imports EngineConfig: the notebook's options cannot be
    read there, as they are never sent."""
    from pathlib import Path

    engine = Path(sagenb.__file__).parent / "engine"
    named = [str(p) for p in engine.rglob("*.py") if "TrainConfig" in p.read_text()]
    assert named == []


def test_a_strategys_option_still_reads_as_an_attribute_and_travels_pickled():
    """Options that were fields once (`config.reshard_after_forward`) and are now declared by
    their strategy still read as attributes, as notebooks and exported scripts read them; a
    config unpickles without asking the strategies (what an engine receives)."""
    import pickle

    config = TrainConfig(strategy="sharded", reshard_after_forward=False)
    assert config.reshard_after_forward is False and config.option("reshard_after_forward") is False
    assert TrainConfig().reshard_after_forward is True  # its default, unless given
    with pytest.raises(AttributeError, match="no attribute 'reshard_after_forwards'"):
        config.reshard_after_forwards  # noqa: B018
    sent = pickle.loads(pickle.dumps(config.for_engines()))
    assert sent == config.for_engines() and sent.reshard_after_forward is False


def test_the_pipelines_options_keep_their_keywords_flags_and_attributes():
    """The pipeline's options are its strategies' own now (engine/strategies/pipeline/
    options.py), but every way of giving them still works: keywords, as sagenb.train and an
    exported script from before pass them (`EngineConfig(..., partitions=2, cuts=(1,))`), the
    magic's flags, and the attributes scripts read; a bad value names the flag, the value and
    what is allowed."""
    old_script = EngineConfig(
        strategy="model",
        engines=2,
        partitions=2,
        microbatches=2,
        schedule="gpipe",
        partition_by="manual",
        cuts=(1,),
        memory_budget=2,
        batch_size=8,
    )
    assert old_script.partitions == 2 and old_script.cuts == (1,)
    assert old_script.memory_budget == 2.0  # an int made a float, as the field did
    assert old_script == EngineConfig(**dict(old_script.strategy_options), strategy="model",
                                      engines=2, batch_size=8)  # fmt: skip
    line = old_script.to_flags()
    assert "--partitions 2 --microbatches 2 --schedule gpipe --partition-by manual --cuts 1" in line
    assert parse_train_line(line.removeprefix("%%smp_train")).for_engines() == old_script
    with pytest.raises(ConfigError, match=r"--schedule 'x': must be one of gpipe, 1f1b"):
        TrainConfig(strategy="model", partitions=2, schedule="x")
    with pytest.raises(ConfigError, match=r"--partitions 2: needs --strategy model or hybrid"):
        TrainConfig(partitions=2)
    with pytest.raises(ConfigError, match=r"--cuts \(1,\): is used only with --partition-by"):
        TrainConfig(strategy="model", partitions=2, cuts="1")
