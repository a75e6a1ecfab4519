"""--offload-activations (issue 30 item 5): on CUDA engines the activations saved for backward
wait in pinned host memory (engine/memory.py, the meter's own saved-tensor hooks). On CPU
engines there is no device memory to save: refused with the reason before any engine starts,
by the engines themselves where the notebook cannot see their device. The dashboard marks the
host's share beside the bars. On a machine with CUDA, a run equals the same run without it,
with less activation memory on the device (skipped elsewhere; benchmarks/one_gpu.py measures
the device peak with and without)."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.config import ConfigError, TrainConfig
from sagenb.engine.memory import check_offload
from sagenb.metrics import keys
from sagenb.notebook.magics import parse_train_line
from sagenb.pool import cluster

from .boards import new_board, step_metrics
from .models import GPT_CELL, SEQUENTIAL_CELL

REFUSAL = r"--offload-activations True: the engines run on cpu: .* no device memory to save"
CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="this machine's engines would have a CUDA device")
def test_refused_on_cpu_engines_before_any_engine_starts():
    before = cluster.current_pool()
    with pytest.raises(ConfigError, match=REFUSAL):
        sagenb.train(SEQUENTIAL_CELL, offload_activations=True, batch_size=8, dashboard=False)
    assert cluster.current_pool() is before  # no pool started for it


def test_the_flag_and_the_engines_own_check():
    config = parse_train_line("--offload-activations --batch-size 8")
    assert config is not None
    assert config.offload_activations
    with pytest.raises(ConfigError, match=REFUSAL):
        check_offload(True, "cpu")  # what an engine on another host says of its own device
    check_offload(True, "cuda")
    check_offload(False, "cpu")


def test_the_memory_panel_marks_the_activations_on_the_host():
    board = new_board(TrainConfig(engines=2, batch_size=8, offload_activations=True))
    for rank in range(2):
        metrics = step_metrics(1, rank, rank == 0, pipeline=False)
        board.log({**metrics, keys.MEMORY_OFFLOADED: 10.0 + rank}, 1, rank)
    drawn = {t.meta: t for t in board.to_figure().data}
    marks = drawn["offloaded activations"]
    assert marks.visible is not False and marks.name == "activations on host"
    assert list(marks.y) == [10.0, 11.0]
    assert "activations offloaded to the host" in board.header_text()
    plain = new_board(TrainConfig(engines=2, batch_size=8))
    assert {t.meta: t for t in plain.to_figure().data}["offloaded activations"].visible is False


@pytest.mark.skipif(not CUDA, reason="offloading moves CUDA memory to the host: needs a GPU")
def test_on_cuda_a_run_equals_the_same_run_without_it_with_less_on_the_device(pool):
    options = dict(batch_size=16, steps=4, dashboard=False)
    kept = sagenb.train(GPT_CELL, **options)
    offloaded = sagenb.train(GPT_CELL, offload_activations=True, **options)
    # the host copies are exact: only a nondeterministic CUDA kernel could move a bit
    torch.testing.assert_close(offloaded.losses, kept.losses)
    for name, value in kept.state_dict().items():
        torch.testing.assert_close(offloaded.state_dict()[name], value, msg=name)
    last = {m.rank: m.values for m in offloaded.metrics if m.step == 4}
    before = {m.rank: m.values for m in kept.metrics if m.step == 4}
    for rank, values in last.items():
        assert values[keys.MEMORY_OFFLOADED] > 0
        assert values[keys.MEMORY_ACTIVATIONS] < before[rank][keys.MEMORY_ACTIVATIONS]


def test_the_estimate_says_its_device_activations_are_an_upper_bound():
    est = sagenb.estimate(SEQUENTIAL_CELL, offload_activations=True, batch_size=8)
    assert any("--offload-activations holds them in host memory" in a for a in est.assumptions)
