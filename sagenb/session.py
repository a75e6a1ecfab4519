"""The client side of one training run: check, submit to the pool, stream metrics, collect.

`train()` is the plain Python API; `%%smp_train` is a thin adapter over it. Everything that can
be checked without engines is checked before any engine runs user code.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from torch.distributed import TCPStore

from sagenb import cluster
from sagenb.config import ConfigError, TrainConfig
from sagenb.cost import CostMeter, instance_price
from sagenb.engine.entry import RankResult, RankSpec, run_rank
from sagenb.job import Job, JobError
from sagenb.metrics import History, MetricSink, RankStream
from sagenb.result import TrainResult

__all__ = ["train", "prepare", "TrainingError"]

POLL_S = 0.05  # metric polling period; the dashboard throttles its own redraws
SETTLE_S = 1.0  # after a failure, how long the other ranks get to end on their own
RELEASE_S = 5.0  # how long ranks get to end after the engines blocking them are killed
OUTPUT_S = 10.0  # how long to wait for the last published metrics after a rank returns


class TrainingError(RuntimeError):
    """A rank failed; the message carries its rank, engine id and traceback."""

    def __init__(self, rank: int, engine_id: int, detail: str) -> None:
        self.rank, self.engine_id, self.detail = rank, engine_id, detail
        super().__init__(f"rank {rank} (engine {engine_id}) failed:\n{detail}")


def prepare(job: str | Callable[[], Any] | Job, config: TrainConfig) -> Job:
    """The job, checked without running it (a cell that defines no model fails here)."""
    if isinstance(job, Job):
        return job
    return Job.from_cell(job) if isinstance(job, str) else Job.from_callable(job)


def train(
    job: str | Callable[[], Any] | Job,
    config: TrainConfig | None = None,
    *,
    pool: cluster.EnginePool | None = None,
    sinks: Sequence[MetricSink] = (),
    **options: Any,
) -> TrainResult:
    """Train `job` (cell source, or a callable returning {'model', 'dataset', 'loss_fn', ...}).

    Options are the fields of TrainConfig (`batch_size=64, strategy="data"`), or pass a config.
    Uses the running pool (or `pool`), starting one of `engines` engines when none runs.
    """
    if config is None:
        config = TrainConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    prepared = prepare(job, config)
    if pool is None:
        pool = cluster.ensure_pool(_pool_size_for(config))
    config = _resolve_engines(config, pool)
    return _Run(pool, config, prepared, list(sinks)).execute()


def _pool_size_for(config: TrainConfig) -> int:
    """Engines to start when no pool runs."""
    if config.engines is not None:
        return config.engines
    if config.strategy == "model":
        return config.partitions
    if config.strategy == "hybrid":
        return 2 * config.partitions
    return cluster.DEFAULT_ENGINES


def _resolve_engines(config: TrainConfig, pool: cluster.EnginePool) -> TrainConfig:
    if config.strategy == "model":
        engines = config.partitions
    else:
        engines = config.engines if config.engines is not None else pool.size
    if engines > pool.size:
        raise ConfigError(
            "engines",
            engines,
            f"the running pool has {pool.size} engines: lower --engines or run "
            f"`%smp_cluster restart -n {engines}` (sagenb.restart_pool({engines}))",
        )
    return config.with_engines(engines)


def _rendezvous(world_size: int, timeout_s: float) -> TCPStore:
    """A fresh torch.distributed store on 127.0.0.1, on a port the OS picks, for one run."""
    return TCPStore(
        cluster.LOOPBACK,
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


class _Run:
    def __init__(
        self, pool: cluster.EnginePool, config: TrainConfig, job: Job, sinks: list[MetricSink]
    ) -> None:
        self.pool, self.config, self.job = pool, config, job
        self.engines = config.engines or pool.size
        self.cost = CostMeter(instance_price(config.instance), self.engines)
        self.history = History(self.engines, config.batch_size)
        self.dashboard = _make_dashboard(config, self.cost) if config.dashboard else None
        self.sinks = [self.history, *sinks, *([self.dashboard] if self.dashboard else [])]
        self.first_step_s: float | None = None

    def execute(self) -> TrainResult:
        threads = self.config.threads or max(1, (os.cpu_count() or 1) // self.engines)
        store = _rendezvous(self.engines, self.config.timeout)  # kept alive for the whole run
        specs = [
            (
                RankSpec(
                    r, self.engines, cluster.LOOPBACK, store.port, threads, self.config, self.job
                ),
            )
            for r in range(self.engines)
        ]
        started = time.perf_counter()
        self.ids = self.pool.engine_ids[: self.engines]
        ars = self.pool.submit(run_rank, specs)
        streams = [RankStream(r, ar) for r, ar in enumerate(ars)]
        try:
            self._follow(ars, streams, started)
            results = self._collect(ars, streams)
        except BaseException:
            self._close_sinks(time.perf_counter() - started, failed=True)
            raise
        wall = time.perf_counter() - started
        self._close_sinks(wall, failed=False)
        return TrainResult(
            config=self.config,
            history=self.history.steps,
            metrics=self.history.records,
            wall_time_s=wall,
            time_to_first_step_s=self.first_step_s if self.first_step_s is not None else wall,
            cost_usd=self.cost.cost(wall),
            cost_label=self.cost.label(wall),
            engines=self.engines,
            device=results[0].device,
            source=self.job.source,
            _state_dict=_merge_state(results),
            dashboard=self.dashboard,
        )

    def _follow(self, ars: list, streams: list[RankStream], started: float) -> None:
        """Stream metrics to the sinks until every rank is done; stop all on the first failure."""
        try:
            while True:
                done = [ar.ready() for ar in ars]
                self._drain(streams, started)
                if any(d and not ar.successful() for d, ar in zip(done, ars)):
                    self._fail(ars)
                if all(done):
                    return
                if self.dashboard is not None:
                    self.dashboard.tick(time.perf_counter() - started)
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self.pool.interrupt([self.ids[r] for r, ar in enumerate(ars) if not ar.ready()])
            self._contain(ars)
            raise

    def _drain(self, streams: list[RankStream], started: float) -> None:
        for stream in streams:
            for rec in stream.drain():
                if self.first_step_s is None:
                    self.first_step_s = time.perf_counter() - started
                for sink in self.sinks:
                    sink.log(rec.values, rec.step, rec.rank)

    def _collect(self, ars: list, streams: list[RankStream]) -> list[RankResult]:
        results: list[RankResult] = [ar.get() for ar in ars]
        for ar in ars:  # published data can trail the result on ipyparallel's IOPub channel
            ar.wait_for_output(timeout=OUTPUT_S)
        self._drain(streams, 0.0)
        for stream, res in zip(streams, results):
            if stream.received != res.published:
                raise RuntimeError(
                    f"rank {res.rank} published {res.published} metric messages but "
                    f"{stream.received} arrived within {OUTPUT_S:.0f} s"
                )
        return results

    def _contain(self, ars: list) -> None:
        """After a failure or an interrupt: every rank ends within seconds, the pool heals."""
        if self._wait_all(ars, SETTLE_S):
            return
        # Some rank is still running: blocked in a collective with a failed rank whose
        # connections stayed open, or busy in user code. Kill the failed ranks' engines (their
        # death closes every connection), then any rank that still does not stop.
        failed = [self.ids[r] for r, ar in enumerate(ars) if ar.ready() and not ar.successful()]
        self.pool.kill(failed)
        if not self._wait_all(ars, RELEASE_S):
            stuck = [self.ids[r] for r, ar in enumerate(ars) if not ar.ready()]
            self.pool.kill(stuck)
            self._wait_all(ars, RELEASE_S)
        self.pool.heal()

    @staticmethod
    def _wait_all(ars: list, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not all(ar.ready() for ar in ars):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _fail(self, ars: list) -> None:
        self._contain(ars)
        failed = [r for r, ar in enumerate(ars) if ar.ready() and not ar.successful()]
        first = min(failed, key=lambda r: ars[r].metadata.get("completed") or datetime.max)
        err = ars[first].exception()
        ename = getattr(err, "ename", type(err).__name__)
        evalue = getattr(err, "evalue", str(err))
        if ename == "JobError":
            raise JobError(evalue)
        raise TrainingError(first, self.ids[first], evalue)

    def _close_sinks(self, elapsed: float, *, failed: bool) -> None:
        if self.dashboard is not None:
            self.dashboard.finish(elapsed, failed=failed)
        for sink in self.sinks:
            sink.close()


def _merge_state(results: list[RankResult]) -> dict:
    """The full state_dict from the ranks' parts, in the unsplit model's key order."""
    parts: dict = {}
    for res in results:
        parts.update(res.state_dict or {})
    missing = [k for k in results[0].key_order if k not in parts]
    if missing:
        raise RuntimeError(f"no rank returned {', '.join(missing[:5])}")
    return {k: parts[k] for k in results[0].key_order}


def _make_dashboard(config: TrainConfig, cost: CostMeter):
    from sagenb.dashboard import Dashboard  # plotly is imported only when a dashboard is shown

    return Dashboard(config, cost)
