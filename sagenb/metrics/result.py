"""What a training run leaves in the notebook: history, full parameters, time and cost, and
the trained model itself, built again in the kernel (run/trained.py builds it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sagenb.config.registry import describe
from sagenb.metrics import keys
from sagenb.metrics.stream import StepMetrics

if TYPE_CHECKING:  # named in annotations only: a result loads without torch or the options
    import torch
    from torch import nn

    from sagenb.config.options import TrainConfig

__all__ = ["TrainResult", "ModelSource"]


class ModelSource(Protocol):
    """How a run's model is built again in the kernel (sagenb.run.trained.CellModel)."""

    def trained(self, state_dict: Mapping[str, torch.Tensor]) -> nn.Module: ...

    def save_pretrained(
        self,
        state_dict: Mapping[str, torch.Tensor],
        directory: str | Path,
        *,
        merge: bool = False,
        **kwargs: Any,
    ) -> Path: ...


class LiveModel(Protocol):
    """The run's state kept on its engines (sagenb.run.live.LiveRun)."""

    def go_on(self, **options: Any) -> TrainResult: ...

    def release(self) -> None: ...

    def on_engines(self, fn: Any, *args: Any) -> list[Any]: ...

    def evaluate(self, dataset: Any, *, batch_size: int | None = None) -> float: ...

    def generate(self, input_ids: Any, *, max_new_tokens: int = 20) -> Any: ...

    def describe(self, name: str = ...) -> str: ...


