"""BatchNorm trains as one process would, and what cannot is said (sagenb issue 15).

Without synchronisation each engine's BatchNorm normalises its own share of the batch and a
data-parallel ResNet ends far from one process's (0.11 in the issue); GlobalBatchNorm
(engine/model/sync_batchnorm.py) normalises over the global batch. What no engine can fix
(BatchNorm per accumulation slice or microbatch, dropout drawn per engine) is warned.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import sagenb
from sagenb.config import TrainConfig
from sagenb.engine.model.equivalence import EquivalenceWarning, equivalence_warnings
from sagenb.engine.wire.rendezvous import bound_store
from sagenb.pool import cluster

from .conftest import REGRESSION_CELL, SGD_MOMENTUM
from .helpers import check_equal
from .models import GPT_CELL, RESNET_CELL
from .reference import namespace

TOL = 1e-5

DROPOUT_CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
X = torch.randn(64, 8)
dataset = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
loss_fn = nn.functional.mse_loss
"""


@pytest.mark.parametrize("strategy", ["data", "sharded"])
def test_resnet_equals_one_process(pool, strategy):
    result = sagenb.train(RESNET_CELL, strategy=strategy, batch_size=32, dashboard=False)
    assert len(result.history) == 8
    check_equal(result, RESNET_CELL, batch_size=32)
    assert result.warnings == []


def test_grad_accum_warns_and_matches_one_process_accumulating(pool):
    with pytest.warns(EquivalenceWarning, match="--grad-accum 2 slices") as caught:
        result = sagenb.train(RESNET_CELL, batch_size=32, grad_accum=2, steps=4, dashboard=False)
    assert len(result.warnings) == 1 and len(caught) == 1  # once per run, not per rank or step
    assert result.warnings[0].startswith("BatchNorm (bn1, layer1.0.bn1, layer1.0.bn2 and 12 more)")
    assert "statistics are those of 16 samples" in result.warnings[0]
    assert "use --grad-accum 1, or use GroupNorm/LayerNorm" in result.warnings[0]
    assert result.history[0]["warnings"] == result.warnings
    # the slices are normalised over both engines' samples: one process accumulating alike
    check_equal(result, RESNET_CELL, batch_size=32, grad_accum=2, steps=4)


def test_dropout_warns_and_a_plain_model_does_not(pool, recwarn):
    with pytest.warns(EquivalenceWarning, match=r"dropout \(2\) draws its masks on each engine"):
        result = sagenb.train(DROPOUT_CELL, batch_size=16, steps=2, dashboard=False)
    assert len(result.warnings) == 1
    recwarn.clear()
    plain = sagenb.train(REGRESSION_CELL + SGD_MOMENTUM, batch_size=32, steps=2, dashboard=False)
    assert plain.warnings == []
    assert not [w for w in recwarn if issubclass(w.category, EquivalenceWarning)]


# -- GlobalBatchNorm against nn.BatchNorm on the whole batch, on two real engines ----------------

SHARES = (3, 5)  # unequal on purpose: the global statistics weight each rank by its count


def _inputs(cls: type, shape: tuple[int, ...]):
    torch.manual_seed(0)
    bn = cls(shape[1], momentum=None if cls is nn.BatchNorm1d else 0.1)
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    x = torch.randn(sum(SHARES), *shape[1:]) * 3 + 1
    return bn, x, torch.randn_like(x)  # the loss is (y * w).sum()


CASES = [
    (nn.BatchNorm2d, (0, 3, 4, 4)),
    (nn.BatchNorm1d, (0, 5)),
    (nn.BatchNorm3d, (0, 2, 2, 3, 2)),
]


def _rank_pass(rank: int, port: int) -> list[dict]:
    """On an engine: two training steps of each case's GlobalBatchNorm on this rank's share."""
    from sagenb.engine.model.sync_batchnorm import sync_batchnorm
    from sagenb.engine.wire import process_group

    process_group.init_process_group(
        rank=rank,
        world_size=2,
        addr="127.0.0.1",
        port=port,
        timeout_s=60,
        device=torch.device("cpu"),
    )
    try:
        out = []
        for cls, shape in CASES:
            bn, x, w = _inputs(cls, shape)
            sync_batchnorm(bn, device=torch.device("cpu"))
            mine = slice(0, SHARES[0]) if rank == 0 else slice(SHARES[0], None)
            for _ in range(2):
                xs = x[mine].clone().requires_grad_()
                y = bn(xs)
                (y * w[mine]).sum().backward()
            out.append(
                {
                    "y": y.detach(),
                    "dx": xs.grad,
                    "state": bn.state_dict(),
                    "dweight": bn.weight.grad,
                    "dbias": bn.bias.grad,
                }
            )
        return out
    finally:
        process_group.shutdown()


