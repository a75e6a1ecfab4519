"""`sagenb.ControlPanel()`: ipywidgets that set the options of `%%smp_train` and manage the pool.

The panel only produces a TrainConfig: it validates as the user types (an impossible
combination shows why, in place), shows the equivalent `%%smp_train` line, and
`%%smp_train --config panel` trains a cell with it through the one code path the magic uses.
Its buttons start, stop and restart the pool, and Plan shows the pipeline bubble and the
instance cost, and the cut points when the panel was given the cell (`ControlPanel(job=...)`).
This module owns ipywidgets.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import ipywidgets as widgets

from sagenb.config.errors import ConfigError
from sagenb.config.options import (
    PARTITION_METHODS,
    PRECISIONS,
    SCHEDULES,
    TrainConfig,
    describe,
    strategy_names,
)
from sagenb.pool import cluster
from sagenb.sizing.cost import check_price, price_table

__all__ = ["ControlPanel", "current_panel"]

_current: ControlPanel | None = None


def current_panel() -> ControlPanel | None:
    """The panel created last (what `%%smp_train --config panel` uses)."""
    return _current


LABELS = {
    "steps": "steps (0: all)",
    "tensor_parallel": "tensor parallel (0: all)",
    "activation_checkpointing": "recompute blocks",
    "partition_by": "partition by",
    "batch_size": "batch size",
    "lr": "learning rate",
}


def _controls(d: TrainConfig) -> dict[str, widgets.Widget]:
    """One widget per option the panel sets, starting from the values of `d`."""
    controls = {
        "engines": widgets.BoundedIntText(d.engines or 2, min=1, max=64),
        "strategy": widgets.Dropdown(options=strategy_names(), value=d.strategy),
        "partitions": widgets.IntSlider(d.partitions, min=1, max=8),
        "microbatches": widgets.IntSlider(d.microbatches, min=1, max=32),
        "schedule": widgets.Dropdown(options=SCHEDULES, value=d.schedule),
        "partition_by": widgets.Dropdown(options=PARTITION_METHODS, value=d.partition_by),
        "batch_size": widgets.BoundedIntText(d.batch_size, min=1, max=1 << 20),
        "epochs": widgets.BoundedIntText(d.epochs, min=1, max=10_000),
        "steps": widgets.BoundedIntText(d.steps or 0, min=0, max=10**9),
        "lr": widgets.FloatText(d.lr),
        "tensor_parallel": widgets.BoundedIntText(d.tensor_parallel or 0, min=0, max=64),
        "precision": widgets.Dropdown(options=PRECISIONS, value=d.precision),
        "activation_checkpointing": widgets.Checkbox(d.activation_checkpointing),
        "instance": widgets.Dropdown(options=sorted(price_table()), value=d.instance),
    }
    for name, control in controls.items():
        control.description = LABELS.get(name, name)
        control.style = {"description_width": "120px"}
    return controls


class ControlPanel:
    """The options of `%%smp_train` as widgets; `.config` is the TrainConfig they give."""

    def __init__(self, job: Any = None, **defaults: Any) -> None:
        global _current
        self.job = job
        base = TrainConfig(**defaults)
        self.controls = _controls(base)
        self._fixed = {k: v for k, v in dataclasses.asdict(base).items() if k not in self.controls}
        self.message = widgets.HTML()
        self.line = widgets.HTML()
        self.pool_status = widgets.HTML()
        self.plan_output = widgets.Output()
        self.buttons = {
            name: widgets.Button(description=name.capitalize())
            for name in ("start", "stop", "restart", "plan")
        }
        for name, button in self.buttons.items():
            button.on_click(getattr(self, f"_on_{name}"))
        for control in self.controls.values():
            control.observe(self._update, names="value")
        self.widget = widgets.VBox(
            [
                widgets.HTML("<b>sagenb</b> training options"),
                widgets.GridBox(
                    list(self.controls.values()),
                    layout=widgets.Layout(grid_template_columns="repeat(2, 360px)"),
                ),
                self.message,
                self.line,
                widgets.HBox(
                    [
                        self.buttons["start"],
                        self.buttons["stop"],
                        self.buttons["restart"],
                        self.buttons["plan"],
                    ]
                ),
                self.pool_status,
                self.plan_output,
            ]
        )
        self.widget.add_class("smp-panel")
        self.config: TrainConfig | None = None
        self._update()
        self._show_pool()
        _current = self

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # -- options -> config ------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        out = {name: c.value for name, c in self.controls.items()}
        out["steps"] = out["steps"] or None
        out["tensor_parallel"] = out["tensor_parallel"] or None
        return {**self._fixed, **out}

    def _update(self, change: Any = None) -> None:
        try:
            self.config = TrainConfig(**self.values())
            check_price(self.config)  # the price table is read here, not in validation
        except ConfigError as exc:
            self.config, self.error = None, str(exc)
            self.message.value = f"<span style='color:#c0392b'>{html.escape(str(exc))}</span>"
            self.line.value = ""
            return
        self.message.value, self.error = "", ""
        self.line.value = f"<code>{html.escape(self.config.to_flags())}</code>"

    # -- the pool ----------------------------------------------------------------------------
    def _show_pool(self) -> None:
        pool = cluster.current_pool()
        if pool is None:
            self.pool_status.value = "no engine pool is running"
            return
        rows = pool.status()
        self.pool_status.value = f"{len(rows)} engines: " + ", ".join(
            f"rank {r.rank} (engine {r.engine_id}, pid {r.pid}, {r.device})" for r in rows
        )

    def _on_start(self, _: Any = None) -> None:
        cluster.start_pool(self.controls["engines"].value)
        self._show_pool()

    def _on_stop(self, _: Any = None) -> None:
        cluster.stop_pool()
        self._show_pool()

    def _on_restart(self, _: Any = None) -> None:
        cluster.restart_pool(self.controls["engines"].value)
        self._show_pool()

    def plan_text(self) -> str:
        """The Plan button's answer: bubble, instances and price; cut points given a job."""
        cfg = self.config
        if cfg is None:
            return f"fix the options first: {self.error}"
        from sagenb.engine.strategies.pipeline import bubble_fraction
        from sagenb.sizing.cost import meter_for

        meter = meter_for(cfg, cfg.engines or 2)
        lines = [
            f"{meter.instances} x {cfg.instance} at ${meter.price.usd_per_hour:.3f}/h "
            f"(spot ${meter.spot(meter.price.usd_per_hour):.3f}/h), price as of "
            f"{meter.price.as_of}: ${meter.cost(3600):.2f} per hour of training"
        ]
        if describe(cfg.strategy).pipelined:
            virtual = cfg.stages // cfg.partitions
            bubble = bubble_fraction(cfg.partitions, cfg.microbatches, virtual)
            lines.append(f"pipeline bubble (p-1)/(v m+p-1): {bubble:.1%}")
            if self.job is not None:
                from sagenb.sizing.planner import plan

                lines.append(plan(self.job, cfg).table())
        return "\n".join(lines)

    def _on_plan(self, _: Any = None) -> None:
        self.plan_output.clear_output()
        with self.plan_output:
            print(self.plan_text())
