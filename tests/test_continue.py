"""Going on from a run without disk (--continue): N steps, then M more with --continue, equal
N + M steps in one run, bit for bit on the CPU, in every strategy and on a stream; one history
across the segments; what may change between them and what is refused, with the reason; what
releases the kept state, and what a --continue after it says."""

from __future__ import annotations

import time

import pytest
import torch
from IPython.core.error import UsageError

import sagenb
from sagenb.config import ConfigError
from sagenb.run import kept

from .conftest import REGRESSION_CELL
from .helpers import assert_params_equal
from .models import GPT_CELL
from .test_streams import torch_cell

#: each strategy's options on the tiny GPT (hybrid: two pipelines of two stages, 4 engines)
STRATEGIES = {
    "data": dict(strategy="data"),
    "sharded": dict(strategy="sharded"),
    "tensor": dict(strategy="tensor"),
    "model": dict(strategy="model", partitions=2, microbatches=2),
    "hybrid": dict(strategy="hybrid", partitions=2, microbatches=2),
}
SHORT = dict(batch_size=8, epochs=2, dashboard=False)


def in_two_segments(cell: str, n: int, total: int, **options) -> tuple:
    """One run of `total` steps, and a run of `n` steps gone on to `total` with --continue."""
    whole = sagenb.train(cell, steps=total, **options)
    first = sagenb.train(cell, steps=n, **options)
    assert first.live is not None, "the engines keep the run's state"
    then = sagenb.train(cell, steps=total, continue_=True, **options)
    return whole, first, then


def assert_same_run(whole, then, n: int, total: int) -> None:
    assert [row["step"] for row in then.history] == list(range(1, total + 1))
    assert then.segments == [1, n + 1]
    assert_params_equal(then.state_dict(), whole.state_dict(), tol=0)
    torch.testing.assert_close(then.losses, whole.losses, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["data", "sharded", "tensor", "model"])
def test_going_on_equals_one_run(pool, strategy):
    """Adam's default optimizer, its moments and step count kept on the engines: bit-identical
    (tol=0), as the optimizer's state is the same tensors, not a copy."""
    whole, first, then = in_two_segments(GPT_CELL, 2, 5, **STRATEGIES[strategy], **SHORT)
    assert_same_run(whole, then, 2, 5)
    assert then.status == "done" and then.live is not None


def test_going_on_equals_one_run_in_hybrid(pool4):
    whole, _, then = in_two_segments(GPT_CELL, 2, 4, **STRATEGIES["hybrid"], **SHORT)
    assert_same_run(whole, then, 2, 4)


def test_a_stream_goes_on_where_it_stopped(pool):
    """An endless stream, read again up to where the run stopped: steps 4-7 read items 48 on."""
    cell = torch_cell(endless=True)
    whole, _, then = in_two_segments(cell, 3, 7, batch_size=16, dashboard=False)
    assert_same_run(whole, then, 3, 7)


def test_what_a_continue_may_change_and_what_it_may_not(pool):
    """--lr changes between segments (the default AdamW takes it exactly); the batch size,
    the strategy and the cell are refused, naming the option and pointing to --resume; the
    state is still kept after a refusal, and a run of the cell without --continue releases it."""
    first = sagenb.train(REGRESSION_CELL, steps=3, **SHORT)
    assert first.live is not None
    note = first.live.describe()
    assert "after step 3" in note and "rank 0:" in note and "rank 1:" in note and "MiB" in note
    with pytest.raises(ConfigError, match=r"--batch-size 16 \(was 8\).*--resume"):
        sagenb.train(REGRESSION_CELL, steps=6, continue_=True, **{**SHORT, "batch_size": 16})
    with pytest.raises(ConfigError, match=r"--strategy 'sharded' \(was 'data'\)"):
        sagenb.train(REGRESSION_CELL, steps=6, continue_=True, strategy="sharded", **SHORT)
    with pytest.raises(ConfigError, match="the cell changed since the run"):
        sagenb.train(REGRESSION_CELL + "\n# edited", steps=6, continue_=True, **SHORT)
    with pytest.raises(ConfigError, match="trained all its 3 steps: give a larger --steps"):
        sagenb.train(REGRESSION_CELL, steps=3, continue_=True, **SHORT)
    lowered = sagenb.train(REGRESSION_CELL, steps=5, lr=1e-4, continue_=True, **SHORT)
    assert [row["lr"] for row in lowered.history] == [1e-3] * 3 + [1e-4] * 2
    # the first segment's result stays what it was; its state went on, and it says where
    assert len(first.history) == 3 and lowered.segments == [1, 4]
    assert ": 5 steps, the last 2 after --continue (cpu) in " in lowered.summary()
    went_on = r"released by its --continue to step 5, whose result holds it now"
    with pytest.raises(ConfigError, match=went_on):
        first.on_engines(_rank_of)
    with pytest.raises(ConfigError, match=went_on):
        first.go_on(steps=8)  # not from step 5 with the first segment's lr
    # a larger --steps cannot go past the --epochs that ended the run
    ended = sagenb.train(REGRESSION_CELL, **{**SHORT, "epochs": 1})
    assert len(ended.history) == 24
    with pytest.raises(ConfigError, match=r"ended with its --epochs 1 at step 24.*larger --epochs"):
        sagenb.train(REGRESSION_CELL, steps=30, continue_=True, **{**SHORT, "epochs": 1})
    sagenb.train(REGRESSION_CELL, steps=2, **SHORT)  # the same cell, without --continue
    ran = sagenb.train(REGRESSION_CELL, steps=4, continue_=True, **SHORT)
    assert ran.history[0]["step"] == 1 and ran.segments == [1, 3]


