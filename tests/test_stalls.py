"""A stalled run says where (issue 19, item 6): the rank that did not finish its step, its
Python stack down to the cell's line, the peers that waited for it in a collective; within
--timeout plus 3 s of the last progress, and the pool trains the next run on the same engines."""

from __future__ import annotations

import re
import time

import pytest

import sagenb
from sagenb.engine.wire import shared_memory
from sagenb.run.failures import StalledError
from sagenb.run.stacks import CELL_FILE, Frame, RankTrace, culprits

from .conftest import REGRESSION_CELL
from .helpers import SHARED_MEMORY, fault_cell

TIMEOUT = 5
#: the issue's bound on the time from the last progress to the error, past --timeout
MARGIN_S = 3.0

# rank 1 spins in the cell's loss_fn at its 3rd call; rank 0 goes on into the step's
# gradient all-reduce and waits there for rank 1
LOOP_CELL = fault_cell("while True: pass  # stuck on purpose", at_call=3)


class LastProgress:
    """A metric sink noting when the notebook last received a step."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def log(self, metrics, step, rank) -> None:
        self.at = time.monotonic()

    def close(self) -> None:
        pass


def stalled(cell: str, **options) -> tuple[StalledError, float]:
    """The StalledError of training `cell`, and how long after the last progress it came."""
    progress = LastProgress()
    with pytest.raises(StalledError) as info:
        sagenb.train(
            cell,
            batch_size=16,
            steps=20,
            timeout=TIMEOUT,
            dashboard=False,
            sinks=[progress],
            **options,
        )
    return info.value, time.monotonic() - progress.at


def test_a_rank_stuck_in_a_loop_is_named_with_its_stack(pool):
    engines = pool.engine_ids
    pids = dict(pool.pids)
    err, late = stalled(LOOP_CELL)
    print(f"\n{err}\n(raised {late:.2f} s after the last progress, --timeout {TIMEOUT})")

    # the culprit, not the victim; the victim said to be waiting, and in what
    assert (err.rank, err.engine_id, err.stuck_ranks) == (1, engines[1], [1])
    assert err.waiting_ranks == [0]
    assert "all_reduce" in err.collectives[0] and err.collectives[1] == ""
    assert re.search(r"rank 1 did not finish step \d+ \(busy in its own code\)", str(err))
    # DDP's gradient all-reduce: through shared memory where every rank is on one x86-64
    # host's cores (engine/wire/shared_memory.py), else gloo's
    assert re.search(
        r"rank 0 was waiting for it in (shared_memory|gloo):all_reduce \(seq ", str(err)
    )
    # the stuck rank's stack ends at the cell's looping line
    assert err.stacks[1].splitlines()[-1].strip() == "while True: pass  # stuck on purpose"
    assert '"<smp_train cell>", line ' in err.stacks[1]
    assert "while True: pass" in str(err)
    assert "backward" in err.stacks[0]  # DDP's all-reduce runs inside backward

    assert late < TIMEOUT + MARGIN_S

    # the ranks were interrupted, not killed: the same engines train the next run
    assert pool.engine_ids == engines and pool.pids == pids
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3


def test_when_every_rank_waits_the_ranks_behind_are_named():
    """Ranks in different collectives (a deadlock) all wait: the stuck ones are those whose
    last reported step is lowest. (Pure: what sagenb/run/stacks.py reads from dumps.)"""
    torch_frame = Frame("/x/torch/distributed/distributed_c10d.py", 1, "recv")
    cell = Frame(CELL_FILE, 3, "loss_fn")
    p2p = {"op": "gloo:recv", "seq": 1, "sizes": [[3]], "group": "default_pg"}
    traces = {
        0: RankTrace(0, [torch_frame], [p2p], collected=True),
        1: RankTrace(1, [torch_frame, cell], [p2p], collected=True),
        2: RankTrace(2, [torch_frame], [p2p], collected=True),
    }
    assert all(t.waiting for t in traces.values())
    assert culprits(traces, {0: 4, 1: 3, 2: 3}) == ([1, 2], [0, 1, 2])
    assert traces[1].collective() == "gloo:recv (seq 1, sizes [[3]])"
    # outermost first, the cell's frame with its own line (the file above has none to show)
    assert traces[1].stack("a = 1\nb = 2\nspin()\n").splitlines() == [
        '  File "<smp_train cell>", line 3, in loss_fn',
        "    spin()",
        '  File "/x/torch/distributed/distributed_c10d.py", line 1, in recv',
    ]


# each rank waits in a receive the other never sends: both blocked in C++, where an interrupt
# never reaches Python, so their engines must be killed. (A rank waiting in the step's
# all-reduce through shared memory waits in Python: interrupted, it releases its peer.)
DEADLOCK_CELL = fault_cell(
    "dist.recv(torch.zeros(1), src=0)  # never sent: a deadlock on purpose",
    at_call=3,
    others="dist.recv(torch.zeros(1), src=1)",
)


# rank 1 calls a collective rank 0 never calls, and rank 0 waits for rank 1's gradients in the
# all-reduce through shared memory: each waits for the other (on gloo the two all-reduces met,
# and gloo aborted the process: tests/test_rough_cases.py)
EXTRA_COLLECTIVE_CELL = fault_cell("dist.all_reduce(torch.ones(3))  # rank 1 only", at_call=3)


def test_a_pipeline_stage_stuck_in_a_loop_is_named_and_its_neighbour_waiting(pool):
    """The last stage spins in its loss; the first waits in gloo for that microbatch's gradient,
    a receive blocked in C++ where no interrupt reaches: its engine is replaced, as a deadlock's
    are (below), and the next pipeline trains."""
    err, late = stalled(LOOP_CELL, strategy="model", partitions=2)
    assert (err.stuck_ranks, err.waiting_ranks) == ([1], [0])
    assert "torch/distributed/" in err.stacks[0]  # the waiting rank's innermost frames
    assert err.stacks[1].splitlines()[-1].strip() == "while True: pass  # stuck on purpose"
    assert late < TIMEOUT + MARGIN_S
    result = sagenb.train(
        REGRESSION_CELL, strategy="model", partitions=2, batch_size=16, steps=3, dashboard=False
    )
    assert len(result.history) == 3 and pool.size == 2


@pytest.mark.skipif(not SHARED_MEMORY, reason="gradients reduced by gloo here")
def test_a_collective_on_one_rank_only_is_named_and_the_engines_kept(pool):
    engines = pool.engine_ids
    err, late = stalled(EXTRA_COLLECTIVE_CELL)
    assert "dist.all_reduce(torch.ones(3))" in err.stacks[1]
    assert "gloo:all_reduce" in err.collectives[1] and "[[3]]" in err.collectives[1]
    assert shared_memory.OP in err.collectives[0]
    assert late < TIMEOUT + MARGIN_S
    # rank 0 waited in Python: interrupted, it released rank 1 (its group destroyed)
    assert pool.engine_ids == engines


def test_a_deadlock_is_named_and_ends_near_the_timeout(pool):
    err, late = stalled(DEADLOCK_CELL)
    assert 1 in err.stuck_ranks
    assert "dist.recv(torch.zeros(1), src=0)" in err.stacks[1]
    assert "their engines replaced" in str(err)
    assert late < TIMEOUT + MARGIN_S
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3 and pool.size == 2


ENDLESS_EVAL_CELL = (
    REGRESSION_CELL
    + """
import itertools
class Endless(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in itertools.count():
            yield torch.zeros(8), torch.zeros(1)
eval_dataset = Endless()
"""
)


def test_an_endless_eval_stream_is_named_as_what_the_ranks_read(pool):
    """Before: "rank 0 did not finish step 2 (busy in its own code)" while every rank was
    reading the eval stream whole at the first evaluation, which never ended."""
    err, _ = stalled(ENDLESS_EVAL_CELL, eval_every=1)
    assert "(reading eval_dataset, a stream read whole at its first evaluation" in str(err)
