"""Failures are contained: a failing, killed, stuck, out-of-memory or interrupted rank never
hangs the others, the cell shows what happened within seconds, the pool heals, nothing leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import sagenb
from sagenb.engine.wire import process_group
from sagenb.engine.wire.rendezvous import bound_store
from sagenb.pool import cluster
from sagenb.pool.cluster import LOOPBACK
from sagenb.run.failures import (
    EngineDiedError,
    OutOfMemoryError,
    StalledError,
    TrainingError,
    TrainingInterrupted,
)
from sagenb.run.interrupts import InterruptLatch

from .conftest import REGRESSION_CELL
from .helpers import LONG, assert_params_equal, check_equal, fault_cell, interrupt_after
from .models import SEQUENTIAL_CELL
from .reference import train_reference


def pids(pool) -> list[int]:
    return [row.pid for row in pool.status()]


def assert_healed(pool, before: list[int], *, replaced: int) -> None:
    """The engines that had to go are gone (no zombie), and the next run replaces them first
    and trains on a full pool."""
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3 and result.engines == len(before)
    after = pids(pool)
    assert pool.size == len(before) and len(set(after) - set(before)) == replaced
    gone = set(before) - set(after)
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) for p in gone) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in gone)  # replaced engines leave no zombie


FAILING_CELL = fault_cell("raise ValueError('bad batch on purpose')")
# rank 0 is busy in user code: nothing but its engine's death stops it
STUCK_CELL = fault_cell("raise ValueError('bad batch on purpose')", others="time.sleep(600)")


def test_a_failing_rank_is_reported_and_the_pool_stays_usable(pool):
    """The failed rank's leaving releases its peer, waiting in the gradients' all-reduce
    (shared memory between these engines, gloo elsewhere): the peer ends on its own, within
    the run's settle time, so no engine is killed and the next run starts at once."""
    before = pids(pool)
    started = time.perf_counter()
    with pytest.raises(
        TrainingError, match=r"(?s)rank 1 \(engine \d+\) failed.*bad batch on purpose"
    ):
        sagenb.train(FAILING_CELL, batch_size=16, steps=20, dashboard=False)
    assert time.perf_counter() - started < 5  # the peer was released, not timed out
    assert_healed(pool, before, replaced=0)


def test_ranks_that_do_not_stop_are_killed_and_replaced(pool):
    pids = [row.pid for row in pool.status()]
    started = time.perf_counter()
    with pytest.raises(TrainingError, match=r"(?s)rank 1 \(engine \d+\) failed.*bad batch"):
        sagenb.train(STUCK_CELL, batch_size=16, steps=20, dashboard=False)
    # the error does not wait for new engines: they start with the next run
    assert time.perf_counter() - started < 15
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3
    new_pids = [row.pid for row in pool.status()]
    assert pool.size == 2 and not set(pids) & set(new_pids)


def test_killed_engine(pool):
    before = pids(pool)
    started = time.perf_counter()
    with pytest.raises(EngineDiedError, match=r"rank 1 \(engine \d+\) failed:\n.*died"):
        sagenb.train(
            fault_cell("os.kill(os.getpid(), signal.SIGKILL)"),
            batch_size=16,
            steps=20,
            dashboard=False,
        )
    assert time.perf_counter() - started < 10  # new engines start with the next run
    assert_healed(pool, before, replaced=1)


def test_stuck_rank_is_stopped_by_the_watchdog(pool):
    before = pids(pool)
    started = time.perf_counter()
    with pytest.raises(StalledError, match=r"no rank reported progress for 3 s \(--timeout\)"):
        sagenb.train(
            fault_cell("while True: pass"), batch_size=16, steps=20, timeout=3, dashboard=False
        )
    assert time.perf_counter() - started < 25
    assert_healed(pool, before, replaced=0)  # interrupted, not killed (tests/test_stalls.py)


def test_out_of_memory_is_reported_as_such(pool):
    with pytest.raises(
        OutOfMemoryError, match=r"rank 1 .* ran out of memory; its last step held"
    ) as info:
        sagenb.train(
            fault_cell("torch.empty(2**42, dtype=torch.uint8)"),
            batch_size=16,
            steps=20,
            dashboard=False,
        )
    assert info.value.memory["memory/params(MiB)"] > 0  # the rank's telemetry of its last step
    assert "can't allocate memory" in str(info.value)


