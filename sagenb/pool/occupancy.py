"""What else runs on the pool's engines, and whose it is, as the pool's controller tells.

An engine runs one task at a time, in the order the controller forwarded them to it. The
controller (ipyparallel's hub) keeps each engine's pending tasks in that order
(`Client.queue_status(verbose=True)`: its "queue", the first running or next to run), and a
record of each (`Client.db_query`): its header names the submitting client's session and user,
and when it was submitted. The hub records when a task started only once it has completed
(ipyparallel 9.2, controller/hub.py `save_queue_result`; the client's
`AsyncResult.metadata["started"]` likewise comes with the reply), so a pending task's start is
told by its place: a task at the head of its engine's queue has started, one behind another
client's task has not.

Two callers: a run about to start asks which of its engines still run someone's task
(pool/orphans.py), and a running run asks whether its own tasks have started, so that its
stall clock does not run, and no engine is signalled, while they wait behind another client's
(`Starts`, used by run/training_run.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from sagenb.pool import waits
from sagenb.pool.cluster import EnginePool

__all__ = ["Task", "pending", "Starts", "QUERY_S"]

#: how long the controller gets to answer a query (it answers in milliseconds; a controller
#: that does not is dead or stopped, which the run notices on its own)
QUERY_S = 5.0
CHECK_S = 1.0  # how often a running run asks whether its tasks still wait

T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    """A task pending on an engine, as the controller knows it."""

    msg_id: str
    engine_id: int
    #: the head of its engine's queue (running, or the next to run); None: not known, as for
    #: the first of an engine's tasks when some were sent to it and some load-balanced
    running: bool | None
    session: str = ""  # the submitting client's session id ("" when the hub keeps no records)
    user: str = ""
    submitted: datetime | None = None

    def describe(self, whose: str | None = None) -> str:
        """'task <msg_id> of client session 1f2e3d4c of user ann on engine 1 (running,
        submitted 19:02:11 UTC, 42 s ago)': whose it is as ipyparallel tells, or `whose`
        ("" leaves it out)."""
        whose = self.origin() if whose is None else whose
        text = f"task {self.msg_id}{f' ({whose})' if whose else ''} on engine {self.engine_id}"
        state = {True: "running", False: "queued", None: "pending"}[self.running]
        if self.submitted is None:
            return f"{text} ({state})"
        when = self.submitted.astimezone(timezone.utc)
        ago = max(0.0, (datetime.now(timezone.utc) - when).total_seconds())
        return f"{text} ({state}, submitted {when:%H:%M:%S} UTC, {ago:.0f} s ago)"

    def origin(self) -> str:
        """Whose it is, as ipyparallel tells: the submitting client's session and user."""
        if not self.session:
            return "submitter unknown: the controller keeps no task records"
        return f"client session {self.session[:8]} of user {self.user or '?'}"


def pending(pool: EnginePool, engine_ids: Sequence[int]) -> dict[int, list[Task]] | None:
    """engine id -> the tasks pending on it, the running one first; None when the controller
    did not answer within QUERY_S."""
    ids = [e for e in engine_ids if e in pool.client.ids]
    if not ids:
        return {}
    try:
        status = _bounded(lambda: pool.client.queue_status(targets=ids, verbose=True))
    except Exception:  # noqa: BLE001 - an engine gone since: ask again next time
        return None
    if status is None:
        return None
    # "queue": tasks sent to this engine (a view of it, %px), in order; "tasks": load-balanced
    # ones the scheduler gave it, in no known order against the first
    queues = {e: [*status[e]["queue"], *status[e]["tasks"]] for e in ids if e in status}
    records = _records(pool, [m for q in queues.values() for m in q])
    return {e: _tasks(e, queue, status[e], records) for e, queue in queues.items()}


def _tasks(eid: int, queue: list[str], status: Mapping, records: Mapping) -> list[Task]:
    """The engine's pending tasks, the first marked running, unless the engine has both kinds
    (then which of the two firsts runs is not known)."""
    first: bool | None = True if not (status["queue"] and status["tasks"]) else None
    return [
        _task(m, eid, first if i == 0 else False, records.get(m, {})) for i, m in enumerate(queue)
    ]


