"""Config validation, the job check, cost and the sample order, without engines."""

from __future__ import annotations

import pytest
import torch

from sagenb.config import ConfigError, TrainConfig
from sagenb.config.job import Job, JobError, defined_names
from sagenb.engine.data.order import plan_steps
from sagenb.engine.precision import LossScaler, check_supported
from sagenb.engine.strategies.tensor.plan import check_plan, derive_plan, split_heads
from sagenb.sizing.cost import CostMeter, instance_price

from .models import SPLIT_GPT_CELL


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(batch_size=0), "--batch-size 0: must be an integer >= 1"),
        (dict(epochs=True), "--epochs True: must be an integer >= 1"),
        (dict(lr=float("nan")), "--lr nan: must be a finite number >= 0"),
        (dict(clip_grad_norm=0.0), "--clip-grad-norm 0.0: must be a finite number > 0"),
        (dict(strategy="zero"), "--strategy 'zero': must be one of data, model"),
        (dict(out="2x"), "--out '2x': must be a Python identifier"),
        (dict(engines=4, batch_size=6), "try 4 or 8"),
    ],
)
def test_config_errors_name_the_option_value_and_rule(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig(**options)


def test_defined_names_sees_every_binding_form():
    source = """
import torch
from torch import nn as tnn
model, (dataset, other) = 1, (2, 3)
if True:
    def loss_fn(a, b): ...
for eval_dataset in []: pass
class make_optimizer: ...
"""
    assert {
        "torch",
        "tnn",
        "model",
        "dataset",
        "loss_fn",
        "eval_dataset",
        "make_optimizer",
    } <= defined_names(source)


def test_syntax_error_is_a_job_error():
    with pytest.raises(JobError, match=r"does not parse.*line 1"):
        Job.from_cell("model = (")


@pytest.mark.parametrize(
    "line, says",
    [
        ("%pip install einops", "is IPython syntax (a magic), which the engines do not run"),
        ("!nvidia-smi", "is IPython syntax (a shell command), which the engines do not run"),
        ("x = await asyncio.sleep(0)", "awaits at the top level, which only a kernel's own"),
    ],
)
def test_what_only_a_kernel_runs_is_refused_in_the_notebook_saying_so(line, says):
    """Such lines failed as "invalid syntax (line 1)", and a top-level await only on the
    engines, once they had started."""
    with pytest.raises(JobError) as caught:
        Job.from_cell(f"import asyncio\n{line}\nmodel = 1\ndataset = 2\n")
    assert str(caught.value).startswith(f"the cell's line 2: `{line}` {says}")


def test_cost_follows_the_formula():
    price = instance_price("ml.g5.xlarge")  # 1 GPU per instance
    meter = CostMeter(price, engines=3)
    assert meter.instances == 3
    assert meter.cost(3600) == pytest.approx(3 * price.usd_per_hour)
    assert meter.projected(10, 5, 20) == pytest.approx(meter.cost(40))
    assert CostMeter(instance_price("ml.p4d.24xlarge"), engines=8).instances == 1
    assert price.as_of in meter.label(1.0)


def test_sample_order_is_the_contract():
    steps = list(plan_steps(10, batch_size=3, epochs=2, steps=5, seed=4))
    assert [s.number for s in steps] == [1, 2, 3, 4, 5]
    order0 = torch.randperm(10, generator=torch.Generator().manual_seed(4))
    order1 = torch.randperm(10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(steps[1].indices, order0[3:6])
    assert torch.equal(steps[3].indices, order1[0:3])  # epoch 1 starts over, dropping sample 10


UNEQUAL = """
import torch
from torch import nn
# two heavy blocks at the front, eight light ones behind: equal block counts are unbalanced
model = nn.Sequential(
    nn.Linear(64, 1536), nn.Linear(1536, 1536), nn.Linear(1536, 64),
    *[nn.Linear(64, 64) for _ in range(8)], nn.Linear(64, 1),
)
X = torch.randn(256, 64)
dataset = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
loss_fn = nn.functional.mse_loss
"""


def test_auto_partitioning_balances_unequal_layers():
    from sagenb.engine.objective import Objective
    from sagenb.engine.strategies.pipeline.balance import choose_starts, profile_blocks

    ns: dict = {}
    torch.manual_seed(0)
    exec(UNEQUAL, ns)
    objective = Objective.build(ns["model"], ns["loss_fn"], ns["dataset"][0])
    profile = profile_blocks(ns["model"], ns["dataset"][:64], objective, repeats=9)
    uniform = choose_starts("uniform", 2, profile, blocks=12)
    auto = choose_starts("auto", 2, profile, blocks=12)
    by_params = choose_starts("parameters", 2, profile, blocks=12)
    assert uniform == [0, 6]
    assert auto != uniform and auto[1] <= 3  # the heavy blocks get a stage of their own
    assert by_params == [0, 2]  # 1536x1536 alone outweighs everything after it

    def slowest(starts):
        return max(profile.stage_sums(starts)["seconds"])

    assert slowest(auto) < slowest(uniform)


def test_memory_budget_moves_the_cut():
    from sagenb.engine.strategies.pipeline.balance import BlockProfile, choose_starts

    # four equal-time blocks; block 0 is memory-heavy
    profile = BlockProfile((1.0, 1.0, 1.0, 1.0), (100, 10, 10, 10), (0, 0, 0, 0))
    assert choose_starts("auto", 2, profile, blocks=4) == [0, 2]
    assert choose_starts("auto", 2, profile, blocks=4, memory_budget_bytes=105) == [0, 1]
    with pytest.raises(ValueError, match="no split fits"):
        choose_starts("auto", 2, profile, blocks=4, memory_budget_bytes=50)


def test_bubble_formula():
    from sagenb.engine.strategies.pipeline import bubble_fraction

    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 4, virtual=2) == pytest.approx(3 / 11)


def test_own_price_table_and_price(tmp_path):
    import json

    from sagenb.sizing.cost import meter_for

    table = tmp_path / "prices.json"
    table.write_text(
        json.dumps(
            {
                "source": "my quote",
                "as_of": "2026-11-01",
                "instances": {"my.box": {"usd_per_hour": 2.0, "accelerators": 4}},
            }
        )
    )
    config = TrainConfig(instance="my.box", price_table=str(table), spot_discount=0.5, engines=8)
    meter = meter_for(config, 8)
    assert meter.instances == 2 and meter.cost(3600) == pytest.approx(4.0)
    assert meter.spot(4.0) == pytest.approx(2.0) and meter.price.as_of == "2026-11-01"
    own = meter_for(TrainConfig(instance="ml.g5.xlarge", price_per_hour=1.0), 1)
    assert own.cost(3600) == pytest.approx(1.0) and own.price.source == "--price-per-hour"
    # the table is read where the meter is built, not in the config's validation
    elsewhere = TrainConfig(instance="ml.g5.xlarge", price_table=str(table))
    with pytest.raises(ConfigError, match="--instance 'ml.g5.xlarge': must be one of my.box"):
        meter_for(elsewhere, 1)
    missing = TrainConfig(price_table=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="--price-table .*cannot be read"):
        meter_for(missing, 1)
    with pytest.raises(ConfigError, match="--spot-discount 1.5: must be between 0 and 0.95"):
        TrainConfig(spot_discount=1.5)


def test_tensor_parallel_plan_splits_mlp_pairs_and_attention_by_heads():
    ns: dict = {}
    exec(SPLIT_GPT_CELL, ns)
    plan = derive_plan(ns["model"], 2)
    assert {k: v for k, v in plan.items() if k.startswith("blocks.0.")} == {
        "blocks.0.attn.q": "colwise",
        "blocks.0.attn.k": "colwise",
        "blocks.0.attn.v": "colwise",
        "blocks.0.attn.proj": "rowwise",
        "blocks.0.mlp.0": "colwise",
        "blocks.0.mlp.2": "rowwise",
    }
    assert "head" not in plan  # tied to the embedding: left whole
    split_heads(ns["model"], plan, 2)
    assert ns["model"].blocks[1].attn.n_head == 2
    # a hand plan with torch's styles and '*' (one name, as parallelize_module matches)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    hand = {f"blocks.*.attn.{n}": ColwiseParallel() for n in "qkv"}
    split_heads(ns["model"], {**hand, "blocks.*.attn.proj": RowwiseParallel()}, 2)
    assert ns["model"].blocks[0].attn.n_head == 1
    split_heads(ns["model"], {"*.q": "colwise"}, 2)  # names no module: torch splits nothing
    assert ns["model"].blocks[0].attn.n_head == 1
    with pytest.raises(JobError, match="no Linear pair whose hidden width divides by 3"):
        derive_plan(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), 3)


