"""Before each run, the run's engines are put back as they were when the pool warmed them up.

A warm engine keeps whatever the last cell changed of its process (a default dtype, a patched
torch function, an environment variable, a resource limit): engine/clean_slate.py says what is
put back, in a task of its own on each engine, about a millisecond of work there. An engine
holding what a process cannot undo (a lowered hard limit, a cell's thread still running) is
replaced, and the cell says so.
"""

from __future__ import annotations

from typing import Any

from sagenb.engine.clean_slate import Restored, restore
from sagenb.pool.cluster import EnginePool
from sagenb.pool.waits import PoolDiedError

__all__ = ["start_clean", "RESTORE_TIMEOUT_S"]

#: how long an idle engine gets to answer; one that does not is replaced
RESTORE_TIMEOUT_S = 30.0


def start_clean(pool: EnginePool, engines: int) -> list[str]:
    """Restore the first `engines` engines (in rank order), replace those that cannot be, and
    return what to say under the cell about each replaced one."""
    ids = pool.engine_ids[:engines]
    tasks = [pool.client[eid].apply_async(restore) for eid in ids]
    notes, replace = [], []
    for rank, (eid, task) in enumerate(zip(ids, tasks)):
        why = _unrestorable(pool, task)
        if why:
            replace.append(eid)
            notes.append(
                f"engine {eid} (rank {rank}) was replaced before this run: an earlier run "
                f"left what its process cannot undo ({'; '.join(why)}). A run starts from "
                f"the engine's state when the pool started it."
            )
    if replace:
        pool.kill(replace)
        pool.heal()
    return notes


def _unrestorable(pool: EnginePool, task: Any) -> list[str]:
    """What the engine could not put back; its error or silence counts as such. A dead
    controller is no engine's fault: PoolDiedError, within a fraction of a second."""
    try:
        done: Restored = pool.result(task, RESTORE_TIMEOUT_S)
    except PoolDiedError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure here: the engine is not trusted
        return [f"restoring its state failed: {getattr(err, 'ename', type(err).__name__)}"]
    return done.unrestorable
