"""Pipeline model parallel and hybrid on real engines equal the single-process reference."""

from __future__ import annotations

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

import sagenb
from sagenb.config import ConfigError

from .helpers import check_equal
from .models import GPT_CELL, MAP_STYLE_CELL, SEQUENTIAL_CELL, UNSPLITTABLE_CELL
from .reference import eval_loss

TOL = 1e-5
MODELS = {"sequential": SEQUENTIAL_CELL, "gpt": GPT_CELL}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_matches_reference(pool, name, schedule):
    cell = MODELS[name]
    result = sagenb.train(
        cell,
        strategy="model",
        partitions=2,
        microbatches=4,
        schedule=schedule,
        batch_size=32,
        epochs=5,
        steps=20,
        dashboard=False,
    )
    assert len(result.history) == 20
    check_equal(result, cell, batch_size=32, epochs=5, steps=20)
    if name == "gpt":  # the tied embedding and head are still one weight
        state = result.state_dict()
        assert torch.equal(state["wte.weight"], state["head.weight"])


def test_interleaved_virtual_stages(pool):
    result = sagenb.train(
        GPT_CELL,
        strategy="model",
        partitions=2,
        schedule="interleaved",
        virtual_stages=2,
        microbatches=4,
        batch_size=32,
        steps=4,
        dashboard=False,
    )
    check_equal(result, GPT_CELL, batch_size=32, steps=4)
    stages = {rec.rank: rec.values["stages"] for rec in result.metrics}
    assert stages == {0: [0, 2], 1: [1, 3]}


def test_pipeline_loop_options_and_eval(pool):
    options = dict(batch_size=16, epochs=2, grad_accum=2, clip_grad_norm=0.5)
    result = sagenb.train(
        MAP_STYLE_CELL,
        strategy="model",
        partitions=2,
        microbatches=2,
        eval_every=10,
        dashboard=False,
        **options,
    )
    model, ns = check_equal(result, MAP_STYLE_CELL, **options)
    assert [row["lr"] for row in result.history[:6]] == pytest.approx([0.02] * 5 + [0.01])
    assert [step for step, _ in result.eval_losses] == [10, 20]
    assert result.eval_losses[-1][1] == pytest.approx(
        eval_loss(model, ns["eval_dataset"], ns["loss_fn"]), abs=TOL
    )


def test_pipeline_telemetry_and_gpipe_holds_more_activations(pool):
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        result = sagenb.train(
            SEQUENTIAL_CELL,
            strategy="model",
            partitions=2,
            microbatches=4,
            schedule=schedule,
            partition_by="uniform",
            batch_size=64,
            steps=3,
            dashboard=False,
        )
        last = {rec.rank: rec.values for rec in result.metrics if rec.step == 3}
        for values in last.values():
            kinds = sorted(event[0] for event in values["timeline"])
            assert kinds == ["B"] * 4 + ["F"] * 4  # every microbatch, forward and backward
            assert values["busy/forward(s)"] > 0 and values["idle(s)"] >= 0
            assert values["memory/params(MiB)"] > 0
        peaks[schedule] = last[0]["memory/activations(MiB)"]
    # stage 0 keeps all 4 microbatches' activations under GPipe, at most 2 under 1F1B
    assert peaks["gpipe"] > 1.5 * peaks["1f1b"]