def test_what_released_the_state_is_said(pool, tmp_path):
    first = sagenb.train(REGRESSION_CELL, steps=2, **SHORT)
    first.release()
    assert pool.client[pool.engine_ids].apply_sync(_kept_here) == [None] * pool.size
    with pytest.raises(ConfigError, match=r"released by smp_result.release\(\).*no checkpoint"):
        sagenb.train(REGRESSION_CELL, steps=4, continue_=True, **SHORT)
    ckpt = dict(checkpoint_dir=str(tmp_path), **SHORT)
    sagenb.train(REGRESSION_CELL, steps=2, **ckpt)
    sagenb.train(REGRESSION_CELL.replace("16", "12"), steps=2, **SHORT)  # another cell
    with pytest.raises(ConfigError, match=r"released by a run of another cell.*--resume"):
        sagenb.train(REGRESSION_CELL, steps=4, continue_=True, **ckpt)
    kept.forget()
    with pytest.raises(ConfigError, match="no run's state is kept on the engines"):
        sagenb.train(REGRESSION_CELL, steps=4, continue_=True, **SHORT)


def test_a_continue_starts_at_once(pool):
    """The next segment's first step on the warm pool: no cell, no setup, no rendezvous."""
    sagenb.train(GPT_CELL, steps=1, **STRATEGIES["sharded"], **SHORT)
    began = time.perf_counter()
    then = sagenb.train(GPT_CELL, steps=2, continue_=True, **STRATEGIES["sharded"], **SHORT)
    assert then.time_to_first_step_s < 1.0, then.time_to_first_step_s
    assert time.perf_counter() - began < 5


def _kept_here():
    from sagenb.engine.live import kept as engine_kept

    return engine_kept.summary()


# -- the live model on the engines ----------------------------------------------------------------


def _local_numel(model, rank, scale):
    """What this rank holds of the model (a DTensor's local shard), times `scale`."""
    local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    return rank, local * scale


@pytest.mark.parametrize("strategy", ["sharded", "model"])
def test_evaluate_and_on_engines_work_on_the_live_model(pool, strategy):
    """Each rank's function sees its part (a shard, a stage); evaluate is the strategy's, equal
    to one process's loss over the dataset with the trained model."""
    result = sagenb.train(GPT_CELL, steps=3, **STRATEGIES[strategy], **SHORT)
    parts = result.on_engines(_local_numel, 2)
    whole = sum(p.numel() for p in result.state_dict().values() if p.is_floating_point())
    assert [rank for rank, _ in parts] == [0, 1]
    assert all(0 < n < 2 * whole for _, n in parts), (parts, whole)  # a part, not the whole
    model, ns = result.model(), _namespace(GPT_CELL)
    data = ns["dataset"]
    eval_set = torch.utils.data.TensorDataset(*data[:32])
    with torch.no_grad():
        expected = float(ns["loss_fn"](model(eval_set.tensors[0]), eval_set.tensors[1]))
    assert result.evaluate(eval_set) == pytest.approx(expected, rel=1e-5)
    # nothing done on the engines changes what --continue trains
    whole_run = sagenb.train(GPT_CELL, steps=5, **STRATEGIES[strategy], **SHORT)
    sagenb.train(GPT_CELL, steps=3, **STRATEGIES[strategy], **SHORT).evaluate(eval_set)
    then = sagenb.train(GPT_CELL, steps=5, continue_=True, **STRATEGIES[strategy], **SHORT)
    assert_params_equal(then.state_dict(), whole_run.state_dict(), tol=0)


