"""The tasks a run finds on its engines when it has just taken the pool's lock, and what it
does with them, before it touches an engine.

No other sagenb run holds the pool then, yet an engine may still run a task:

- an orphan, which nobody will ever collect: a rank of a run whose kernel was SIGKILLed mid-run
  (its lock went with its process, its tasks run on: their store is gone with the kernel, which
  the ranks do not notice until they finish or reach a collective), or of an earlier run of
  this process, left behind when it was stopped;
- someone's work started outside sagenb: `%px --noblock`, `client[i].apply_async(...)`, from
  this kernel or from another process attached to the pool.

Either used to hold the engines the run needs: its tasks queued behind, its clean-slate tasks
timed out after 30 s and their engines were killed (someone's work with them), or its stall
clock ran out and it interrupted engines busy with another task, blaming its own rank.

The policy. A task is an orphan only when that is certain: it was submitted by this process for
a run that has ended (`EnginePool.run_tasks`), or by the client session of the lock's last
holder, whose process has ended without letting go of the lock (`Holder.gone`: it ran on this
host and its pid is gone). Orphans are ended: queued ones aborted, running ones interrupted
(SIGINT: a rank in Python raises KeyboardInterrupt and releases its peers, engine/entry.py).
One still running after ORPHAN_END_S has its engine killed and replaced on a pool this process
started; an attached pool's engines are not sagenb's to replace (killing one would shrink
someone's pool for good), so there it is waited for as other work is. Everything else is never
signalled: the cell says which engine is busy with whose task (its client session and user, as
ipyparallel's controller records them, and when it was submitted), and `--if-busy wait` (the
default) waits for it, one line under the cell rewritten each second, while `--if-busy fail`
raises PoolBusyError naming it.

Two limits. Between the controller's answer and the interrupt an orphan may end and its engine
start the task queued next there, which the interrupt would then hit: the window is the
milliseconds between the two, and only on an engine whose orphan was running. And on an engine
with both a task sent to it and a load-balanced one pending, which of them runs is not known
(pool/occupancy.py): an orphan there is aborted, in case it is queued, and waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sagenb.pool import waits
from sagenb.pool.cluster import EnginePool
from sagenb.pool.occupancy import Task, pending
from sagenb.pool.run_lock import Holder, PoolBusyError

__all__ = ["settle", "whose", "listing", "ORPHAN_END_S"]

ORPHAN_END_S = 5.0  # how long interrupted orphans get to end before their engines are killed


def settle(
    pool: EnginePool,
    engine_ids: Sequence[int],
    *,
    previous: Holder | None,
    if_busy: str = "wait",
    note: Callable[[str], None] | None = None,
) -> list[str]:
    """End the orphans on `engine_ids` and wait for other tasks there (or raise
    PoolBusyError, `if_busy="fail"`). Returns what to say under the cell: what was ended or
    replaced, and what the run waited for. `previous` is the lock's last holder when it did
    not let go (run_lock.hold yields it)."""
    found = pending(pool, engine_ids)
    tasks = [t for ts in (found or {}).values() for t in ts]
    if not tasks:
        return []
    orphans = [t for t in tasks if _orphan(t, pool, previous)]
    notes, aborted = _end(pool, orphans, previous) if orphans else ([], set())
    waited = _wait_for_others(pool, engine_ids, previous, aborted, if_busy, note or _STDERR_NOTE)
    return notes + waited


def whose(task: Task, pool: EnginePool, previous: Holder | None) -> str:
    """Whose task it is, as far as this process and ipyparallel can tell."""
    if task.msg_id in pool.run_tasks:
        return "a rank of an earlier sagenb run of this process, left running when it stopped"
    if previous is not None and previous.session and task.session == previous.session:
        ended = "whose process has ended" if previous.gone() else "which let go of the pool"
        return f"a task of {previous.describe()}, {ended}"
    if task.session and task.session == pool.session_id:
        return "submitted by this process outside sagenb (%px, a view's apply_async)"
    return task.origin()


def listing(tasks: Sequence[Task], pool: EnginePool, previous: Holder | None) -> str:
    """The tasks by whose they are: 'WHOSE: task A on engine 0 (running, ...) and task B on
    engine 1 (...); WHOSE 2: ...'."""
    groups: dict[str, list[str]] = {}
    for task in tasks:
        groups.setdefault(whose(task, pool, previous), []).append(task.describe(""))
    return "; ".join(f"{who}: {' and '.join(items)}" for who, items in groups.items())