class Starts:
    """Whether a run's own tasks (rank r's on engine `ids[r]`) have started, or wait behind
    another client's task on their engine. The controller is asked only until every one has
    started: then (nothing can come before a task that has started) never again."""

    def __init__(
        self,
        pool: EnginePool,
        ids: Sequence[int],
        msg_ids: Sequence[str],
        *,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.own = dict(zip(ids, msg_ids))  # engine id -> the run's task there
        self.rank = {eid: r for r, eid in enumerate(ids)}
        self.started: set[int] = set()
        self.note = note or _STDERR_NOTE
        #: what the run waited for, once its tasks have all started (None: it did not wait)
        self.waited: str | None = None
        self._asked = -CHECK_S
        self._since: float | None = None  # when a task was first seen waiting
        self._waits = False  # whether one waited at the last answer
        self._ahead = ""

    @property
    def all_started(self) -> bool:
        return self.started >= set(self.own)

    def waiting(self) -> bool:
        """Whether a run task waits behind another client's task, asked at most once every
        CHECK_S; said under the cell while one does (one line, rewritten), and once none
        does. While one does, the run's stall clock does not run: it starts once the run's
        tasks have (run/training_run.py)."""
        now = time.monotonic()
        if self.all_started or now - self._asked < CHECK_S:
            return self._waits and not self.all_started
        self._asked = now
        blocked = self.blocked()
        if blocked is None:  # no answer: as at the last one
            return self._waits
        self._waits = bool(blocked)
        if blocked:
            self._since = now if self._since is None else self._since
            self._ahead = "; ".join(
                f"rank {self.rank[eid]}'s task waits behind {t.describe()}"
                for eid, tasks in sorted(blocked.items())
                for t in tasks
            )
            self.note(
                f"sagenb: {self._ahead}. Another client's work is never interrupted: this run "
                f"waits for it (waited {now - self._since:.0f} s; --timeout counts from when "
                f"the run's own tasks start; interrupt to give up)"
            )
            return True
        if self.all_started:  # not merely unrecorded yet (see `blocked`)
            self.end()
        return False

    def end(self) -> None:
        """The run's tasks have all started, or ended: what it waited for, if it did, is
        `waited`, and the line under the cell is closed."""
        self.started = set(self.own)
        if self._since is not None and self.waited is None:
            self.waited = (
                f"this run waited {time.monotonic() - self._since:.0f} s for its engines, "
                f"busy with another client's work: {self._ahead}"
            )
            self.note("")

    def blocked(self) -> dict[int, list[Task]] | None:
        """engine id -> the other clients' tasks ahead of the run's task there, for every
        engine whose run task has not started ({} once all have; None: no answer). Only
        tasks sent to the engine itself count as ahead: a load-balanced one may have reached
        the engine before or after the run's, which the controller does not say, and taking
        it for ahead would stop the stall clock of a run that does run."""
        if self.all_started:
            return {}
        waiting = [e for e in self.own if e not in self.started]
        queues = pending(self.pool, waiting)
        if queues is None:
            return None
        ahead: dict[int, list[Task]] = {}
        for eid in waiting:
            ids = [t.msg_id for t in queues.get(eid, [])]
            mine = self.own[eid]
            if mine not in ids:
                # ended (or its engine is gone), or not recorded by the controller yet: the
                # latter only for an instant after submission, when nothing of ours runs there
                if eid not in self.pool.client.ids or mine not in self.pool.client.outstanding:
                    self.started.add(eid)
                continue
            before = queues[eid][: ids.index(mine)]  # load-balanced ones come after
            if before:
                ahead[eid] = before
            else:
                self.started.add(eid)
        return ahead

    def signalable(self, engine_ids: Sequence[int]) -> list[int]:
        """Those of `engine_ids` that run the run's own task, asked afresh: only these may be
        signalled. The run's tasks on the others wait behind another client's task: they are
        aborted (the engine drops them when it reaches them), and that task never signalled.
        Without an answer from the controller every engine counts as running the run's task."""
        blocked = self.blocked()
        if not blocked:
            return list(engine_ids)
        queued = [e for e in engine_ids if e in blocked]
        for eid in queued:
            self.pool.client.abort(jobs=[self.own[eid]], targets=[eid], block=False)
        return [e for e in engine_ids if e not in blocked]


#: one line under the cell, rewritten in place (pool/waits.py), ended once it is over
_STDERR_NOTE = waits.stderr_note("the run's tasks have all started")


def _task(msg_id: str, engine_id: int, running: bool | None, record: Mapping[str, Any]) -> Task:
    header = record.get("header") or {}
    submitted = record.get("submitted") or header.get("date")
    return Task(
        msg_id,
        engine_id,
        running,
        session=str(header.get("session") or ""),
        user=str(header.get("username") or ""),
        submitted=submitted if isinstance(submitted, datetime) else None,
    )


def _records(pool: EnginePool, msg_ids: list[str]) -> dict[str, dict]:
    """The hub's records of `msg_ids` (header, submitted), {} when it keeps none (NoDB)."""
    if not msg_ids:
        return {}

    def query() -> list[dict]:
        return pool.client.db_query({"msg_id": {"$in": msg_ids}}, keys=["header", "submitted"])

    try:
        found = _bounded(query)
    except Exception:  # noqa: BLE001 - a hub without records (NoDB): whose stays unknown
        return {}
    return {r["msg_id"]: r for r in found or []}


def _bounded(fn: Callable[[], T]) -> T | None:
    """fn() waited for at most QUERY_S (a dead controller never answers, and ipyparallel's
    queries wait without a timeout); None when it did not answer, its error raised here."""
    return waits.bounded(fn, QUERY_S)[1]