def test_a_hand_plan_key_that_names_no_module_is_refused():
    ns: dict = {}
    exec(SPLIT_GPT_CELL, ns)
    check_plan(ns["model"], {"blocks.*.mlp.0": "colwise", "blocks.1.attn.proj": "rowwise"})
    with pytest.raises(JobError, match=r"tp_plan\['blocks.\*.mpl.0'\] matches no module"):
        check_plan(ns["model"], {"blocks.*.mlp.2": "rowwise", "blocks.*.mpl.0": "colwise"})
    with pytest.raises(JobError, match="matches no module"):  # '*' is one name, as in torch
        check_plan(ns["model"], {"*.mlp.0": "colwise"})


def test_precision_and_loss_scaler():
    with pytest.raises(ConfigError, match="--precision 'bf16': no autocast on meta"):
        check_supported("bf16", torch.device("meta"))
    p = torch.nn.Parameter(torch.ones(3))
    scaler = LossScaler(init_scale=8.0, growth_interval=2, device=torch.device("cpu"))
    p.grad = torch.tensor([8.0, 16.0, float("inf")])
    assert not scaler.unscale([p]) and scaler.scale == 4.0  # overflow: skip, halve
    p.grad = torch.tensor([4.0, 8.0, 12.0])
    assert scaler.unscale([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    p.grad = torch.ones(3)
    assert scaler.unscale([p]) and scaler.scale == 8.0  # two clean steps: double
    with pytest.raises(ConfigError, match="--tensor-parallel 2: needs --strategy tensor"):
        TrainConfig(tensor_parallel=2)


def test_dashboard_header_names_the_layout():
    from sagenb.display.dashboard import layout_text

    tensor = TrainConfig(strategy="tensor", engines=4, tensor_parallel=2, precision="bf16")
    assert layout_text(tensor) == "tensor: 2-way layer splits x 2 replicas, bf16"
    sharded = TrainConfig(
        strategy="sharded", engines=2, reshard_after_forward=False, activation_checkpointing=True
    )
    assert layout_text(sharded) == "sharded (ZeRO-2) on 2 engines, activation checkpointing"


def test_activations_are_counted_on_a_runs_first_steps_and_then_sampled():
    """Counted on the first three steps of this run (a resumed one starts at step 21), every
    10th and the last; in between the last count stands."""
    from sagenb.engine.memory import MemoryMeter

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    meter = MemoryMeter(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    seen = {}
    for step, rows in ((21, 4), (22, 4), (23, 4), (24, 64), (30, 64), (31, 4), (40, 4)):
        meter.start_step(step, 40)
        with meter.track():
            model(torch.randn(rows, 8)).sum().backward()
        seen[step] = meter.snapshot()["memory/activations(MiB)"]
    assert seen[21] > 0 and seen[21] == seen[22] == seen[23]  # counted from the run's first step
    assert seen[24] == seen[23]  # not counted: the count of step 23 stands
    assert seen[30] > seen[24]  # counted: 64 rows save more than 4
    assert seen[31] == seen[30] and seen[40] == seen[21]  # the last step is counted


def test_saved_activations_stop_counting_when_autograd_drops_them_unused():
    """A forward whose graph is dropped without a backward (PipelineStage's shape inference
    on a first stage, an evaluation run with grad on) holds its saved tensors until the graph
    goes, not for the rest of the step: a count released only by unpacking kept them, and the
    hooks holding a saved output undetached kept the graph itself alive (a leak)."""
    from sagenb.engine.memory import MemoryMeter

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    meter = MemoryMeter(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    meter.start_step(1, 2)
    with meter.track():
        dropped = model(torch.randn(4, 8)).sum()
        one = meter._current
        assert one > 0
        del dropped  # its graph, and the tensors it saved, go now: no cycle holds them
        assert meter._current == 0
        model(torch.randn(4, 8)).sum().backward()
    assert meter._current == 0 and meter.peak_activations == one
    with meter.track():
        leftover = model(torch.randn(4, 8)).sum()  # packed in step 1's count
    meter.start_step(2, 2)
    del leftover
    assert meter._current == 0  # not taken off step 2's


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_prefetching_schedule_posts_receives_first_and_pairs_them_in_order(kind):
    """Each stage posts all of its activations' receives before its first compute and all of
    its gradients' right after its first forward, before any other compute; no action sends
    (each forward and backward hands its sends over as it returns), and the receives from a
    neighbour come in the order of its computes, so of its sends (gloo matches them in order);
    each microbatch's backward follows its forward; 1F1B holds at most p - stage microbatches'
    activations."""
    from sagenb.engine.strategies.pipeline.prefetch_schedule import action_lists, compute_order

    p, m = 4, 8
    lists = action_lists(kind, p, m)
    for s, actions in lists.items():
        kinds = [op for op, _ in actions]
        first_compute = kinds.index("F")
        assert set(kinds[:first_compute]) <= {"RECV_F"}
        assert "RECV_F" not in kinds[first_compute:]
        assert "SEND_F" not in kinds and "SEND_B" not in kinds
        if s < p - 1:  # F0, then every gradient's receive
            after = kinds[first_compute + 1 :]
            assert after[:m] == ["RECV_B"] * m and "RECV_B" not in after[m:]
        else:
            assert "RECV_B" not in kinds
        order = compute_order(kind, p, m, s)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
        in_flight = peak = 0
        for op, _ in order:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak == (m if kind == "gpipe" else min(m, p - s))

    def sequence(stage: int, kind_name: str) -> list[int]:
        return [i for op, i in lists[stage] if op == kind_name]

    def computed(stage: int, op: str) -> list[int]:
        return [i for o, i in compute_order(kind, p, m, stage) if o == op]

    for s in range(p - 1):
        assert computed(s, "F") == sequence(s + 1, "RECV_F") == list(range(m))
        assert computed(s + 1, "B") == sequence(s, "RECV_B") == list(range(m))