def test_interrupt_stops_every_rank_and_keeps_the_work(pool):
    interrupt_after(3.0)
    started = time.perf_counter()
    with pytest.raises(TrainingInterrupted) as info:
        sagenb.train(REGRESSION_CELL, **LONG)
    stopped = time.perf_counter() - started
    result = info.value.result
    assert result.status == "interrupted" and 0 < len(result.history)
    assert stopped < 3.0 + 5.0  # every rank stopped within 5 s of the interrupt
    steps = len(result.history)
    assert [row["step"] for row in result.history] == list(range(1, steps + 1))
    # the ranks stopped at the same step boundary: the parameters are those of that step
    model, _, _ = train_reference(REGRESSION_CELL, batch_size=2, epochs=200, steps=steps)
    assert_params_equal(result.state_dict(), model)
    assert_healed(pool, pids(pool), replaced=0)


def test_interrupt_stops_four_pipeline_ranks_at_one_step(pool4):
    """Hybrid 2 x 2: rank 3 meets rank 0 in no collective of its own, only through ranks 1 and
    2; all four still stop after the same step (engine/wire/stopping.py)."""
    cell = SEQUENTIAL_CELL.replace("lr=0.05", "lr=0.005")  # stable over hundreds of steps
    options = dict(strategy="hybrid", partitions=2, microbatches=2, batch_size=8, epochs=400)
    interrupt_after(4.0)
    with pytest.raises(TrainingInterrupted) as info:
        sagenb.train(cell, dashboard=False, **options)
    result = info.value.result
    steps = len(result.history)
    assert result.status == "interrupted" and 0 < steps < 400 * 32
    assert [row["step"] for row in result.history] == list(range(1, steps + 1))
    assert all(len(row["rank_losses"]) == 2 for row in result.history)  # both replicas, every step
    model, _, _ = train_reference(cell, batch_size=8, epochs=400, steps=steps)
    assert_params_equal(result.state_dict(), model)
    assert_healed(pool4, pids(pool4), replaced=0)


def test_interrupt_in_the_magic_keeps_the_result(pool):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sagenb")
    interrupt_after(3.0)
    with pytest.raises(KeyboardInterrupt):
        shell.run_cell_magic("smp_train", "--batch-size 2 --epochs 200 --out part", REGRESSION_CELL)
    assert shell.user_ns["part"].status == "interrupted"
    assert shell.user_ns["part"].dashboard.status == "interrupted"  # the header says so too


def listening_ports(procs) -> set[int]:
    ports = set()
    for proc in procs:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                assert conn.laddr.ip == "127.0.0.1"  # nothing beyond loopback
                ports.add(conn.laddr.port)
    return ports


def test_stop_leaves_no_process_and_no_port(pool):
    procs = cluster._pool_processes()
    ports = listening_ports(procs)
    assert len(procs) >= 5 and ports  # controller, 2 nannies, 2 engines
    cluster.stop_pool()
    assert not any(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE for proc in procs)
    bound = {c.laddr.port for c in psutil.net_connections(kind="inet") if c.status == "LISTEN"}
    assert not ports & bound


def test_connection_files_are_owner_only(pool):
    security = os.path.dirname(pool.cluster.cluster_file)
    own = [f for f in os.listdir(security) if pool.cluster.cluster_id in f]
    assert own
    for name in own:
        assert os.stat(os.path.join(security, name)).st_mode & 0o077 == 0, name


KERNEL = """
import sagenb
pool = sagenb.start_pool(2)
print(" ".join(str(row.pid) for row in pool.status()), flush=True)
# the kernel exits without stopping the pool
"""


@pytest.mark.pool  # starts a pool itself, with no fixture to show it
def test_kernel_exit_leaves_no_engine():
    out = subprocess.run(
        [sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=120, check=True
    )
    engine_pids = [int(p) for p in out.stdout.split()]
    assert len(engine_pids) == 2
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) for p in engine_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in engine_pids)


class _BrokenSink:
    """A metric sink that fails at its third record: an error on the notebook's side."""

    def __init__(self) -> None:
        self.seen = 0

    def log(self, metrics, step, rank) -> None:
        self.seen += 1
        if self.seen == 3:
            raise RuntimeError("the sink broke on purpose")

    def close(self) -> None:
        pass