def _orphan(task: Task, pool: EnginePool, previous: Holder | None) -> bool:
    if task.msg_id in pool.run_tasks:
        return True  # every earlier run of this process has ended: this one holds the lock
    return (
        previous is not None
        and bool(previous.session)
        and task.session == previous.session
        and previous.gone()
    )


def _end(
    pool: EnginePool, orphans: list[Task], previous: Holder | None
) -> tuple[list[str], set[str]]:
    """Abort the queued orphans, interrupt the running ones, and on a pool of this process's
    replace the engines of those that do not end. Returns the notes and the aborted ids
    (an aborted task leaves its engine's queue only when the engine reaches it)."""
    queued = [t for t in orphans if t.running is False]
    running = [t for t in orphans if t.running]
    # running or not (an engine with both a task sent to it and a load-balanced one): aborted
    # in case it is queued, never interrupted, waited for
    for task in [t for t in orphans if not t.running]:
        pool.client.abort(jobs=[task.msg_id], targets=[task.engine_id], block=False)
    pool.interrupt([t.engine_id for t in running])
    left = _still_running(pool, running, ORPHAN_END_S)
    named = listing(orphans, pool, previous)
    notes = [
        f"this run found tasks nobody will collect on its engines and ended them "
        f"(queued ones aborted, running ones interrupted): {named}"
    ]
    if left and pool.owned:
        engines = sorted({t.engine_id for t in left})
        pool.kill(engines)
        pool.heal()
        notes.append(
            f"engine(s) {', '.join(map(str, engines))} did not end their orphan task "
            f"within {ORPHAN_END_S:.0f} s of an interrupt (blocked in C code?): killed and "
            f"replaced"
        )
    elif left:
        notes.append(
            f"the orphan task(s) on engine(s) "
            f"{', '.join(str(t.engine_id) for t in left)} did not end within "
            f"{ORPHAN_END_S:.0f} s of an interrupt; the pool is attached (not sagenb's to "
            f"replace engines of), so this run waits for them"
        )
    return notes, {t.msg_id for t in queued}


def _still_running(pool: EnginePool, tasks: list[Task], timeout: float) -> list[Task]:
    """Which of `tasks` are still pending after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while tasks:
        found = pending(pool, sorted({t.engine_id for t in tasks}))
        if found is None:
            return tasks
        ids = {t.msg_id for ts in found.values() for t in ts}
        tasks = [t for t in tasks if t.msg_id in ids]
        if not tasks or time.monotonic() > deadline:
            return tasks
        time.sleep(waits.BUSY_POLL_S)
    return tasks


def _wait_for_others(
    pool: EnginePool,
    engine_ids: Sequence[int],
    previous: Holder | None,
    aborted: set[str],
    if_busy: str,
    note: Callable[[str], None],
) -> list[str]:
    """Until no task but aborted ones is pending on the run's engines (waits.while_busy);
    or PoolBusyError."""
    last = ""  # what the run waited for, last seen

    def busy(waited: float) -> str:
        nonlocal last
        found = pending(pool, [e for e in engine_ids if e in pool.client.ids])
        others = [t for ts in (found or {}).values() for t in ts if t.msg_id not in aborted]
        if not others:
            return ""
        last = listing(others, pool, previous)
        engines = ", ".join(str(e) for e in sorted({t.engine_id for t in others}))
        if if_busy == "fail":
            raise PoolBusyError(
                f"engine(s) {engines} of this run are busy with work that is not a sagenb "
                f"run's: {last}. --if-busy fail: this run did not wait and ran nothing on "
                f"them. Run it again once that work has ended (or end it: the client that "
                f"submitted it can abort it), or with --if-busy wait (the default)."
            )
        return (
            f"sagenb: engine(s) {engines} busy with {last}; this run waits for them "
            f"(waited {waited:.0f} s; --if-busy wait; interrupt to give up)"
        )

    waited = waits.while_busy(busy, note)
    if waited is None:
        return []
    return [f"this run waited {waited:.0f} s for work on its engines: {last}"]


_STDERR_NOTE = waits.stderr_note("the run's engines are free: this run starts")
