"""What a failed, stalled or interrupted run raises in the notebook, built from the ranks' errors.

Each error names the rank and engine it came from and carries that rank's traceback; an
out-of-memory error also carries the rank's last memory telemetry, a stall the last step every
rank reported, an interrupt the partial result (history so far, and the parameters when the
ranks stopped at a step boundary).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "TrainingError",
    "OutOfMemoryError",
    "EngineDiedError",
    "StalledError",
    "TrainingInterrupted",
    "PoolDiedError",
    "classify",
]

OOM_MARKERS = ("out of memory", "can't allocate memory", "MemoryError", "OutOfMemoryError")
#: how ipyparallel names the error of a task whose engine died
DEAD_ENGINE = ("EngineError", "DeadEngine")


class TrainingError(RuntimeError):
    """A rank failed; the message carries its rank, engine id and traceback."""

    def __init__(self, rank: int, engine_id: int, detail: str) -> None:
        self.rank, self.engine_id, self.detail = rank, engine_id, detail
        super().__init__(f"rank {rank} (engine {engine_id}) failed:\n{detail}")


class OutOfMemoryError(TrainingError):
    """A rank ran out of memory; `memory` is its last reported memory telemetry (MiB)."""

    def __init__(self, rank: int, engine_id: int, detail: str, memory: Mapping[str, float]):
        self.memory = dict(memory)
        shown = ", ".join(f"{k.removeprefix('memory/')} {v:.1f}" for k, v in self.memory.items())
        super().__init__(rank, engine_id, detail)
        self.args = (
            f"rank {rank} (engine {engine_id}) ran out of memory; its last step held: "
            f"{shown or 'no step finished'}. Lower --batch-size, raise --microbatches or "
            f"--partitions, or use --delay-init.\n{detail}",
        )


class EngineDiedError(TrainingError):
    """A rank's engine process died (killed, or crashed outside Python)."""


class StalledError(TrainingError):
    """No rank reported progress for --timeout seconds; the stuck ranks were stopped."""


class PoolDiedError(RuntimeError):
    """The pool's controller died: no rank can report or be told anything any more. The
    run's engines were stopped and the pool closed; the next run starts a new pool."""


class TrainingInterrupted(KeyboardInterrupt):
    """The run was interrupted; `result` holds what it had done (a script still stops)."""

    def __init__(self, result: Any) -> None:
        self.result = result
        super().__init__(f"interrupted after {len(result.history)} steps")


def classify(
    ename: str, evalue: str, *, rank: int, engine_id: int, memory: Mapping[str, float]
) -> TrainingError:
    """The error to raise for a rank's remote exception."""
    if ename in DEAD_ENGINE:
        return EngineDiedError(
            rank, engine_id, f"its engine process died (killed or crashed): {evalue}"
        )
    if ename in ("MemoryError", "OutOfMemoryError") or any(m in evalue for m in OOM_MARKERS):
        return OutOfMemoryError(rank, engine_id, evalue, memory)
    return TrainingError(rank, engine_id, evalue)