def test_a_notebook_side_error_stops_every_rank(pool):
    """One place ends a run: the sink's error propagates only after every rank has stopped,
    so no engine trains on into the next run."""
    with pytest.raises(RuntimeError, match="the sink broke on purpose") as info:
        sagenb.train(
            REGRESSION_CELL, batch_size=8, epochs=200, dashboard=False, sinks=[_BrokenSink()]
        )
    failed = info.value.result  # the failed run as far as it went
    assert failed.status == "failed" and len(failed.history) >= 1
    busy = {
        eid: q["tasks"] + q["queue"]
        for eid, q in pool.client.queue_status().items()
        if isinstance(q, dict)
    }
    assert set(busy.values()) == {0}, f"engines still busy after the error: {busy}"
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False)
    assert len(result.history) == 3


def test_a_failed_rendezvous_leaves_nothing_behind(pool):
    """An engine whose init_process_group raises (it was started with an environment naming a
    gloo transport this torch lacks) fails the run and is replaced: torch reads that setting
    once per process, and had numbered its default group already (pytorch/pytorch#46561), so
    the kept engine failed every later run, or waited under other store keys than its peer's
    until --timeout. The next run trains at once, as one process, on a new engine.

    The engine is started with the variable: one set later by `%px os.environ[...]` is removed
    before the run (engine/clean_slate.py), and that run trains."""
    pool.kill(pool.engine_ids)
    # the lowest engine id, so rank 0 of a one-engine run
    bad = {"GLOO_DEVICE_TRANSPORT": "no-such-transport"}
    pool.cluster.start_engines_sync(n=1, environment=bad)
    pool.client.wait_for_engines(1, timeout=120, interactive=False)
    pool.heal()  # the others, and every engine warmed (its starting state noted)
    first = pool.engine_ids[0]
    with pytest.raises(TrainingError, match=r"(?s)init_process_group failed; this engine is "):
        sagenb.train(REGRESSION_CELL, engines=1, batch_size=16, steps=3, dashboard=False)
    assert first not in pool.client.ids
    started = time.perf_counter()
    result = sagenb.train(REGRESSION_CELL, batch_size=16, steps=3, dashboard=False, timeout=60)
    assert time.perf_counter() - started < 30  # a new engine's start included
    check_equal(result, REGRESSION_CELL, batch_size=16, steps=3)


def test_a_failed_rendezvous_is_forgotten_by_the_engine():
    """Another local process writes garbage where gloo reads rank 1's address (the store lists
    its keys to anyone): rank 0's init_process_group raises, having numbered its group already.
    The engine's shutdown numbers the next one as a fresh process does, under "0/" keys."""
    garbled = bound_store(LOOPBACK, 2, 5)
    garbled.set("0//cpu//0/1", b"not an address")
    where = dict(addr=LOOPBACK, timeout_s=5, device=torch.device("cpu"))
    with pytest.raises(Exception):  # noqa: B017 - as the bytes decode: MemoryError, ValueError...
        process_group.init_process_group(rank=0, world_size=2, port=garbled.port, **where)
    process_group.shutdown()
    fresh = bound_store(LOOPBACK, 1, 5)
    process_group.init_process_group(rank=0, world_size=1, port=fresh.port, **where)
    try:
        gloo_keys = [k for k in fresh.list_keys() if not k.startswith("sagenb/")]
        assert gloo_keys and all(k.startswith("0/") for k in gloo_keys), gloo_keys
    finally:
        process_group.shutdown()


def test_an_interrupt_python_swallowed_is_raised_at_the_runs_next_check(monkeypatch):
    """SIGINT handled inside a __del__ (as the garbage collector runs them, or a weakref's
    callback) raises a KeyboardInterrupt Python only reports as unraisable: the run would go on.
    The latch a run follows its ranks under raises it at its next check."""
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))

    class InterruptedWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100_000):  # the handler runs in here
                pass

    def swallowed(latch: InterruptLatch) -> None:
        with latch:
            InterruptedWhileCollected()  # collected at once, interrupted in __del__
            assert isinstance(unraisable.pop(), KeyboardInterrupt)
            latch.check()

    with pytest.raises(KeyboardInterrupt):
        swallowed(InterruptLatch())
    previous = signal.getsignal(signal.SIGINT)
    with InterruptLatch() as latch:  # raised where it landed: answered, nothing pending
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100_000):
                pass
        latch.answered()
        latch.check()
    assert signal.getsignal(signal.SIGINT) is previous
