"""The client side of training: check, take the pool, put its engines back as they started,
then run (run/training_run.py).

`train()` is the plain Python API; `%%smp_train` is a thin adapter over it. Everything that can
be checked without engines is checked before any engine runs user code.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sagenb.config.errors import ConfigError
from sagenb.config.job import Job
from sagenb.config.options import TrainConfig, describe
from sagenb.display import event_log
from sagenb.engine.memory import check_offload
from sagenb.engine.wire import segments
from sagenb.metrics.result import TrainResult
from sagenb.metrics.stream import MetricSink
from sagenb.pool import clean_slate, cluster, orphans, run_lock
from sagenb.run import kept
from sagenb.run.failures import TrainingError, TrainingInterrupted
from sagenb.run.live import LiveRun
from sagenb.run.training_run import TrainingRun
from sagenb.sizing.cost import check_price
from sagenb.sizing.projection import Projection, saturates

if TYPE_CHECKING:
    from sagenb.sizing.estimates import Estimate

__all__ = ["train", "TrainingError", "TrainingInterrupted"]


def train(
    job: str | Callable[[], Any] | Job,
    config: TrainConfig | None = None,
    *,
    pool: cluster.EnginePool | None = None,
    sinks: Sequence[MetricSink] = (),
    live: bool | None = None,
    on_failure: Callable[[str], None] | None = None,
    estimate: Estimate | None = None,
    **options: Any,
) -> TrainResult:
    """Train `job` (cell source, or a callable returning {'model', 'dataset', 'loss_fn', ...}).

    Options are the fields of TrainConfig (`batch_size=64, strategy="data"`), or pass a config;
    with `continue_=True`, the options not given are those of the run it goes on from.
    Uses the running pool (or `pool`), starting one of `engines` engines when none runs.
    `live` shows the dashboard as a live widget (default: when running in a Jupyter kernel);
    `on_failure(kind)` is called when the notebook notices a failure ("rank failed", "stalled",
    "controller died", "interrupted"), before it stops the ranks. `estimate` (from
    `sagenb.estimate` or `%%smp_plan`) projects the run on --instance ("projected on I") when it
    estimated this job with these options; otherwise the run estimates itself in a child
    process while the engines train, or once they end where they fill this machine's cores
    (sagenb/sizing/projection.py).
    """
    prepared = Job.of(job)
    config = _checked(config, options, pool, prepared)
    # --continue: whether the engines keep this cell's run, before any engine works; any
    # other run releases what they keep (run/kept.py)
    going_on = kept.going_on(config, prepared, pool or cluster.current_pool())
    segments.remove_orphans()  # shared memory an engine died holding (engine/wire/segments.py)
    if pool is None:
        pool = cluster.ensure_pool(config.engines_to_start())
    # one run per pool: before this run touches an engine, healing included (pool/run_lock.py)
    me = run_lock.Holder.here(prepared.first_line(), session=pool.session_id)
    pool.check_alive()  # a controller that died since the last run: PoolDiedError, at once
    with run_lock.hold(pool.run_lock_path, me, if_busy=config.if_busy) as previous:
        pool.heal()  # engines lost in an earlier run's failure are replaced before this one
        config = _resolve_engines(config, pool)
        if going_on is not None:
            kept.check_engines(going_on, pool)  # heal() may have replaced one
        engines = config.engines or pool.size
        notes = _engines_made_ready(pool, engines, previous, config.if_busy, clean=going_on is None)
        # on a machine whose cores the engines fill, the estimate waits for the run's end
        defer = not pool.multi_host and saturates(engines)
        projection = Projection.for_run(estimate, prepared, config, defer=defer)
        run = TrainingRun(
            pool, config, prepared, list(sinks), live=live, on_failure=on_failure,
            projection=projection, going_on=going_on,
        )  # fmt: skip
        return _executed(run, notes)


def _executed(run: TrainingRun, notes: list[str]) -> TrainResult:
    """The run's result (`notes`: what was done to its engines, warned first), with the state
    its engines keep for --continue and the calls on the live model (run/live.py), a run
    stopped at a step boundary by an interrupt too."""
    for note in notes:
        run.warnings.append(note)
        warnings.warn_explicit(note, RuntimeWarning, "sagenb", 0, module="sagenb")
    try:
        result = run.execute()
    except TrainingInterrupted as err:  # stopped at a step boundary: its state is kept
        if run.kept is not None and err.result is not None:
            err.result.live = LiveRun(run.kept, train)
        raise
    if run.kept is not None:
        result.live = LiveRun(run.kept, train)
    return result


def _checked(
    config: TrainConfig | None,
    options: dict[str, Any],
    pool: cluster.EnginePool | None,
    job: Job,
) -> TrainConfig:
    """The run's config, with what can be checked before any engine checked. Options given
    without a config to a --continue change the kept run's (run/kept.py: `continued`)."""
    if config is None:
        config = kept.continued(options, job) or TrainConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    check_price(config)  # reads the price table: not the config's validation, yet before engines
    event_log.check_available(config)  # --log-dir without tensorboard: before any engine
    _check_offload(config, pool or cluster.current_pool())
    return config


def _engines_made_ready(
    pool: cluster.EnginePool,
    engines: int,
    previous: run_lock.Holder | None,
    if_busy: str,
    *,
    clean: bool = True,
) -> list[str]:
    """The run's engines cleared for it; what to say of what was done. `clean=False`: a
    --continue, whose engines go on as the kept run left them."""
    # tasks still on its engines: a killed kernel's ranks are ended, anyone's work waited
    # for (or PoolBusyError), before this run sends them anything (pool/orphans.py)
    found = orphans.settle(pool, pool.engine_ids[:engines], previous=previous, if_busy=if_busy)
    if not clean:
        return found
    # what an earlier cell changed of the engines' processes is put back, and what they
    # kept of a run released (pool/clean_slate.py)
    return found + clean_slate.start_clean(pool, engines)


def _check_offload(config: TrainConfig, pool: cluster.EnginePool | None) -> None:
    """--offload-activations on a pool of this machine's engines (the one a run starts, or a
    running one on this host), refused before any engine starts where this machine has no
    CUDA device; other hosts' engines check their own device (engine/entry.py)."""
    if config.offload_activations and (pool is None or not pool.multi_host):
        import torch

        check_offload(True, "cuda" if torch.cuda.is_available() else "cpu")


def _resolve_engines(config: TrainConfig, pool: cluster.EnginePool) -> TrainConfig:
    engines = describe(config.strategy).engines_for(config, pool.size)
    if engines > pool.size:
        raise ConfigError(
            "engines",
            engines,
            f"the running pool has {pool.size} engines: lower --engines or run "
            f"`%smp_cluster restart -n {engines}` (sagenb.restart_pool({engines}))",
        )
    return config.with_engines(engines)
