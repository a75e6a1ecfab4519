"""What a run does when it goes wrong: every rank ended within seconds, and the error said.

A rank failed, the run stalled, the pool's controller died or the kernel was interrupted:
`Containment` stops the run's ranks (at a step boundary where they still answer, interrupted,
then killed), leaves the engines it killed to be replaced when the pool is next used, and
raises what happened, naming the rank (run/failures.py). It is given the run's pool, tasks
(run/tasks.py), starts (pool/occupancy.py) and stop-request store, and two callbacks of the
run's: `notice` (train's on_failure hook) and `mark_end` (the run's time stops before any
repair); run/training_run.py decides when to call it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from torch.distributed import TCPStore

from sagenb.config.job import JobError
from sagenb.engine.wire import stopping
from sagenb.pool import cluster, occupancy
from sagenb.run import stacks
from sagenb.run.failures import DEAD_ENGINE, PoolDiedError, StalledError, classify
from sagenb.run.tasks import RankTasks

__all__ = ["Containment"]

SETTLE_S = 1.0  # after a failure, how long the other ranks get to end on their own
RELEASE_S = 5.0  # how long ranks get to end after the engines blocking them are killed
STOP_S = 4.0  # after an interrupt, how long ranks get to stop at a step boundary
INTERRUPTED_S = 2.0  # how long the ranks of a stalled run get to end once interrupted


class Containment:
    """Ends one run's ranks on `pool` and raises what happened.

    `ids[rank]` is the rank's engine; `store` and `token` carry a stop request to the ranks
    (engine/wire/stopping.py); `on_failure` is told each failure the notebook notices, and
    `mark_end` is called before anything is repaired.
    """

    def __init__(
        self,
        pool: cluster.EnginePool,
        tasks: RankTasks,
        starts: occupancy.Starts,
        *,
        ids: Sequence[int],
        store: TCPStore,
        token: str,
        on_failure: Callable[[str], None] | None,
        mark_end: Callable[[], None],
    ) -> None:
        self.pool, self.tasks, self.starts = pool, tasks, starts
        self.ids = list(ids)
        self.store: TCPStore | None = store
        self.token = token
        self.on_failure, self.mark_end = on_failure, mark_end

    def ours(self) -> list[int]:
        """The engines of the running ranks that run this run's own task: the only ones to
        signal. A rank still waiting behind another client's task is aborted instead."""
        running = self.tasks.running()
        ours = self.starts.signalable(list(running.values()))
        self.tasks.aborted.update(r for r, eid in running.items() if eid not in ours)
        return ours

    def close(self) -> None:
        """The run has ended: drop its store, whose port closes with the run's reference, not
        when a traceback that holds this object goes."""
        self.store = None

    def _open_store(self) -> TCPStore:
        assert self.store is not None, "the run has ended (close)"
        return self.store

    def request_stop(self) -> None:
        """Ask every rank to stop after the same step (engine/wire/stopping.py)."""
        stopping.request(self._open_store(), self.token)

    def stopped_in_time(self) -> bool:
        """Whether every rank ended within STOP_S of a stop request."""
        return self.tasks.wait_all(STOP_S)

    def interrupt_and_contain(self) -> None:
        """Interrupt the ranks that did not stop, then contain them."""
        self.pool.interrupt(self.ours())
        self.contain()

    def contain(self) -> None:
        """Every rank ends within seconds. The engines that died or were killed are replaced
        when the pool is next used (`train` heals it first), not here: the error reaches the
        cell now, not after a new engine has started (5-20 s on a busy 2-core machine)."""
        self.mark_end()  # repairing the pool is not part of the run's time or cost
        if not self.pool.controller_alive():
            self.pool_died()
        tasks = self.tasks
        self.ours()  # a rank still queued behind another client's task: aborted, not awaited
        if not tasks.wait_all(SETTLE_S):
            # Some rank is still running: blocked in a collective with a failed rank whose
            # connections stayed open, or busy in user code. Kill the failed ranks' engines
            # (a process's death closes its connections), then any rank that still runs.
            self.pool.kill(tasks.ended_engines())
            if not tasks.wait_all(RELEASE_S):
                self.pool.kill(self.ours())
                tasks.wait_all(RELEASE_S)
        # dead engines, and those whose rendezvous failed (engine/entry.py's _join says why)
        self.pool.kill(tasks.to_replace())  # waits until the controller has dropped them

    def stop_ranks(self) -> None:
        """Stop every rank still running: at a step boundary if they stop within STOP_S,
        else interrupted and contained (engines replaced where they had to be killed)."""
        if self.tasks.all_ready():
            return
        try:
            self.request_stop()
        except Exception:  # noqa: BLE001 - the store may be what failed; contain regardless
            pass
        if not self.stopped_in_time():
            self.interrupt_and_contain()

    def pool_died(self) -> NoReturn:
        """The controller is gone, so no rank can report or be told anything: stop the run's
        engines by pid, close the pool (the next run starts a new one) and say so. A pool
        stopped under the run (`%smp_cluster stop` or `restart` from another thread) is being
        ended by whoever stopped it: its engines are theirs to end, not signalled by pids
        that a restarted pool's engines may have taken."""
        self.notice("controller died")  # stopped with its pool, or died on its own
        self.mark_end()
        if self.pool.stopped:
            raise PoolDiedError(
                "the engine pool was stopped or restarted while the run trained (%smp_cluster "
                "stop or restart, or sagenb.pool.cluster.stop_pool/restart_pool from another "
                "thread), so the run cannot go on: its engines are gone with the pool. Run the "
                "cell again: it trains on the running pool, or starts a new one."
            )
        self.pool.check_alive()  # kills the run's engines by pid, closes the pool, raises
        raise PoolDiedError("the engine pool's controller came back after it had died")

    def fail(self, *, drain: Callable[[], None], memory: Callable[[int], Any]) -> NoReturn:
        """A rank failed: contain the others, `drain` what they sent, and raise the first
        failure's error (`memory(rank)`: its last reported memory, for an out-of-memory)."""
        self.notice("rank failed")
        self.contain()
        drain()
        first, ename, evalue = self.tasks.first_failure()
        if ename == "JobError":
            raise JobError(self.tasks.job_error(evalue))
        raise classify(
            ename,
            evalue,
            rank=first,
            engine_id=self.ids[first],
            memory=memory(first),
            death=self._crash_report(first) if ename in DEAD_ENGINE else "",
            host=self._host(first),
        )

    def stall(self, *, steps: dict[int, int], timeout: float, source: str) -> NoReturn:
        """Read where every running rank is (engine/wire/tracing.py, stacks.py), then
        interrupt them: a rank in a Python loop or a sleep ends at once and releases its
        peers, so the engines stay and the pool needs no repair (engines are killed and
        replaced only when they do not end, as after any failure). `steps`: the last step
        each rank reported; `source`: the cell's, for the stacks."""
        self.notice("stalled")
        self.ours()  # only ranks running their own task are read and stopped
        running = self.tasks.running()
        traces = stacks.collect(self.pool, self._open_store(), running)
        stuck, waiting = stacks.culprits(traces, steps)
        self.pool.interrupt(list(running.values()))
        if not self.tasks.wait_all(INTERRUPTED_S):
            # blocked in C++ (a deadlock of collectives), where no interrupt reaches Python:
            # kill now, as contain would only after its own waits, to stay near --timeout
            self.pool.kill(self.ours())
        self.contain()
        replaced = [r for r, eid in running.items() if eid not in self.pool.client.ids]
        what = "their engines replaced" if replaced else "their engines kept"
        raise StalledError(
            stuck[0],
            self.ids[stuck[0]],
            f"no rank reported progress for {timeout:.0f} s (--timeout): "
            f"{stacks.summary(traces, stuck, waiting, steps)}. Last step reported per rank: "
            f"{steps}. The running ranks were stopped and {what}. Raise --timeout if a step "
            f"really takes this long.\n{stacks.describe(traces, stuck, self.ids, source)}",
            stuck_ranks=stuck,
            waiting_ranks=waiting,
            stacks={r: t.stack(source) for r, t in traces.items()},
            collectives={r: t.collective() for r, t in traces.items()},
        )

    def notice(self, kind: str) -> None:
        """Tell `on_failure` (train's hook) that the notebook noticed a failure of `kind`."""
        if self.on_failure is not None:
            try:
                self.on_failure(kind)
            except Exception as err:  # noqa: BLE001 - a hook never keeps the ranks running
                note = f"on_failure raised {err!r}; the run is stopped regardless"
                warnings.warn_explicit(note, RuntimeWarning, "sagenb", 0, module="sagenb")

    def _host(self, rank: int) -> str:
        """Where the rank's engine runs, 'host-b (10.0.0.3)', on a pool that spans hosts."""
        if not self.pool.multi_host:
            return ""
        name, address = self.pool.places.get(self.ids[rank], ("", ""))
        return f"{name} ({address})" if name and address and name != address else name or address

    def _crash_report(self, rank: int) -> str:
        """The dead engine's report of the fatal signal that ended it, read on this host."""
        if self.pool.multi_host:
            return ""
        return stacks.crash_report(self.pool.pids.get(self.ids[rank]))