@pytest.mark.parametrize("strategy", ["data", "sharded"])
def test_generate_on_the_engines_equals_one_process(pool, strategy):
    from .models import nanogpt_cell

    cell = nanogpt_cell("tuple")
    result = sagenb.train(cell, steps=3, strategy=strategy, **SHORT)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    tokens = result.generate(prompt, max_new_tokens=5)
    model = result.model()
    ids = prompt
    with torch.no_grad():
        for _ in range(5):
            logits, _ = model(ids)
            ids = torch.cat([ids, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, ids)
    # past the context of its learned positions: said before the position embedding fails
    with pytest.raises(
        Exception,
        match=r"3 prompt tokens \+ max_new_tokens 14 = 17 pass the model's "
        r"context, model.config.block_size = 16",
    ):
        result.generate(prompt, max_new_tokens=14)
    assert torch.equal(result.generate(prompt, max_new_tokens=5), tokens)  # the state as it was


def test_generate_through_a_pipeline_equals_one_process(pool):
    """The stages are compiled for the training samples' 16 tokens: each step's sequence goes
    in right-padded to them, and the causal GPT's logits at the last real token are those of
    the one-process model on the same padded input. Five rows run as two microbatches of 4."""
    result = sagenb.train(GPT_CELL, steps=3, **STRATEGIES["model"], **SHORT)
    prompt = torch.randint(0, 64, (5, 4), generator=torch.Generator().manual_seed(1))
    tokens = result.generate(prompt, max_new_tokens=6)
    model, ids = result.model(), prompt
    with torch.no_grad():
        for _ in range(6):
            padded = torch.zeros(5, 16, dtype=ids.dtype)
            padded[:, : ids.shape[1]] = ids
            ids = torch.cat([ids, model(padded)[:, ids.shape[1] - 1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, ids)
    with pytest.raises(Exception, match="more than the 16 its stages are compiled for"):
        result.generate(torch.zeros(1, 17, dtype=torch.long), max_new_tokens=1)


def test_a_failing_call_is_contained_and_says_what_it_cost(pool):
    """A function that fails on every rank leaves the state as it was; one that fails on one
    rank while the other waits for it in a collective is contained as a failing cell is: the
    waiting engine stopped within seconds, and the state it held released, said so."""
    result = sagenb.train(REGRESSION_CELL, steps=2, **SHORT)
    with pytest.raises(Exception, match="ZeroDivisionError"):
        result.on_engines(_divides_by_zero)
    assert result.on_engines(_rank_of) == [0, 1]
    began = time.perf_counter()
    with pytest.raises(Exception, match="(?s)rank 1.*ZeroDivisionError"):
        result.on_engines(_fails_on_rank_1)
    assert time.perf_counter() - began < 15
    with pytest.raises(ConfigError, match="released by a call on the engines that failed"):
        result.on_engines(_rank_of)
    with pytest.raises(ConfigError, match="released by a call on the engines that failed"):
        sagenb.train(REGRESSION_CELL, steps=4, continue_=True, **SHORT)


def _divides_by_zero(model, rank):
    return 1 / 0


def _rank_of(model, rank):
    return rank


def _fails_on_rank_1(model, rank):
    import torch.distributed as dist

    if rank == 1:
        return 1 / 0
    dist.barrier()  # waits for rank 1, which never comes
    return rank


def _namespace(cell: str) -> dict:
    torch.manual_seed(0)
    ns: dict = {}
    exec(cell, ns)
    return ns


def test_an_engine_that_died_takes_the_state_with_it(pool):
    """An engine killed between two cells: the next --continue says the kept run's engines are
    gone, before any engine works, and the pool is healed for the run after."""
    import os
    import signal

    sagenb.train(REGRESSION_CELL, steps=2, **SHORT)
    dead = pool.engine_ids[1]
    os.kill(pool.pids[dead], signal.SIGKILL)
    deadline = time.monotonic() + 30  # until the controller has noticed (its heartbeats)
    while dead in pool.client.ids and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(ConfigError, match="engines that kept the run of .* are gone"):
        sagenb.train(REGRESSION_CELL, steps=4, continue_=True, **SHORT)
    assert sagenb.train(REGRESSION_CELL, steps=2, **SHORT).status == "done"


def test_a_continue_line_gives_only_what_it_changes(shell, pool):
    """`%%smp_train --continue --steps N`: the pipeline's layout, the batch size and the
    result's name are the kept run's; what the line gives (--lr) changes; the two segments
    equal one run of the whole, bit for bit."""
    layout = "--strategy model --partitions 2 --microbatches 2 --batch-size 8 --epochs 2"
    whole = sagenb.train(GPT_CELL, steps=4, **STRATEGIES["model"], **SHORT)
    shell.run_cell_magic("smp_train", f"{layout} --steps 2 --out seg --no-dashboard", GPT_CELL)
    shell.run_cell_magic("smp_train", "--continue --steps 4", GPT_CELL)
    then = shell.user_ns["seg"]
    assert then.segments == [1, 3] and then.config.strategy == "model"
    assert then.config.option("partitions") == 2 and then.config.dashboard is False
    assert_params_equal(then.state_dict(), whole.state_dict(), tol=0)
    shell.run_cell_magic("smp_train", "--continue --steps 5 --lr 1e-4", GPT_CELL)
    # the cell's own optimizer (lr 0.1) scaled by the new --lr / the kept run's (1e-3)
    lrs = [row["lr"] for row in shell.user_ns["seg"].history][-2:]
    assert lrs == pytest.approx([0.1, 0.01], rel=1e-9)
    with pytest.raises(UsageError, match=r"--batch-size 16 \(was 8\)"):
        shell.run_cell_magic("smp_train", "--continue --steps 6 --batch-size 16", GPT_CELL)