@pytest.mark.parametrize("name", list(MODELS))
def test_hybrid_two_pipelines_of_two_stages(pool4, name):
    cell = MODELS[name]
    result = sagenb.train(
        cell,
        strategy="hybrid",
        partitions=2,
        microbatches=2,
        batch_size=32,
        epochs=5,
        steps=20,
        dashboard=False,
    )
    assert result.engines == 4 and len(result.history[0]["rank_losses"]) == 2
    check_equal(result, cell, batch_size=32, epochs=5, steps=20)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stages_match_reference(pool4, schedule):
    """Middle stages receive from both sides (activations from the left, gradients from the
    right); on gloo every receive of a step is posted at its start."""
    result = sagenb.train(
        SEQUENTIAL_CELL,
        strategy="model",
        partitions=4,
        microbatches=4,
        schedule=schedule,
        batch_size=32,
        epochs=5,
        steps=20,
        dashboard=False,
    )
    last = [r.values for r in result.metrics if r.step == 20 and "stages" in r.values]
    assert sorted(v["stages"][0] for v in last) == [0, 1, 2, 3]  # one stage on each engine
    check_equal(result, SEQUENTIAL_CELL, batch_size=32, epochs=5, steps=20)


def test_errors_name_the_numbers(pool):
    with pytest.raises(ConfigError, match=r"--microbatches 2: 1f1b needs .* >= --partitions \(3\)"):
        sagenb.train(SEQUENTIAL_CELL, strategy="model", partitions=3, microbatches=2)
    with pytest.raises(ConfigError, match=r"--batch-size 30: .* microbatches = 1 x 1 x 4 = 4"):
        sagenb.train(SEQUENTIAL_CELL, strategy="model", partitions=2, batch_size=30)
    with pytest.raises(ConfigError, match=r"--engines 3: must be a multiple of --partitions \(2\)"):
        sagenb.train(SEQUENTIAL_CELL, strategy="hybrid", partitions=2, engines=3)
    with pytest.raises(ConfigError, match=r"--cuts '9,2': needs 1 increasing"):
        sagenb.train(
            SEQUENTIAL_CELL, strategy="model", partitions=2, partition_by="manual", cuts="9,2"
        )
    # 3 blocks cannot fill 2 engines x 2 virtual stages
    with pytest.raises(sagenb.JobError, match=r"has 3 blocks, fewer than the 4 pipeline stages"):
        sagenb.train(
            MAP_STYLE_CELL,
            strategy="model",
            partitions=2,
            schedule="interleaved",
            batch_size=32,
            dashboard=False,
        )
    with pytest.raises(sagenb.JobError, match=r"cannot be split into pipeline stages"):
        sagenb.train(UNSPLITTABLE_CELL, strategy="model", partitions=2, batch_size=32)


def test_delay_init_holds_one_stage_per_engine(pool):
    options = dict(batch_size=32, steps=8, epochs=2)
    result = sagenb.train(
        GPT_CELL, strategy="model", partitions=2, delay_init=True, dashboard=False, **options
    )
    model, _ = check_equal(result, GPT_CELL, delay_init=True, **options)
    total = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    held = {rec.rank: rec.values["memory/params(MiB)"] for rec in result.metrics if rec.step == 8}
    # about half each: the blocks split evenly; the tied embedding sits on both stages
    assert all(0.4 * total < mib < 0.6 * total for mib in held.values()), (held, total)


def test_manual_cuts(pool):
    result = sagenb.train(
        SEQUENTIAL_CELL,
        strategy="model",
        partitions=2,
        partition_by="manual",
        cuts="5",
        batch_size=32,
        steps=3,
        dashboard=False,
    )
    check_equal(result, SEQUENTIAL_CELL, batch_size=32, steps=3)


def test_plan_magic_shows_the_cuts(pool, capsys):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    shell.run_cell_magic("smp_plan", "--strategy model --partitions 2 --batch-size 32", GPT_CELL)
    out = capsys.readouterr().out
    assert "bubble 20.0%" in out and "stage engine" in out
    plan = shell.user_ns["smp_plan_result"]
    assert len(plan.stages) == 2 and plan.starts[0] == 0
    assert (
        "estimate: model: 2 partitions x 1 replica" in out
    )  # the estimate comes first, without engines
    # a strategy without a pipeline gets the estimate alone (tests/test_estimate.py)
    shell.run_cell_magic("smp_plan", "--batch-size 32", GPT_CELL)
    assert "estimate: data parallel on 2 engines" in capsys.readouterr().out
