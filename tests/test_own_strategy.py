"""--strategy own (sagenb/engine/strategies/own.py): the cell's own DDP class synchronises the
gradients over the process group sagenb set up, on 2 real engines with gloo, and the run
equals the one-process reference of the contract (SGD, so the gradients are proved, not an
optimizer's rounding). The three DDPs below are the first steps of a course's assignment:
one all-reduce a parameter after backward, one flattened all-reduce, and all-reduces started
from the gradients' hooks while backward goes on. A DDP that leaves the replicas apart fails
the run, naming the step and the parameter."""

from __future__ import annotations

import pytest

import sagenb
from sagenb.config import ConfigError
from sagenb.sizing.traffic import measure_traffic, typical_step

from .conftest import REGRESSION_CELL, SGD_MOMENTUM
from .helpers import check_equal

NAIVE = """
import torch.distributed as dist

class DDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():  # every replica starts from rank 0's parameters
            dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
"""

FLAT = NAIVE.replace(
    """        for p in self.module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
""",
    """        grads = [p.grad for p in self.module.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
""",
)

OVERLAPPED = """
import torch.distributed as dist

class DDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.handles = []
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
            p.register_post_accumulate_grad_hook(self._started)

    def _started(self, p):  # p's gradient is complete: reduce it while backward goes on
        self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p, handle in self.handles:
            handle.wait()
            p.grad /= dist.get_world_size()
        self.handles.clear()
"""

#: no synchronisation at all: each replica follows its own share of the batch
APART = NAIVE.replace(
    """        for p in self.module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
""",
    """        pass
""",
)


@pytest.mark.parametrize("ddp", [NAIVE, FLAT, OVERLAPPED], ids=["naive", "flat", "overlapped"])
def test_a_cells_own_ddp_equals_one_process(pool, ddp):
    cell = REGRESSION_CELL + SGD_MOMENTUM + ddp
    result = sagenb.train(cell, strategy="own", batch_size=32, steps=6, dashboard=False)
    assert result.engines == 2 and len(result.history) == 6
    check_equal(result, cell, batch_size=32, steps=6)
    # the ranks saw different samples, so the equality above is the synchronisation's
    assert all(row["rank_losses"][0] != row["rank_losses"][1] for row in result.history)
    # what the cell's collectives carried: the gradients, 2(N-1)/N = 1 x their bytes a step
    grads = sum(p.numel() for p in pool_model_parameters()) * 4
    sent = typical_step(measure_traffic(result)[0])
    assert sent.get("all_reduce", 0) >= grads
    # what the DDP overlapped with backward: the hooks' all-reduces began during it
    shares = [m.values["overlapped"] for m in result.metrics if "overlapped" in m.values]
    assert len(shares) == 12  # every step, on both ranks
    if ddp is OVERLAPPED:
        assert min(shares) >= 0.99
    else:
        assert max(shares) == 0.0
    counts = {m.values["all_reduces"] for m in result.metrics if "all_reduces" in m.values}
    assert counts == ({1} if ddp is FLAT else {4})  # 4 parameters, or one flat tensor
    bytes_ = {m.values["all_reduced(B)"] for m in result.metrics if "all_reduced(B)" in m.values}
    assert bytes_ == {grads}


def pool_model_parameters():
    ns: dict = {}
    exec(REGRESSION_CELL, ns)
    return list(ns["model"].parameters())


def test_replicas_left_apart_fail_the_run_with_the_step_and_the_parameter(pool):
    cell = REGRESSION_CELL + SGD_MOMENTUM + APART
    with pytest.raises(Exception, match=r"after step 1 the replicas' parameters differ \(by "):
        sagenb.train(cell, strategy="own", batch_size=32, steps=3, dashboard=False)
    # the pool is fine afterwards: the next run trains
    cell = REGRESSION_CELL + SGD_MOMENTUM + NAIVE
    check_equal(
        sagenb.train(cell, strategy="own", batch_size=32, steps=2, dashboard=False),
        cell,
        batch_size=32,
        steps=2,
    )


def test_a_cell_without_ddp_and_grad_accum_are_refused(pool):
    with pytest.raises(Exception, match=r"--strategy own trains with the cell's own class DDP"):
        sagenb.train(REGRESSION_CELL, strategy="own", batch_size=32, steps=1, dashboard=False)
    with pytest.raises(ConfigError, match=r"--grad-accum 2: must be 1 with --strategy own"):
        sagenb.train(
            REGRESSION_CELL + NAIVE, strategy="own", grad_accum=2, batch_size=32, dashboard=False
        )


def test_the_estimate_prices_your_own_ddp_as_a_ring_all_reduce():
    cell = REGRESSION_CELL + SGD_MOMENTUM + NAIVE
    own = sagenb.estimate(cell, strategy="own", engines=4, batch_size=32)
    data = sagenb.estimate(cell, strategy="data", engines=4, batch_size=32)
    sent = own.footprint.comm_bytes_per_step[0]
    assert sent == data.footprint.comm_bytes_per_step[0]
    grads = sum(p.numel() for p in pool_model_parameters()) * 4
    assert sent["all_reduce"] == pytest.approx(2 * 3 / 4 * grads)
