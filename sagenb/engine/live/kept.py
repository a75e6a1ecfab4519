"""A run's state kept in its engine's memory after the run ends, for `--continue`.

A run that ends at a step boundary (done, stopped, interrupted) leaves on each engine what the
next segment of the same cell needs to go on as if it had never stopped: the process group
(its meshes and the pipeline's channels stay valid), the cell's module and objects, the
strategy (its shard, stage or slice of the model), the loop's optimizer, scheduler and loss
scaler (engine/loop.py `Segment`), the last step done, and the random states at the end. Going
on then costs no disk and no setup: a `--continue` task takes it (`take`), trains, and keeps
it again.

One engine keeps at most one run's state. It is released (`release`) before any other run on
the engine (clean_slate.restore calls it first), by `smp_result.release()`, and with the
engine's process. What it holds is `summary()`: `%smp_cluster status` shows it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sagenb.config import cell_module
from sagenb.config.job import JobError

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig
    from sagenb.engine.loop import Segment
    from sagenb.engine.strategies import Strategy
    from sagenb.engine.workspace import Workspace

__all__ = [
    "Kept",
    "keep",
    "kept",
    "take",
    "held",
    "release",
    "summary",
    "held_mib",
    "random_states",
    "set_random_states",
]


@dataclass
class Kept:
    """What one engine keeps of a run (the module docstring)."""

    #: the run's lineage: a random id the notebook gives the first segment, which every
    #: --continue of it names (another kernel's or another cell's state is never taken)
    lineage: str
    #: the cell's first line of code, for %smp_cluster status
    cell: str
    config: EngineConfig
    ws: Workspace
    strategy: Strategy
    segment: Segment
    device: torch.device
    #: the cell modules the run made (config/cell_module.py), removed with the state
    modules: list[str]
    #: puts back the KV caches the run turned off (engine/model/kv_cache.py)
    restore_cache: Callable[[], None]
    rng: dict[str, Any] = field(default_factory=dict)


_kept: Kept | None = None


def kept() -> Kept | None:
    """The state this engine keeps, if any."""
    return _kept


def keep(state: Kept) -> float:
    """Keep `state` (its random states taken now); returns the MiB it holds."""
    global _kept
    state.rng = random_states()
    _kept = state
    return held_mib(state)


def take(lineage: str) -> Kept:
    """The kept state of run `lineage`, its random states put back as the run ended; a
    JobError says why there is none (the notebook says what released it)."""
    if _kept is None:
        raise JobError(
            "--continue: this engine keeps no run's state (it was released, or the engine "
            "was replaced)"
        )
    if _kept.lineage != lineage:
        raise JobError(
            f"--continue: this engine keeps the state of another run ({_kept.cell!r}), not "
            "the one to continue"
        )
    set_random_states(_kept.rng)
    return _kept


def held(lineage: str) -> Kept:
    """The kept state of run `lineage`, as it is (what on_engines and evaluate work on)."""
    state = _kept
    if state is None or state.lineage != lineage:
        raise RuntimeError(
            "this engine keeps no state of the run (it was released, or the engine replaced)"
        )
    return state


def release() -> str | None:
    """Drop the kept state, its process group and cell modules; what it was (None: none)."""
    global _kept
    state, _kept = _kept, None
    if state is None:
        return None
    from sagenb.engine.wire import process_group  # the kept run's group, left up for it

    try:
        state.restore_cache()
    finally:
        for name in state.modules:
            cell_module.remove(name)
        what = state.cell
        del state
        process_group.shutdown()  # collects the garbage first
    return what


def summary() -> dict[str, Any] | None:
    """What this engine keeps, for %smp_cluster status: the cell, its last step, MiB."""
    if _kept is None:
        return None
    return {"cell": _kept.cell, "step": _kept.segment.last, "mib": held_mib(_kept)}


def held_mib(state: Kept) -> float:
    """MiB of the tensors the kept state holds on this engine: the strategy's parameters,
    gradients and buffers (its shard, stage or slice) and the optimizer's state, each
    storage counted once."""
    seen: dict[tuple[str, int], int] = {}

    def count(t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's part
        if local.device.type == "meta":
            return
        storage = local.untyped_storage()
        seen[(str(local.device), storage.data_ptr())] = storage.nbytes()

    module = state.strategy.module
    for p in module.parameters():
        count(p)
        count(p.grad)
    for b in module.buffers():
        count(b)
    for values in state.segment.optimizer.state.values():
        for v in values.values():
            count(v)
    return sum(seen.values()) / 2**20


def random_states() -> dict[str, Any]:
    """torch's (CPU and every CUDA device's), Python's and numpy's random states."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for the engine side
        pass
    return states


def set_random_states(states: dict[str, Any]) -> None:
    """Put back what `random_states` took."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "python" in states:
        random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
