"""A run's own tasks on the pool, one per rank: which are done, which failed and how, and
which rank's error to show.

Everything the notebook does to engines when a run goes wrong (interrupt, kill, replace) is
aimed at the engines of these tasks, by rank: run/training_run.py decides when,
run/containment.py how, and this module says which.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ipyparallel.error import EngineError

from sagenb.engine.entry import RendezvousFailed
from sagenb.run.failures import DEAD_ENGINE, lost_a_peer, on_some_ranks

__all__ = ["RankTasks"]

WAIT_POLL_S = 0.05  # how often waiting looks at the tasks again


class RankTasks:
    """The run's task per rank (`ars[rank]`), on engine `ids[rank]`."""

    def __init__(self, ars: Sequence[Any], ids: Sequence[int]) -> None:
        self.ars, self.ids = list(ars), list(ids)
        #: ranks whose task was aborted while it waited behind another client's task on its
        #: engine: they count as ended (the engine drops the task when it reaches it)
        self.aborted: set[int] = set()

    def __len__(self) -> int:
        return len(self.ars)

    def all_ready(self) -> bool:
        return all(ar.ready() or r in self.aborted for r, ar in enumerate(self.ars))

    def wait_all(self, timeout: float) -> bool:
        """Whether every task ended within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.all_ready():
            if time.monotonic() > deadline:
                return False
            time.sleep(WAIT_POLL_S)
        return True

    def running(self) -> dict[int, int]:
        """rank -> engine id, of the tasks still running."""
        return {
            r: self.ids[r]
            for r, ar in enumerate(self.ars)
            if not ar.ready() and r not in self.aborted
        }

    def ended_engines(self) -> list[int]:
        return [self.ids[r] for r, ar in enumerate(self.ars) if ar.ready()]

    def failed(self) -> list[int]:
        """The ranks whose task ended with an error."""
        return [r for r, ar in enumerate(self.ars) if ar.ready() and not ar.successful()]

    def died(self, rank: int) -> bool:
        """The rank's engine died (or was killed) under its task."""
        ar = self.ars[rank]
        if not ar.ready() or ar.successful():
            return False
        err = ar.exception()
        return isinstance(err, EngineError) or getattr(err, "ename", "") in DEAD_ENGINE

    def rendezvous_failed(self, rank: int) -> bool:
        """The rank's init_process_group raised: its engine must go (engine/entry.py's _join)."""
        ar = self.ars[rank]
        return (
            ar.ready()
            and not ar.successful()
            and getattr(ar.exception(), "ename", "") == RendezvousFailed.__name__
        )

    def to_replace(self) -> list[int]:
        """The engines that died, or whose rendezvous failed."""
        ranks = range(len(self.ars))
        return [self.ids[r] for r in ranks if self.died(r) or self.rendezvous_failed(r)]

    def first_failure(self) -> tuple[int, str, str]:
        """The rank to report, its error's name and its message: one with an error of its
        own before one that only lost a peer (a failing rank releases its peers before its own
        task completes), then the first to complete."""

        def blame(rank: int) -> tuple[bool, datetime]:
            err = self.ars[rank].exception()
            completed = self.ars[rank].metadata.get("completed") or datetime.max
            return lost_a_peer(str(getattr(err, "evalue", err))), completed

        first = min(self.failed(), key=blame)
        err = self.ars[first].exception()
        return first, getattr(err, "ename", type(err).__name__), getattr(err, "evalue", str(err))

    def job_error(self, evalue: str) -> str:
        """The cell's error, naming the ranks it came from when not every rank raised it."""
        ranks = [
            r
            for r, ar in enumerate(self.ars)
            if ar.ready() and getattr(ar.exception(), "ename", "") == "JobError"
        ]
        return on_some_ranks(evalue, ranks, len(self.ars))
