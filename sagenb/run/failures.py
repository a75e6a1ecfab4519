"""What a failed, stalled or interrupted run raises in the notebook, built from the ranks' errors.

Each error names the rank and engine it came from and carries that rank's traceback; an
out-of-memory error also carries the rank's last memory telemetry, a stall the last step every
rank reported and where each rank was (stacks, collectives), an interrupt the partial result
(history so far, and the parameters when the ranks stopped at a step boundary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sagenb.engine.wire import shared_memory
from sagenb.metrics import keys
from sagenb.pool.waits import PoolDiedError  # raised by the pool's waits too

__all__ = [
    "TrainingError",
    "OutOfMemoryError",
    "EngineDiedError",
    "StalledError",
    "TrainingInterrupted",
    "PoolDiedError",
    "classify",
    "on_some_ranks",
]

OOM_MARKERS = ("out of memory", "can't allocate memory", "MemoryError", "OutOfMemoryError")
#: what a rank says when it failed only because a peer went away (gloo's, nccl's and the
#: shared-memory reduction's words): the peer's own error is the one to report, whichever
#: task completed first
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    shared_memory.LEFT,
    shared_memory.DIED,
)
#: how ipyparallel names the error of a task whose engine died
DEAD_ENGINE = ("EngineError", "DeadEngine")


class TrainingError(RuntimeError):
    """A rank failed; the message carries its rank, engine id (and, on a pool that spans
    hosts, the engine's host) and traceback."""

    def __init__(self, rank: int, engine_id: int, detail: str, host: str = "") -> None:
        self.rank, self.engine_id, self.detail, self.host = rank, engine_id, detail, host
        super().__init__(f"{self.who} failed:\n{detail}")

    @property
    def who(self) -> str:
        """'rank 1 (engine 3)', or 'rank 1 (engine 3 on host-b)'."""
        on = f" on {self.host}" if self.host else ""
        return f"rank {self.rank} (engine {self.engine_id}{on})"


class OutOfMemoryError(TrainingError):
    """A rank ran out of memory; `memory` is its last reported memory telemetry (MiB)."""

    def __init__(
        self,
        rank: int,
        engine_id: int,
        detail: str,
        memory: Mapping[str, float],
        host: str = "",
    ):
        self.memory = dict(memory)
        shown = ", ".join(
            f"{k.removeprefix(keys.MEMORY_PREFIX)} {v:.1f}" for k, v in self.memory.items()
        )
        super().__init__(rank, engine_id, detail, host)
        self.args = (
            f"{self.who} ran out of memory; its last step held: "
            f"{shown or 'no step finished'}. Lower --batch-size, raise --microbatches or "
            f"--partitions, or use --delay-init.\n{detail}",
        )


class EngineDiedError(TrainingError):
    """A rank's engine process died (killed, or crashed outside Python)."""


class StalledError(TrainingError):
    """No rank reported progress for --timeout seconds; the ranks were stopped after their
    stacks were read. `stuck_ranks` did not finish their step: busy in code of their own (or,
    when every rank was waiting in a collective, those whose last reported step is lowest);
    `waiting_ranks` were blocked in a collective, waiting for them. `stacks` maps each rank to
    its Python stack (innermost frame last) and `collectives` to the collective it was in ('' if
    none). `rank` and `engine_id` are the first stuck rank's."""

    def __init__(
        self,
        rank: int,
        engine_id: int,
        detail: str,
        *,
        stuck_ranks: Sequence[int] = (),
        waiting_ranks: Sequence[int] = (),
        stacks: Mapping[int, str] | None = None,
        collectives: Mapping[int, str] | None = None,
    ) -> None:
        self.stuck_ranks = list(stuck_ranks) or [rank]
        self.waiting_ranks = list(waiting_ranks)
        self.stacks = dict(stacks or {})
        self.collectives = dict(collectives or {})
        super().__init__(rank, engine_id, detail)
        self.args = (detail,)  # the detail names the ranks itself


class TrainingInterrupted(KeyboardInterrupt):
    """The run was interrupted; `result` holds what it had done (a script still stops)."""

    def __init__(self, result: Any) -> None:
        self.result = result
        super().__init__(f"interrupted after {len(result.history)} steps")


def on_some_ranks(evalue: str, ranks: Sequence[int], world_size: int) -> str:
    """A JobError's text, naming `ranks` when only they raised it (a cell that defines `model`
    only `if dist.get_rank() == 0`: the other ranks' cell did define it)."""
    if len(ranks) == world_size:
        return evalue
    return (
        f"{evalue} on rank {', '.join(map(str, ranks))} of {world_size} (the other ranks' cell "
        f"did): the cell runs on every engine, and each must define the same names; a name "
        f"defined only under `if dist.get_rank() == 0` is missing on the others"
    )


def lost_a_peer(evalue: str) -> bool:
    """Whether a rank's error only says that another rank went away."""
    return any(marker in evalue for marker in PEER_LOST)


#: what a dead engine that reported no fatal signal died of
NO_REPORT = (
    "killed or crashed, with no fatal signal reported: SIGKILL (the kernel's OOM killer, "
    "kill -9), or an exit outside Python"
)


def classify(
    ename: str,
    evalue: str,
    *,
    rank: int,
    engine_id: int,
    memory: Mapping[str, float],
    death: str = "",
    host: str = "",
) -> TrainingError:
    """The error to raise for a rank's remote exception; `death` is a dead engine's crash
    report (run/stacks.py: the signal and where it hit), when it wrote one; `host` the
    engine's host, named on a pool that spans hosts."""
    if ename in DEAD_ENGINE:
        return EngineDiedError(
            rank, engine_id, f"its engine process died ({death or NO_REPORT}): {evalue}", host
        )
    if ename in ("MemoryError", "OutOfMemoryError") or any(m in evalue for m in OOM_MARKERS):
        return OutOfMemoryError(rank, engine_id, evalue, memory, host)
    return TrainingError(rank, engine_id, evalue, host)
