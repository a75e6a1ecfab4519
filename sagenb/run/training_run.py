"""One training run on the pool, from its tasks' submission to its result or its error.

`TrainingRun` submits a task per rank (`run_rank`, engine/entry.py), streams the ranks' metrics
to the sinks (history, dashboard, event files), and collects the merged parameters. When a rank
fails, stalls, the pool dies or the kernel is interrupted, its `Containment`
(run/containment.py) ends every rank within seconds (replacing the engines it had to kill) and
raises what happened, naming the rank (run/failures.py, run/tasks.py): this module says when,
that one how. `train()` (run/session.py) makes one after its checks.
"""

from __future__ import annotations

import math
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from sagenb.config.job import Job
from sagenb.config.options import TrainConfig
from sagenb.display import event_log
from sagenb.engine.entry import RankResult, RankSpec, merge_states, run_rank
from sagenb.engine.model.equivalence import EquivalenceWarning
from sagenb.engine.wire.rendezvous import bound_store, host_for_run
from sagenb.metrics import keys
from sagenb.metrics.result import TrainResult
from sagenb.metrics.stream import History, MetricSink, RankStream
from sagenb.pool import cluster, occupancy
from sagenb.run import kept
from sagenb.run.checkpoints import resume_warnings
from sagenb.run.containment import Containment
from sagenb.run.failures import PoolDiedError, TrainingError, TrainingInterrupted
from sagenb.run.interrupts import InterruptLatch
from sagenb.run.kept import KeptRun
from sagenb.run.output import RankOutput
from sagenb.run.tasks import RankTasks
from sagenb.run.trained import CellModel
from sagenb.sizing.cost import CostMeter, meter_for
from sagenb.sizing.projection import Projection

__all__ = ["TrainingRun", "POLL_S"]

POLL_S = 0.05  # metric polling period; the dashboard throttles its own redraws
CONTROLLER_CHECK_S = 1.0  # how often a run checks that the pool's controller still runs
OUTPUT_S = 10.0  # how long to wait for the last published metrics after a rank returns
#: what the engines say that is no equivalence warning: --resume's notes, the optimizer's mapping
NOTICES = ("--resume:", "make_optimizer's")
LAST_OUTPUT_S = 2.0  # after a failure, how long the ended ranks' last metrics get to arrive
#: the statuses of a run that ended before its last step, whose `stopped_by` says who asked
ENDED_EARLY = ("stopped", "interrupted")


def _rendezvous(pool: cluster.EnginePool, world_size: int, timeout_s: float) -> TCPStore:
    """A fresh torch.distributed store for one run, on a port its host picks: hosted here on
    127.0.0.1 when every engine is on this machine, else by the rank-0 engine on its
    reachable address (engine/wire/rendezvous.py), this notebook connecting to it as a client."""
    if not pool.multi_host:
        return bound_store(cluster.LOOPBACK, world_size, timeout_s)
    rank0 = pool.client[pool.engine_ids[0]]
    task = rank0.apply_async(host_for_run, pool.controller_host, world_size, timeout_s)
    addr, port = pool.result(task, timeout_s)
    return TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


