"""What a training run leaves in the notebook: history, full parameters, time and cost, and
the trained model itself, built again in the kernel (run/trained.py builds it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from sagenb.config.options import TrainConfig, describe
from sagenb.metrics import keys
from sagenb.metrics.stream import StepMetrics

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
        return (
            f"{status}{layout}: {len(self.history)} steps ({self.device}) in "
            f"{self.wall_time_s:.1f} s, {loss}; {self.cost_label}"
        )

    def __repr__(self) -> str:
        return f"<TrainResult {self.summary()}>"