@dataclass
class TrainResult:
    """The result of `%%smp_train` (`smp_result`) or `sagenb.train`."""

    config: TrainConfig
    #: one row per optimizer step: step, epoch, loss (whole global batch), rank_losses, lr,
    #: step_time(s), throughput(samples/s), and grad_norm / eval_loss when measured (the first
    #: row also has rank 0's "warnings", when any)
    history: list[dict[str, Any]]
    #: every rank's raw metrics, (step, rank, values), in arrival order
    metrics: list[StepMetrics]
    #: seconds from submitting the run to the last rank's result
    wall_time_s: float
    #: seconds from submitting the run to the first step's metrics
    time_to_first_step_s: float
    #: the measured time at --instance's price: what the run costs when the engines run on
    #: that kind of hardware (cost_label says whether they did)
    cost_usd: float
    #: "this run: ..." (measured; priced only on the instance's hardware) and "projected on
    #: I: ..." (from the estimate, when one was made), kept apart
    cost_label: str
    engines: int
    device: str
    #: the cell's source, when the job was a cell (None for a callable)
    source: str | None
    #: "done" (every planned step), "stopped" (ended early at a step boundary by the
    #: dashboard's Stop button, parameters and history whole), "interrupted" (by the kernel's
    #: interrupt, or at a step boundary by --stop-on-nonfinite; the parameters when the ranks
    #: stopped cleanly) or "failed" (the history up to the failure, as `err.result` and
    #: smp_result; the parameters when every rank returned them, e.g. when only the final
    #: checkpoint failed). A run that ended early says who asked in `stopped_by`.
    status: str
    _state_dict: dict[str, torch.Tensor] = field(repr=False)
    dashboard: Any = field(default=None, repr=False)
    #: why this run cannot equal one process's training (BatchNorm per microbatch or slice,
    #: dropout drawn per engine), one sentence each with what to do; [] when it can
    warnings: list[str] = field(default_factory=list)
    #: who ended a "stopped" or "interrupted" run early: the dashboard's Stop button, the
    #: kernel's interrupt, --stop-on-nonfinite (and the step), or a stop request the notebook
    #: did not send; None otherwise
    stopped_by: str | None = None
    #: builds the cell's model again in the kernel, for model() and save_pretrained(); None
    #: for a result made by hand
    model_source: ModelSource | None = field(default=None, repr=False)
    #: the run's projection on --instance (sagenb.sizing.projection.Projection), which may
    #: come after the run: `cost_label` takes it then
    projection: Any = field(default=None, repr=False)
    #: whether cost_usd is what the run cost: its engines ran on --instance's kind of
    #: hardware; else it is the measured seconds at the instance's price, a what-if
    billed: bool = True
    #: the first step of each segment of the run (one more with each --continue): the
    #: history is one across them
    segments: list[int] = field(default_factory=list)
    #: the run's state as its engines keep it, for go_on(), on_engines(), evaluate(),
    #: generate() and release() (sagenb.run.live.LiveRun); None once released or never kept
    live: LiveModel | None = field(default=None, repr=False)

    # -- the run's state kept on its engines (--continue, docs/interactive.md) ------------
    def go_on(self, steps: int | None = None, **options: Any) -> TrainResult:
        """Go on training from the state the engines keep, as `%%smp_train --continue` does:
        `steps` is the run's new total (`--steps`), and `options` may change --lr,
        --epochs, --eval-every and the other options a --continue may change. Returns the
        result of the segment, whose history is the whole run's."""
        if steps is not None:
            options["steps"] = steps
        return self._live().go_on(**options)

    def release(self) -> None:
        """Free what the engines keep of this run (its model, optimizer and process group)."""
        self._live().release()

    def on_engines(self, fn: Any, *args: Any) -> list[Any]:
        """`fn(model, rank, *args)` on every engine, with that rank's live model as the
        strategy holds it (a shard, a stage or a tensor-parallel slice); each rank's return
        value, in rank order."""
        return self._live().on_engines(fn, *args)

    def evaluate(self, dataset: Any, *, batch_size: int | None = None) -> float:
        """The mean loss over `dataset` of the live model on the engines, computed by the
        strategy as its --eval-every is (a pipeline through its stages): one process's."""
        return self._live().evaluate(dataset, batch_size=batch_size)

    def generate(self, input_ids: Any, *, max_new_tokens: int = 20) -> Any:
        """Greedy tokens of the live causal LM on the engines, appended to `input_ids` (a
        (batch, length) tensor of token ids), without gathering the model here."""
        return self._live().generate(input_ids, max_new_tokens=max_new_tokens)

    def _live(self) -> LiveModel:
        if self.live is None:
            raise RuntimeError(
                "the engines keep no state of this run (it failed, or its result was made by "
                "hand): train it again, or --resume from a checkpoint"
            )
        return self.live

    def wait_for_projection(self, timeout_s: float = 30.0) -> bool:
        """Wait up to `timeout_s` for the projection on --instance that the run makes of
        itself in the background (its estimate runs on CPU time the engines leave idle, so
        on a busy machine it may come seconds after the run); whether it has come (or failed:
        `cost_label` then says why). `summary()` never waits: it shows what is known."""
        return self.projection is None or self.projection.wait(timeout_s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full trained model's state_dict, with the keys of `model.state_dict()`."""
        if not self._state_dict:
            raise RuntimeError(
                f"this run was {self.status} before its parameters could be collected "
                f"(after {len(self.history)} steps); its history is complete up to there"
            )
        return dict(self._state_dict)

    def model(self) -> nn.Module:
        """The trained model in this kernel, to generate with or evaluate: the cell's `model`
        holding `state_dict()`, on the CPU, in eval mode (`.train()` to train on).

        It costs running the whole cell once more, here, in this process: its imports, its
        model and its dataset (whatever the cell loads or tokenizes is loaded again; only the
        engines ran it so far). It runs after seeding as the engines seed it (--seed), in a
        fresh namespace, leaving the kernel's random state as it was; sagenb's own checks and
        first batch are skipped, and the dataset is dropped once the model is built. With
        --delay-init the parameters are never initialised here: they are allocated and filled
        with the trained values. Each call builds a new model: keep the one it returns.
        """
        return self._source().trained(self.state_dict())

    def save_pretrained(self, directory: str | Path, *, merge: bool = False, **kwargs: Any) -> Path:
        """Write the trained model to `directory` in its library's format; returns the Path.

        A transformers model (transformers.PreTrainedModel): its `save_pretrained`, config.json
        and model.safetensors, loaded back by `AutoModelFor...from_pretrained(directory)`. A
        peft model (peft.PeftModel): its adapter alone (adapter_config.json and
        adapter_model.safetensors), loaded back by `PeftModel.from_pretrained(base,
        directory)` on the base the cell started from; with `merge=True` the adapter merged
        into the base (`merge_and_unload()`) is written as a plain transformers model. Any
        other model raises, naming its class: save `state_dict()` with torch.save. Every
        strategy writes the same files: the state_dict is the full one. `kwargs` go to the
        library's save_pretrained. Builds the model as `model()` does, at the same cost.
        """
        return self._source().save_pretrained(self.state_dict(), directory, merge=merge, **kwargs)

    def _source(self) -> ModelSource:
        if self.model_source is None:
            raise RuntimeError(
                "this result does not know how its model was built (it was made by hand, not "
                "by a run): load state_dict() into your model with model.load_state_dict"
            )
        return self.model_source

    @property
    def losses(self) -> list[float]:
        return [row[keys.LOSS] for row in self.history]

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        return [
            (row[keys.STEP], row[keys.EVAL_LOSS]) for row in self.history if keys.EVAL_LOSS in row
        ]

    def summary(self) -> str:
        last = self.history[-1] if self.history else {}
        loss = f"final loss {last[keys.LOSS]:.4g}" if last else "no steps"
        status = "" if self.status == "done" else f"{self.status}: "
        if self.stopped_by:
            status = f"{self.status} by {self.stopped_by}: "
        layout = describe(self.config.strategy).layout(self.config, self.engines)
        steps = f"{len(self.history)} steps"
        if len(self.segments) > 1:  # the time and the cost are the last segment's
            segment = sum(1 for row in self.history if row[keys.STEP] >= self.segments[-1])
            steps = f"{steps}, the last {segment} after --continue"
        return (
            f"{status}{layout}: {steps} ({self.device}) in "
            f"{self.wall_time_s:.1f} s, {loss}; {self.cost_label}"
        )

    def __repr__(self) -> str:
        return f"<TrainResult {self.summary()}>"
