"""The live run in the notebook: what `smp_result` does with the state its engines keep.

`go_on` trains the next segment (`%%smp_train --continue`); `on_engines(fn, *args)` runs
`fn(model, rank, *args)` on every rank with its live model as its strategy holds it, and
`evaluate` and `generate` are two such calls ready-made (engine/live/calls.py); `release`
frees the state. Each takes the pool's run lock as a run does (pool/run_lock.py). A call that
fails on some rank while the others wait for it in a collective is contained as a failing
cell is: those engines are stopped within seconds (killed, and replaced at the next run), and
the kept state, which they held, is released.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sagenb.engine.live import calls
from sagenb.metrics.result import TrainResult
from sagenb.pool import run_lock
from sagenb.run.kept import KeptRun, refuse

__all__ = ["LiveRun", "CallError", "SETTLE_S", "POLL_S"]

SETTLE_S = 2.0  # after one rank's call failed, how long the others get to end on their own
POLL_S = 0.02


class CallError(RuntimeError):
    """A call on the engines raised: the first failing rank's traceback."""


class LiveRun:
    """`run`'s state on its engines; `train` is sagenb.train, for go_on."""

    def __init__(self, run: KeptRun, train: Callable[..., TrainResult]) -> None:
        self.run, self._train = run, train

    def describe(self, name: str = "smp_result") -> str:
        return self.run.describe(name)

    def go_on(self, **options: Any) -> TrainResult:
        if not self.run.live:  # an earlier segment's result: the state went on, or is gone
            raise refuse(self.run.gone())
        # the options left out are the kept run's (run/kept.py: continued)
        return self._train(self.run.job, pool=self.run.pool, continue_=True, **options)

    def release(self) -> None:
        if not self.run.live:
            return
        with self._locked("release"):
            self.run.release_on_engines("smp_result.release()")

    def on_engines(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not callable(fn):
            raise TypeError(f"on_engines takes a function fn(model, rank, ...), not {fn!r}")
        return self._everywhere(calls.call, fn, args)

    def evaluate(self, dataset: Any, *, batch_size: int | None = None) -> float:
        return float(self._everywhere(calls.evaluate, dataset, batch_size)[0])

    def generate(self, input_ids: Any, *, max_new_tokens: int = 20) -> Any:
        import torch

        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"generate takes input_ids as a (batch, length) tensor of token ids, not "
                f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}"
            )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens {max_new_tokens}: must be 0 or more")
        return self._everywhere(calls.generate, input_ids, max_new_tokens)[0]

    # -- on every rank -------------------------------------------------------------------
    def _everywhere(self, work: Callable[..., Any], *args: Any) -> list[Any]:
        if not self.run.live:
            raise refuse(self.run.gone())
        with self._locked(getattr(work, "__name__", "a call")):
            tasks = self.run.pool.submit(work, [(self.run.lineage, *args)] * len(self.run.ids))
            return self._follow(tasks)

    def _follow(self, tasks: list[Any]) -> list[Any]:
        """Every rank's value; the first failure raised once every rank has ended, those
        that do not end within SETTLE_S of it stopped (and the kept state released)."""
        pool, timeout = self.run.pool, self.run.config.timeout
        began = time.monotonic()
        first: int | None = None  # the rank whose failure is the one to show
        stopped: list[int] = []
        try:
            while not all(t.ready() for t in tasks):
                failed = [r for r, t in enumerate(tasks) if t.ready() and not t.successful()]
                if failed or time.monotonic() - began > timeout:
                    first = failed[0] if failed else None
                    stopped = self._contain(tasks, "failed" if failed else "stalled")
                    break
                pool.check_alive()
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self._contain(tasks, "interrupted")
            raise
        if first is None:
            first = next((r for r, t in enumerate(tasks) if not t.successful()), None)
        if first is not None:
            text = _error_text(tasks[first])
            if stopped:
                text += (
                    f"\n(rank {', '.join(map(str, stopped))} did not end within {SETTLE_S:.0f} s "
                    "of it, waiting for it in a collective: stopped, and the kept state released)"
                )
            raise CallError(text) from None
        if time.monotonic() - began > timeout:
            raise CallError(
                f"the call on the engines made no progress for {timeout:.0f} s (--timeout)"
            )
        return [t.get(timeout=0) for t in tasks]

    def _contain(self, tasks: list[Any], why: str) -> list[int]:
        """Ranks still running after another's failure wait for it in a collective: kill
        them (their state goes with them), as a failing run's are (run/containment.py)."""
        pool = self.run.pool
        deadline = time.monotonic() + (SETTLE_S if why == "failed" else 0.0)
        while time.monotonic() < deadline and not all(t.ready() for t in tasks):
            time.sleep(POLL_S)
        ranks = [r for r, t in enumerate(tasks) if not t.ready()]
        if ranks:
            pool.interrupt([self.run.ids[r] for r in ranks])
            time.sleep(SETTLE_S if why != "failed" else 0.0)
            pool.kill([eid for eid, t in zip(self.run.ids, tasks) if not t.ready()])
            self.run.release(f"a call on the engines that {why}, whose ranks had to be stopped")
        return ranks

    @contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        pool = self.run.pool
        me = run_lock.Holder.here(f"smp_result.{what}", session=pool.session_id)
        pool.check_alive()
        with run_lock.hold(pool.run_lock_path, me, if_busy=self.run.config.if_busy):
            yield


def _error_text(task: Any) -> str:
    """The failing rank's traceback as the engine wrote it (calls.CallFailed's text)."""
    try:
        task.get(timeout=0)
    except Exception as err:  # noqa: BLE001 - ipyparallel's RemoteError, whatever raised
        value = getattr(err, "evalue", None) or str(err)
        return str(value)
    return "a rank failed"
