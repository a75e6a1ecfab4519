"""Mixture-of-experts models as they come: a transformers Qwen2-MoE from its config (4 experts,
2 per token, a shared expert), its routing and packed experts its own, trained data parallel,
sharded, tensor parallel and pipelined on 2 real engines against the one-process reference.
Tensor parallel takes the model's own plan, whose expert entries (`packed_colwise`,
`moe_tp_experts`) torch's styles cannot apply: the experts stay whole, the run says so, and
attention and the shared expert are split (issue 30 item 3). The estimate of each run, on fake
tensors (transformers computes the experts with torch._grouped_mm, whose fake kernel took bf16
alone: every estimate of such a model failed), against the engines' measured memory."""

from __future__ import annotations

import pytest

import sagenb

from .helpers import LIMITS, check_equal
from .models import MOE_CELL

OPTIONS = dict(batch_size=16, steps=3)


@pytest.mark.parametrize("strategy", ["data", "sharded", "tensor", "model"])
def test_a_transformers_moe_trains_like_one_process(pool, strategy):
    split = {"partitions": 2} if strategy == "model" else {}
    result = sagenb.train(MOE_CELL, strategy=strategy, dashboard=False, **split, **OPTIONS)
    check_equal(result, MOE_CELL, **OPTIONS)
    # the estimate, on fake tensors, against what the engines measured (the project's limits:
    # benchmarks/estimate_accuracy.py; measured 0% for the states, 1-5% for activations)
    est = sagenb.estimate(MOE_CELL, strategy=strategy, engines=2, **split, **OPTIONS)
    for rank, values in enumerate(est.ranks):
        measured = next(
            r.values for r in result.metrics if r.step == OPTIONS["steps"] and r.rank == rank
        )
        for kind, limit in LIMITS.items():
            key = f"memory/{kind}(MiB)"
            assert values[key] == pytest.approx(measured[key], rel=limit), (rank, kind)
    kept = [w for w in result.warnings if "experts" in w]
    if strategy != "tensor":
        assert not kept
        return
    assert len(kept) == 1 and "'model.layers.*.mlp.experts': 'moe_tp_experts'" in kept[0]
    assert "packed_colwise" in kept[0] and "stay whole on every engine" in kept[0]
    assert "--strategy data --expert-parallel E spreads the experts" in kept[0]
    # attention and the shared expert split: each engine holds less than the whole model
    whole = sagenb.train(MOE_CELL, strategy="data", dashboard=False, **OPTIONS)
    key, last = "memory/params(MiB)", OPTIONS["steps"]
    split = [rec.values[key] for rec in result.metrics if rec.step == last]
    assert max(split) < 0.95 * whole.metrics[-1].values[key], (split, whole.metrics[-1].values)
