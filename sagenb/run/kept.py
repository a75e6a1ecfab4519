"""The notebook's side of a run's state kept on its engines, for `--continue`.

A run that ends at a step boundary leaves its state on its engines (engine/live/kept.py);
this module remembers which run that is (`KeptRun`: its lineage, cell, engines, config, the
history so far and its segments, the rendezvous store the engines' process group uses) and
decides, before any engine works, whether the next run goes on from it (`going_on`): only
`--continue` of the same cell, on the same engines, with what it trains unchanged. Any other
run releases it (its engines release their state as they start clean, pool/clean_slate.py),
as do `smp_result.release()`, `%smp_cluster restart/stop` and an engine's death; a
`--continue` after that says which happened, and whether a checkpoint can take its place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sagenb.config.errors import ConfigError
from sagenb.config.job import Job
from sagenb.config.options import TrainConfig
from sagenb.metrics.stream import History

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from sagenb.pool.cluster import EnginePool

__all__ = [
    "KeptRun",
    "current",
    "keep",
    "going_on",
    "check_engines",
    "continued",
    "forget",
    "released",
    "STEERABLE",
]

#: the engine options a --continue may change: when and how long it trains, how fast it
#: steps, how it loads and saves; any other changes what is trained, or its layout
STEERABLE = frozenset(
    {
        "steps",
        "epochs",
        "lr",
        "eval_every",
        "timeout",
        "stop_on_nonfinite",
        "checkpoint_dir",
        "checkpoint_every",
        "data_workers",
    }
)


@dataclass
class KeptRun:
    """A run whose state its engines keep (the module docstring)."""

    pool: EnginePool
    lineage: str
    job: Job
    #: the last segment's config
    config: TrainConfig
    #: the engines, in rank order, and their processes: a replaced engine holds nothing
    ids: list[int]
    pids: list[int | None]
    #: the store the engines' process group was made with (and the stop requests use)
    store: TCPStore
    #: one history across segments: each --continue appends to it
    history: History
    #: the first step of each segment
    segments: list[int]
    #: the last step done, and the steps the last segment planned (None: a stream's unknown)
    step: int
    planned: int | None
    status: str
    #: MiB each engine keeps, by rank
    mib: list[float]
    #: what released the state, once it is released
    why_released: str | None = None
    #: the step a --continue of this run went on to (its state is that segment's now)
    went_on_to: int | None = None
    #: why a --continue was refused, kept for the error that follows it
    notes: list[str] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.why_released is None

    def describe(self, name: str = "smp_result") -> str:
        """The lines said under the cell after a run that kept its state (`name`: the
        result's variable)."""
        held = ", ".join(f"rank {r}: {m:.1f} MiB" for r, m in enumerate(self.mib))
        return (
            f"the engines keep this run's state after step {self.step} ({held}): "
            f"`%%smp_train --continue --steps N` goes on from it without disk; "
            f"`{name}.release()` frees it"
        )

    def release(self, why: str) -> None:
        """Mark the state released (`why`: what released it) and drop the store. The engines
        drop theirs when they next start clean (engine/clean_slate.py), or at once through
        `release_on_engines`."""
        if self.why_released is None:
            self.why_released = why
        self.store = None  # type: ignore[assignment]  # the port closes with its last reference

    def release_on_engines(self, why: str) -> None:
        """Release the state on the engines now (smp_result.release()), then here."""
        from sagenb.engine.live import kept as engine_kept

        if self.live and self.pool.client is not None and self._same_engines():
            tasks = [self.pool.client[e].apply_async(engine_kept.release) for e in self.ids]
            for task in tasks:
                self.pool.result(task, RELEASE_TIMEOUT_S)
        self.release(why)

    def _same_engines(self) -> bool:
        ids = self.pool.engine_ids[: len(self.ids)]
        return ids == self.ids and [self.pool.pids.get(e) for e in ids] == self.pids

    def gone(self) -> str:
        """What released the state, said to a --continue or a call after it, and whether a
        checkpoint can take its place (not where a later segment holds it)."""
        said = (
            f"the state of the run of {self.job.first_line()!r} (step {self.step}) was "
            f"released by {self.why_released}"
        )
        return said if self.went_on_to is not None else f"{said}; {self.checkpoint_hint()}"

    def checkpoint_hint(self) -> str:
        """Whether a checkpoint can take the kept state's place."""
        directory = self.config.checkpoint_dir
        if directory:
            return (
                f"its checkpoints can take its place: --resume --checkpoint-dir {directory} "
                f"(the newest one it wrote)"
            )
        return "no checkpoint can take its place: it ran without --checkpoint-dir"


#: how long an engine gets to release what it keeps
RELEASE_TIMEOUT_S = 30.0

_current: KeptRun | None = None
#: runs kept before the current one, newest last: a --continue of one says what released it
_past: list[KeptRun] = []
PAST = 8


def current() -> KeptRun | None:
    """The run whose state this kernel's engines keep (or kept: `live` says)."""
    return _current


def keep(run: KeptRun) -> None:
    """`run` is now the one the engines keep (what they kept before was released)."""
    global _current
    if _current is not None and _current is not run:
        if _current.lineage == run.lineage:  # a --continue went on from it
            _current.went_on_to = run.step
            _current.release(f"its --continue to step {run.step}, whose result holds it now")
        else:
            _current.release("a later run")
        _past[:] = [r for r in _past if r.job != _current.job][-(PAST - 1) :] + [_current]
    _current = run


def released(why: str) -> None:
    """What the engines kept was released (`why`): `%smp_cluster stop/restart`, a run."""
    if _current is not None:
        _current.release(why)


def forget() -> None:
    """Nothing is kept any more (a test's fresh start)."""
    global _current
    if _current is not None:
        _current.release("forgotten")
    _current = None
    _past.clear()


def refuse(why: str) -> ConfigError:
    return ConfigError("continue_", True, why)


def going_on(config: TrainConfig, job: Job, pool: EnginePool | None) -> KeptRun | None:
    """The kept run this run goes on from (--continue), or None (any other run, which releases
    what the engines keep). A --continue that cannot go on is a ConfigError saying why, before
    any engine works."""
    run = _current
    if not config.continue_:
        if run is not None and run.live:
            same = run.job == job
            run.release(
                "a run of the same cell without --continue" if same else "a run of another cell"
            )
        return None
    earlier = next((r for r in reversed(_past) if r.job == job), None)
    if earlier is not None and (run is None or run.job != job):
        run = earlier  # this cell's run, released since: say by what
    if run is None:
        raise refuse(
            "no run's state is kept on the engines: train the cell once without --continue "
            "(or go on from a checkpoint with --resume --checkpoint-dir DIR)"
        )
    if not run.live:
        raise refuse(run.gone())
    check_engines(run, pool)
    if job != run.job:
        raise refuse(
            "the cell changed since the run it would go on from: --continue goes on with the "
            "model and data the engines hold. Run the cell without --continue to start again "
            f"(that releases the kept state), or --resume from a checkpoint. {_diff(run, job)}"
        )
    _check_layout(run, config)
    _check_more_to_train(run, config)
    return run


def _check_more_to_train(run: KeptRun, config: TrainConfig) -> None:
    """A run that made all its planned steps goes on only with a larger total: the same
    --steps and --epochs, or a larger --steps past the --epochs that ended it, train nothing."""
    if run.planned is None or run.step < run.planned:
        return
    if _same_length(run.config, config):
        raise refuse(
            f"the run it would go on from trained all its {run.step} steps: give a larger "
            f"--steps or --epochs (they are the run's total, as with --resume)"
        )
    by_epochs = run.config.steps is None or run.planned < run.config.steps
    if by_epochs and config.epochs == run.config.epochs:
        raise refuse(
            f"the run it would go on from ended with its --epochs {run.config.epochs} at step "
            f"{run.step}, so --steps {config.steps} would train nothing: give a larger --epochs "
            "(it is the run's total, as --steps is)"
        )


def continued(options: dict[str, Any], job: Job) -> TrainConfig | None:
    """A --continue's config when the engines keep this cell's run: that run's options with
    those given, so a --continue repeats only what it changes. None otherwise (and when it
    names another strategy, which `going_on` refuses with the reason)."""
    run = _current
    if not options.get("continue_") or run is None or run.job != job:
        return None
    if options.get("strategy", run.config.strategy) != run.config.strategy:
        return None
    # resume: the run may have begun from a checkpoint; this goes on from memory
    return dataclasses.replace(run.config, resume=False, **options)


def check_engines(run: KeptRun, pool: EnginePool | None) -> None:
    """The kept run's engines are the pool's, each the process that kept it."""
    if pool is None or pool is not run.pool or not run._same_engines():
        run.release("an engine that died or was replaced, or the pool's restart")
        raise refuse(
            f"the engines that kept the run of {run.job.first_line()!r} are gone (one died or "
            f"was replaced, or the pool was restarted); {run.checkpoint_hint()}"
        )


def _check_layout(run: KeptRun, config: TrainConfig) -> None:
    """Options that change what is trained or its layout are refused, with the reason."""
    before, now = run.config.for_engines(), config.for_engines()
    if now.engines is None:  # resolved as the kept run's was, on the same engines
        now = now.with_engines(before.engines or len(run.ids))
    changed = [
        f.name
        for f in dataclasses.fields(before)
        if f.name not in STEERABLE and getattr(before, f.name) != getattr(now, f.name)
    ]
    if changed:
        said = ", ".join(
            f"{_flag(name)} {getattr(now, name)!r} (was {getattr(before, name)!r})"
            for name in changed
        )
        raise refuse(
            f"{said} would change what the kept state trains or how it is laid out; a "
            "--continue may change only "
            + ", ".join(_flag(n) for n in sorted(STEERABLE))
            + ". For a new layout, write a checkpoint (--checkpoint-dir) and --resume from it"
        )


def _flag(name: str) -> str:
    from sagenb.config.errors import flag_name

    return flag_name(name)


def _same_length(before: TrainConfig, now: TrainConfig) -> bool:
    return before.steps == now.steps and before.epochs == now.epochs


def _diff(run: KeptRun, job: Job) -> str:
    """The first line that differs, to show what changed."""
    old = (run.job.source or "").splitlines()
    new = (job.source or "").splitlines()
    for number, (a, b) in enumerate(zip(old, new), start=1):
        if a != b:
            return f"Line {number} was {a.strip()!r}, now {b.strip()!r}."
    return f"It had {len(old)} lines, now {len(new)}."