def test_global_batchnorm_equals_batchnorm_on_the_whole_batch(pool):
    store = bound_store(cluster.LOOPBACK, 2, 60.0)
    ars = pool.submit(_rank_pass, [(0, store.port), (1, store.port)])
    ranks = [ar.get(timeout=120) for ar in ars]
    for i, (cls, shape) in enumerate(CASES):
        bn, x, w = _inputs(cls, shape)
        for _ in range(2):
            xs = x.clone().requires_grad_()
            y = bn(xs)
            (y * w).sum().backward()
        parts = [r[i] for r in ranks]
        close = dict(rtol=0, atol=TOL)
        torch.testing.assert_close(torch.cat([p["y"] for p in parts]), y.detach(), **close)
        torch.testing.assert_close(torch.cat([p["dx"] for p in parts]), xs.grad, **close)
        # weight and bias: each rank's own share of the sum (DDP / FSDP add them up)
        torch.testing.assert_close(
            parts[0]["dweight"] + parts[1]["dweight"], bn.weight.grad, **close
        )
        torch.testing.assert_close(parts[0]["dbias"] + parts[1]["dbias"], bn.bias.grad, **close)
        for part in parts:  # running stats (unbiased over 8 samples), num_batches_tracked
            torch.testing.assert_close(part["state"], bn.state_dict(), **close)


# -- which causes warn, from the model and the config alone (no engines) -------------------------


def _model(cell: str) -> nn.Module:
    return namespace(cell, 0)["model"]


def test_warnings_name_cause_and_remedy():
    resnet = _model(RESNET_CELL)
    pipe = TrainConfig(strategy="model", partitions=2, microbatches=4, batch_size=32)
    (text,) = equivalence_warnings(resnet, pipe.with_engines(2))
    assert "each pipeline microbatch on its own (--microbatches 4), as in GPipe" in text
    assert "use --microbatches 1, or use GroupNorm/LayerNorm" in text
    one = dataclasses.replace(pipe, microbatches=1, schedule="gpipe")
    assert equivalence_warnings(resnet, one.with_engines(2)) == []
    hybrid = TrainConfig(
        strategy="hybrid", partitions=2, microbatches=1, schedule="gpipe", batch_size=32
    )
    (text,) = equivalence_warnings(resnet, hybrid.with_engines(4))
    assert "not synchronised across the 2 replicas of --strategy hybrid" in text
    assert (
        equivalence_warnings(resnet, TrainConfig(strategy="sharded", batch_size=32, engines=2))
        == []
    )
    assert equivalence_warnings(_model(GPT_CELL), TrainConfig(engines=2)) == []


def test_checkpointed_batchnorm_warns():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    config = TrainConfig(activation_checkpointing=True, engines=1)
    (text,) = equivalence_warnings(model, config)
    assert text.startswith("BatchNorm (1) inside a block that --activation-checkpointing")


def test_transformers_config_dropout_warns():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_dropout=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config)
    (text,) = equivalence_warnings(model, TrainConfig(engines=2))
    assert text.startswith("dropout (the model (config.attention_dropout=0.1)) draws")
    assert equivalence_warnings(model, TrainConfig(engines=1)) == []


def test_a_checkpointed_batchnorm_recomputes_the_global_forward():
    from sagenb.engine.model.recompute import checkpoint_blocks
    from sagenb.engine.model.sync_batchnorm import GlobalBatchNorm, sync_batchnorm

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    checkpoint_blocks(model)  # wraps each block's forward on the instance, before strategies
    sync_batchnorm(model, device=torch.device("cpu"))
    bn = model[1]
    assert isinstance(bn, GlobalBatchNorm) and isinstance(bn, nn.BatchNorm1d)
    assert bn.forward.args[0].__func__ is GlobalBatchNorm.forward  # rewrapped, not the old one
    assert list(model.state_dict()) == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
        "3.weight",
        "3.bias",
    ]
