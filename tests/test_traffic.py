"""What the engines' collectives carried, read from torch's flight recorder, and the all-reduce
microbenchmark with its alpha-beta fit (sagenb/sizing/traffic.py, notebook 08)."""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import sagenb
from sagenb.engine.wire.traffic import collectives_since
from sagenb.pool import cluster
from sagenb.sizing.traffic import (
    StepTraffic,
    all_reduce_benchmark,
    fit_alpha_beta,
    measure_traffic,
    typical_step,
)
from tests.conftest import REGRESSION_CELL
from tests.models import SPLIT_GPT_CELL


def test_the_fit_recovers_a_line_and_refuses_too_few_sizes():
    sizes = [4096 * 4**i for i in range(7)]
    fit = fit_alpha_beta({n: 2e-4 + n * 1e-9 for n in sizes})
    assert math.isclose(fit.alpha_s, 2e-4, rel_tol=1e-9)
    assert math.isclose(fit.beta_s_per_byte, 1e-9, rel_tol=1e-9)
    assert math.isclose(fit.half_bytes, 2e5, rel_tol=1e-9)
    assert math.isclose(fit.gb_per_s, 1.0, rel_tol=1e-9)
    # one slow large message moves the relative fit's alpha far less than a plain fit's
    noisy = {n: 2e-4 + n * 1e-9 for n in sizes} | {sizes[-1]: 2 * (2e-4 + sizes[-1] * 1e-9)}
    assert 0 < fit_alpha_beta(noisy).alpha_s < 4e-4
    with pytest.raises(ValueError, match="2 sizes or more"):
        fit_alpha_beta({4096: 1e-3})
    with pytest.raises(ValueError, match="seconds > 0"):
        fit_alpha_beta({4096: 1e-3, 8192: 0.0})


def test_ring_bytes_follow_the_collective_and_its_group():
    step = StepTraffic(1)
    step.add({"kind": "all_reduce", "input_bytes": 1000, "output_bytes": 1000}, 4)
    # all-gather: the group's size from its tensors (8 pieces of 100 bytes), not the world's
    step.add({"kind": "all_gather", "input_bytes": 100, "output_bytes": 800}, 4)
    step.add({"kind": "reduce_scatter", "input_bytes": 800, "output_bytes": 400}, 4)
    assert step.sent == {"all_reduce": 1500.0, "all_gather": 700.0, "reduce_scatter": 400.0}
    assert step.payload == {"all_reduce": 1000, "all_gather": 800, "reduce_scatter": 800}
    step.add({"kind": "all_reduce", "input_bytes": 8, "output_bytes": 8}, 4)
    assert step.messages["all_reduce"] == [1000, 8] and step.calls["all_reduce"] == 2
    later = [StepTraffic(2, sent={"all_reduce": 10.0}), StepTraffic(3, sent={"all_reduce": 30.0})]
    assert typical_step([step, *later]) == {"all_reduce": 20.0}
    with pytest.raises(ValueError, match="none after the first 1"):
        typical_step([step])


def test_the_flight_recorder_names_each_collective_and_its_bytes():
    """A real gloo group of one process: what it ran is what collectives_since reports."""
    since = time.time_ns()
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    group.allreduce([torch.ones(1000)]).wait()
    group.allreduce([torch.ones(10, dtype=torch.float64)]).wait()
    found = collectives_since(since)
    assert found is not None, "this torch build has no flight recorder"
    assert [(c["kind"], c["input_bytes"]) for c in found] == [
        ("all_reduce", 4000),
        ("all_reduce", 80),
    ]
    assert collectives_since(time.time_ns() + 10**9) == []


# 4 MiB of gradients: more than DDP's first bucket (1 MiB) once it rebuilds its buckets
WIDE_CELL = """
import torch
from torch import nn
model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(4)))
X = torch.randn(64, 512)
dataset = torch.utils.data.TensorDataset(X, X.flip(1))
loss_fn = nn.functional.mse_loss
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01)
"""


@pytest.mark.timeout(240)
def test_measured_bytes_per_step_of_data_parallel_and_sharded(pool):
    """DDP sends its gradients once (2(N-1)/N x Psi = Psi on 2 engines), as the estimate says;
    FSDP2 gathers the parameters twice (ZeRO-3) as estimated, and on gloo reduces the gradients
    with an all-reduce where the estimate counts nccl's reduce-scatter."""
    options = dict(batch_size=16, steps=3, dashboard=False)
    psi = 4 * 4 * 512 * 512
    # a run just before on the same engines (as in the suite): its collectives are not this one's
    sagenb.train(REGRESSION_CELL, strategy="sharded", **options)
    since = time.time_ns()
    data = sagenb.train(WIDE_CELL, strategy="data", **options)
    # 2 one-thread engines on this x86-64 host's cores: DDP's buckets went through shared
    # memory (engine/wire/shared_memory.py), each rank's reductions recorded as gloo's are
    pool = cluster.current_pool()
    for rank, eid in enumerate(pool.engine_ids[:2]):
        groups = {c["group"] for c in pool.client[eid].apply_sync(collectives_since, since)}
        assert "shared memory" in groups, (rank, groups)
    steps = measure_traffic(data)
    assert sorted(steps) == [0, 1] and [s.step for s in steps[0]] == [1, 2, 3]
    sent = typical_step(steps[1])
    # sagenb's own reductions (loss, target count) add a few bytes, well under 1%
    assert psi <= sent["all_reduce"] < 1.01 * psi, (sent, psi)
    # the gradients in DDP's buckets (messages over 1 KiB; sagenb's own are a few bytes): one
    # message in the first step, then rebuilt in backward's order, the first capped at 1 MiB
    buckets = [[b for b in s.messages["all_reduce"] if b > 1024] for s in steps[1]]
    assert buckets[0] == [psi], buckets
    assert sum(buckets[-1]) == psi and buckets[-1][0] == 2**20, buckets  # one weight: 1 MiB
    estimate = sagenb.estimate(data.source, data.config).footprint.comm_bytes_per_step[0]
    assert math.isclose(sent["all_reduce"], estimate["all_reduce"], rel_tol=0.01)

    sharded = sagenb.train(SPLIT_GPT_CELL, strategy="sharded", **options)
    sent = typical_step(measure_traffic(sharded)[0])
    estimate = sagenb.estimate(sharded.source, sharded.config).footprint.comm_bytes_per_step[0]
    assert math.isclose(sent["all_gather"], estimate["all_gather"], rel_tol=0.01)
    assert "reduce_scatter" not in sent
    assert math.isclose(sent["all_reduce"], 2 * estimate["reduce_scatter"], rel_tol=0.01)


@pytest.mark.timeout(120)
def test_all_reduce_takes_longer_for_larger_messages(pool):
    times = all_reduce_benchmark([4096, 16 * 2**20], engines=2, repeats=5)
    assert list(times) == [4096, 16 * 2**20]
    # 16 MiB against 4 KiB on this 2-core machine: about 30x when idle, 1.8x in a run with
    # the fast lane's tests on the same cores (a small all-reduce then waits for a core):
    # only the order holds under any load
    assert times[16 * 2**20] > times[4096] > 0, times
    with pytest.raises(ValueError, match="at least 2"):
        all_reduce_benchmark([4096], engines=1)