class TrainingRun:
    """One training run on the pool: submit a task per rank, follow, contain, collect."""

    def __init__(
        self,
        pool: cluster.EnginePool,
        config: TrainConfig,
        job: Job,
        sinks: list[MetricSink],
        *,
        live: bool | None = None,
        on_failure: Callable[[str], None] | None = None,
        projection: Projection | None = None,
        going_on: KeptRun | None = None,
    ) -> None:
        self.pool, self.config, self.job = pool, config, job
        #: the kept run this one goes on from (--continue: run/kept.py), or None
        self.going_on = going_on
        self.lineage = going_on.lineage if going_on is not None else secrets.token_hex(8)
        #: the run that keeps this one's state on the engines once it ended, if it does
        self.kept: KeptRun | None = None
        self.on_failure = on_failure
        self.interrupts = InterruptLatch()  # SIGINT recorded while the run is followed
        self.engines = config.engines or pool.size
        self.projection = projection
        self.cost = meter_for(config, self.engines, runs_on=_runs_on(pool), projection=projection)
        # one history across a run's segments (--continue appends to the kept run's)
        self.history = going_on.history if going_on else History(self.engines, config.batch_size)
        self.first_row = len(self.history.steps)
        self.dashboard = self._dashboard(live)
        # after the history, which they read: the event files (--log-dir), the dashboard
        self.event_log = (
            event_log.EventLog(config, self.history, self.engines) if config.log_dir else None
        )
        self.sinks: list[MetricSink] = [
            self.history,
            *sinks,
            *([self.event_log] if self.event_log else []),
            *([self.dashboard] if self.dashboard else []),
        ]
        self.first_step_s: float | None = None
        self.ended: float | None = None  # when the run ended (before any repair of the pool)
        self.last_progress = time.monotonic()
        #: why this run cannot train as one process would (engine/model/equivalence.py), as warned
        self.warnings: list[str] = []
        #: why the run ended before its last step, when it did without an interrupt
        self.stop_reason: str | None = None
        #: what such a run is: "stopped" when asked through `stop`, "interrupted" otherwise
        self.stop_status = "interrupted"
        self.nonfinite_step: int | None = None

    def _dashboard(self, live: bool | None) -> Any:
        """The run's dashboard (None with --no-dashboard), marking the segments gone on from."""
        if not self.config.dashboard:
            return None
        board = _make_dashboard(self.config, self.cost, self.history, live, on_stop=self.stop)
        if self.going_on is not None:
            board.segments = [*self.going_on.segments, self.going_on.step + 1]
        return board

    def execute(self) -> TrainResult:
        self.token = secrets.token_hex(16)  # never written to the store before a stop request
        # --resume: which checkpoint, and whether its options still hold, before any engine works
        self.warnings += resume_warnings(self.config, self.engines)
        self.store = (
            self.going_on.store  # the kept process group's, which its engines still use
            if self.going_on is not None
            else _rendezvous(self.pool, self.engines, self.config.collective_timeout)
        )
        specs = self._specs()
        self.started = time.perf_counter()
        self.ids = self.pool.engine_ids[: self.engines]
        self.ars = self.pool.submit(run_rank, specs)
        self.tasks = RankTasks(self.ars, self.ids)
        # whether each task has started or waits behind another client's (pool/occupancy.py)
        self.starts = occupancy.Starts(self.pool, self.ids, [ar.msg_ids[0] for ar in self.ars])
        self.containment = Containment(
            self.pool,
            self.tasks,
            self.starts,
            ids=self.ids,
            store=self.store,
            token=self.token,
            on_failure=self.on_failure,
            mark_end=self._mark_end,
        )
        self.streams = [RankStream(r, ar) for r, ar in enumerate(self.ars)]
        self.output = RankOutput(self.ars[0])  # rank 0's prints, logs, warnings, bars: once
        try:
            return self._run()
        finally:
            # the store's port closes now, not when the traceback that holds this run goes
            del self.store
            self.containment.close()

    def _specs(self) -> list[tuple[RankSpec]]:
        """Each rank's RankSpec, as its task's arguments."""
        for_engines = self.config.for_engines()  # the notebook's own options stay here
        return [
            (
                RankSpec(
                    r,
                    self.engines,
                    self.store.host,
                    self.store.port,
                    # the host's cores shared by its engines (counted on this machine)
                    self.config.threads_per_engine(local_size),
                    for_engines,
                    self.job,
                    local_rank=local_rank,
                    local_size=local_size,
                    token=self.token,
                    lineage=self.lineage,
                    continues=self.going_on is not None,
                ),
            )
            for r, (local_rank, local_size) in enumerate(self.pool.local_ranks(self.engines))
        ]

    def _run(self) -> TrainResult:
        with self.interrupts:
            return self._run_recorded()

    def _run_recorded(self) -> TrainResult:
        try:
            self._follow()
            results = self._collect()
        except KeyboardInterrupt:
            self.interrupts.answered()
            self.stop_reason = "the kernel's interrupt (KeyboardInterrupt)"
            raise TrainingInterrupted(self._interrupted()) from None
        except BaseException as err:
            # one place ends a run: whatever failed here (a sink, the dashboard, the cost
            # meter), no rank trains on into the next run's time (a pool that died or was
            # stopped has no rank left to stop: Containment.pool_died saw to them)
            if not isinstance(err, PoolDiedError):
                self.containment.stop_ranks()
            kept.released("the run that failed")  # the failing ranks released theirs
            self._last_metrics()
            self._close_sinks(status="failed")
            _attach(err, self._failed())
            raise
        unsaved = any(r.end_error is not None for r in results)
        status = "failed" if unsaved else self._status(results)
        self._close_sinks(status=status)
        self._keep(results, status)
        result = self._when_projected(self._result(results, status=status))
        self._end_errors(results, result)
        return result

    def _keep(self, results: list[RankResult], status: str) -> None:
        """Remember the state every rank kept (run/kept.py), or that none is kept."""
        if not results or any(r.kept_mib is None for r in results):
            kept.released("the run that did not keep it")
            return
        self.kept = KeptRun(
            pool=self.pool,
            lineage=self.lineage,
            job=self.job,
            config=self.config,
            ids=list(self.ids),
            pids=[self.pool.pids.get(e) for e in self.ids],
            store=self.store,
            history=self.history,
            segments=self._segments(),
            step=min(r.steps for r in results),
            planned=self._planned(),
            status=status,
            mib=[r.kept_mib or 0.0 for r in results],
        )
        kept.keep(self.kept)

    def _failed(self) -> TrainResult | None:
        """The failed run as far as it went: its history, and its parameters when every rank
        returned them (a failure after the last step)."""
        try:
            done = [ar.get(timeout=0) for ar in self.ars if ar.ready() and ar.successful()]
            return self._result(done if len(done) == len(self.ars) else None, status="failed")
        except Exception:  # noqa: BLE001 - the run's own error is the one to show
            return None

    def _end_errors(self, results: list[RankResult], result: TrainResult) -> None:
        """A rank that trained to the end but could not write its final checkpoint: the run
        fails with that error, keeping the trained result on it (and in smp_result)."""
        failed = [r for r in results if r.end_error is not None]
        if failed:
            first = next((r for r in failed if r.end_error), failed[0])
            detail = (
                f"the checkpoint of step {first.steps} could not be written to "
                f"--checkpoint-dir {self.config.checkpoint_dir}: {first.end_error or '?'}. "
                f"Training stopped there and nothing it trained is lost: the run's history "
                f"and parameters are in this error's `result` (smp_result in a notebook)."
            )
            raise _attach(TrainingError(first.rank, self.ids[first.rank], detail), result)

    def _status(self, results: list[RankResult]) -> str:
        """ "done" only when every rank finished the planned steps; a run that ended early is
        "stopped" (the Stop button, `stop`) or "interrupted" and says who asked (a request
        this notebook did not send is warned about: it carried the run's token, so it came
        from one of the run's own ranks)."""
        planned = self._planned()
        last = min(r.steps for r in results)
        if planned is None or last >= planned:
            return "done"
        if self.stop_reason is None:
            self.stop_reason = (
                "a stop request this notebook did not send, with the run's token (so from "
                "one of the run's own ranks: the cell?)"
            )
            warnings.warn_explicit(
                f"the run stopped after step {last} of {planned}: {self.stop_reason}",
                RuntimeWarning,
                "sagenb",
                0,
                module="sagenb",
            )
        return self.stop_status

    def _planned(self) -> int | None:
        """The steps the run makes, as its latest step said: fixed for a map-style dataset; a
        stream's is --steps (or None) until the engines read its end (engine/data/stream.py)."""
        records = self.history.records
        return records[-1].values.get(keys.TOTAL_STEPS) if records else None

    def _result(self, results: list[RankResult] | None, *, status: str) -> TrainResult:
        wall = self.wall_s  # as the dashboard shows it
        cost, label = self._cost(wall)
        return TrainResult(
            config=self.config,
            # copies: a --continue appends to the kept run's history, not to this result's
            history=list(self.history.steps),
            metrics=list(self.history.records),
            wall_time_s=wall,
            time_to_first_step_s=self.first_step_s if self.first_step_s is not None else wall,
            cost_usd=cost,
            cost_label=label,
            engines=self.engines,
            device=results[0].device if results else "unknown",
            source=self.job.source,
            status=status,
            _state_dict=(
                merge_states([r.state_dict for r in results], results[0].key_order)
                if results
                else {}
            ),
            dashboard=self.dashboard,
            warnings=list(self.warnings),
            stopped_by=self.stop_reason if status in ENDED_EARLY else None,
            model_source=CellModel(self.job, self.config.seed, self.config.delay_init),
            segments=self._segments(),
            billed=self.cost.billed_here,
        )

    def _segments(self) -> list[int]:
        """The first step of each of the run's segments (--continue), as far as it went."""
        before = self.going_on.segments if self.going_on is not None else []
        rows = self.history.steps[self.first_row :]
        return [*before, *([rows[0][keys.STEP]] if rows else [])]

    def _cost(self, wall: float) -> tuple[float, str]:
        """What the run cost; a price the meter cannot use costs the result nothing."""
        try:
            rows = self.history.steps
            total = self._planned() or len(rows)
            label = f"{self.cost.this_run(wall)}; {self.cost.projected_on(total, len(rows))}"
            return self.cost.cost(wall), label
        except Exception as err:  # noqa: BLE001 - checked before the run; never lose it here
            note = f"the run's cost could not be computed: {type(err).__name__}: {err}"
            self.warnings.append(note)
            warnings.warn_explicit(note, RuntimeWarning, "sagenb", 0, module="sagenb")
            return math.nan, "cost unknown"

    # -- following the run -----------------------------------------------------------------
    def _follow(self) -> None:
        """Stream metrics to the sinks until every rank is done; stop all on the first
        failure, or when no rank has made progress for --timeout seconds."""
        checked = time.monotonic()
        while True:
            self.interrupts.check()  # an interrupt Python swallowed where it landed
            done = [ar.ready() for ar in self.ars]
            self._drain()
            if time.monotonic() - checked > CONTROLLER_CHECK_S:
                checked = time.monotonic()
                if not self.pool.controller_alive():
                    self.containment.pool_died()
            if any(d and not ar.successful() for d, ar in zip(done, self.ars)):
                self._fail()
            if all(done):
                self.starts.end()  # a rank that waited for its engine may end before a check
                self._queued()
                return
            self._queued()
            if time.monotonic() - self.last_progress > self.config.timeout:
                self._stall()
            if self.dashboard is not None:
                self.dashboard.tick(time.perf_counter() - self.started)
            time.sleep(POLL_S)

    def _queued(self) -> None:
        """A rank whose task waits behind another client's task on its engine has not
        started: the stall clock (--timeout) does not run until every rank's has, and that
        engine is never signalled (`Containment.ours`). What the run waited for is warned once."""
        if self.starts.waiting():
            self.last_progress = time.monotonic()
        elif self.starts.waited is not None and self.starts.waited not in self.warnings:
            self.warnings.append(self.starts.waited)
            warnings.warn_explicit(self.starts.waited, RuntimeWarning, "sagenb", 0, module="sagenb")

    def _drain(self) -> None:
        self.output.drain()
        for stream in self.streams:
            for rec in stream.drain():
                self.last_progress = time.monotonic()
                if self.first_step_s is None:
                    self.first_step_s = time.perf_counter() - self.started
                self._warn(rec.values.get(keys.WARNINGS, ()))
                self._check_finite(rec)
                for sink in self.sinks:
                    sink.log(rec.values, rec.step, rec.rank)

    def _warn(self, notes: Sequence[str]) -> None:
        """Each equivalence warning once per run: under the cell in a notebook (stderr), and
        through `warnings` for scripts (sagenb registers its category "always", so a second
        run in the same kernel warns again). --resume's notes travel the same way, for what
        only the engines found (a checkpoint whose data fails to load): RuntimeWarnings, as
        the notebook's own (run/checkpoints.py); so does what was done with the cell's
        make_optimizer (engine/user_optimizer.py), which keeps the run equal to one process."""
        for note in notes:
            if note not in self.warnings:
                self.warnings.append(note)
                kind = RuntimeWarning if note.startswith(NOTICES) else EquivalenceWarning
                # no source line of sagenb's under the cell: the warning is about the cell
                warnings.warn_explicit(note, kind, "sagenb", 0, module="sagenb")

    def _check_finite(self, rec: Any) -> None:
        """The first NaN or infinite loss is warned about (and, with --stop-on-nonfinite, ends
        the run at a step boundary through the same stop request as an interrupt)."""
        loss = rec.values.get(keys.LOSS)
        if self.nonfinite_step is not None or loss is None or math.isfinite(loss):
            return
        self.nonfinite_step = rec.step
        what = f"the loss of step {rec.step} on rank {rec.rank} is {loss}"
        if self.config.stop_on_nonfinite:
            self.stop(f"{what} (--stop-on-nonfinite)", status="interrupted")
            note = f"{what}: the run stops after this step (--stop-on-nonfinite)"
        else:
            note = f"{what}: training goes on; --stop-on-nonfinite ends the run at the first one"
        self.warnings.append(note)
        if self.dashboard is not None:
            self.dashboard.warnings.append(note)
        warnings.warn_explicit(note, RuntimeWarning, "sagenb", 0, module="sagenb")

    def stop(self, by: str, *, status: str = "stopped") -> None:
        """End the run at the next step boundary on every rank, nothing lost (the dashboard's
        Stop button, --stop-on-nonfinite): the run ends `status`, and its result's
        `stopped_by` and the dashboard's header say `by`, the first to ask."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_status = by, status
        self.containment.request_stop()

    def _collect(self) -> list[RankResult]:
        results: list[RankResult] = [ar.get(timeout=0) for ar in self.ars]  # all ready
        for ar in self.ars:  # published data can trail the result on ipyparallel's IOPub
            ar.wait_for_output(timeout=OUTPUT_S)
        self._drain()
        for stream, res in zip(self.streams, results):
            if stream.received != res.published:
                raise RuntimeError(
                    f"rank {res.rank} published {res.published} metric messages but "
                    f"{stream.received} arrived within {OUTPUT_S:.0f} s"
                )
        return results

    # -- when things go wrong (run/containment.py ends the ranks) ----------------------
    def _fail(self) -> None:
        self.containment.fail(drain=self._drain, memory=self.history.memory)

    def _stall(self) -> None:
        self.containment.stall(
            steps=self.history.last_steps(),
            timeout=self.config.timeout,
            source=self.job.source or "",  # a callable job has no cell source to point into
        )

    def _last_metrics(self) -> None:
        """The run failed: what every rank finished reaches the sinks before they close.
        A rank that ended with an error of its own flushed its last steps (engine/entry.py),
        which can trail its task's result on IOPub (as in _collect); a rank whose engine died
        or was killed took its unsent steps with it, which the history settles from the steps
        the other ranks reported (History.settle)."""
        deadline = time.monotonic() + LAST_OUTPUT_S
        for rank, ar in enumerate(self.ars):
            if ar.ready() and not self.tasks.died(rank):
                ar.wait_for_output(timeout=max(0.0, deadline - time.monotonic()))
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - a sink's own error is the run's error already
            pass
        lost = [r for r in range(self.engines) if self.tasks.died(r)]
        settled = self.history.settle(lost)
        if settled and self.dashboard is not None:
            self.dashboard.warnings.append(
                f"rank {', '.join(map(str, lost))}'s metrics of steps {settled[0]}-"
                f"{settled[-1]} were lost with its engine: those steps show the other ranks'"
            )

    def _interrupted(self) -> TrainResult:
        """Ask every rank to stop after the same step (engine/wire/stopping.py);
        if they have not within seconds, interrupt and contain them. Return what was done."""
        self.containment.notice("interrupted")
        results = None
        try:
            self.containment.request_stop()
            if self.containment.stopped_in_time() and not self.tasks.failed():
                results = self._collect()
        except KeyboardInterrupt:  # a second interrupt: stop at once
            pass
        if results is None:
            self.containment.interrupt_and_contain()
            kept.released("the interrupt that stopped its ranks mid-step")
            self._last_metrics()
        self._close_sinks(status="interrupted")
        if results is not None:
            self._keep(results, "interrupted")
        return self._result(results, status="interrupted")

    def _mark_end(self) -> None:
        if self.ended is None:
            self.ended = time.perf_counter()

    def _when_projected(self, result: TrainResult) -> TrainResult:
        """The run's projection, made in the background, may come after the run: the
        result's cost label and the dashboard's header take it when it does."""

        def projected() -> None:
            result.cost_label = self._cost(result.wall_time_s)[1]
            if self.dashboard is not None:
                self.dashboard.redraw_header()

        result.projection = self.projection
        if self.projection is not None and self.projection.pending:
            self.projection.on_end(projected)
        return result

    def _close_sinks(self, *, status: str) -> None:
        self._mark_end()
        assert self.ended is not None  # _mark_end just set it
        self.wall_s = self.ended - self.started
        if self.projection is not None:  # a deferred estimate (projection.saturates) starts
            self.projection.release()
        self.output.drain(final=True)  # its output has arrived (_collect, _last_metrics)
        if self.dashboard is not None:
            by = self.stop_reason if status in ENDED_EARLY else None
            self.dashboard.finish(self.wall_s, status=status, stopped_by=by)
        for sink in self.sinks:
            sink.close()


def _attach(err: BaseException, result: TrainResult | None) -> BaseException:
    """`err` with the failed run on it, as `err.result` (the magic keeps it in smp_result)."""
    if result is not None and getattr(err, "result", None) is None:
        try:
            err.result = result  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that takes no attributes
            pass
    return err


def _runs_on(pool: cluster.EnginePool) -> str | None:
    """What the engines run on, for the cost meter: a pool on this machine sees this
    machine's hardware (its first GPU's name, else "cpu"); other hosts' is not known here."""
    if pool.multi_host:
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _make_dashboard(
    config: TrainConfig,
    cost: CostMeter,
    history: History,
    live: bool | None,
    *,
    on_stop: Callable[[str], None],
):
    from sagenb.display.dashboard import (
        Dashboard,  # plotly is imported only when a dashboard is shown
    )

    return Dashboard(config, cost, history=history, live=live, on_stop=on_stop)
