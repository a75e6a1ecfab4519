"""`sagenb.ControlPanel()`: ipywidgets that set the options of `%%smp_train` and manage the pool.

The panel only produces a TrainConfig: it validates as the user types (an impossible
combination shows why, in place), shows the equivalent `%%smp_train` line, and
`%%smp_train --config panel` trains a cell with it through the one code path the magic uses.
Its buttons start, stop and restart the pool, and Plan shows the pipeline bubble and the
instance cost, and the cut points when the panel was given the cell (`ControlPanel(job=...)`).

Its widgets come from the config's options (config/options.py `every_option`: its fields and
the options strategies declare of their own), as the magic's flags do: one tab per section of
SECTIONS, one widget per option chosen by its type and spec, its help as the tooltip. An option
declared `panel=False` is left out; an option only some strategies use (one they declare) is
greyed out, and left at its default, under the others. An option added
to the config, or declared by a new strategy, therefore appears here with nothing to edit.
This module owns ipywidgets.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from sagenb.config.errors import ConfigError, flag_name
from sagenb.config.options import (
    DEFAULT_ENGINES,
    SECTIONS,
    Option,
    TrainConfig,
    describe,
    every_option,
    option_owners,
)
from sagenb.pool import cluster
from sagenb.sizing.cost import check_price, price_table

__all__ = ["ControlPanel", "current_panel"]

_current: ControlPanel | None = None

#: what a number typed into a text box must be, for the message when it is not
_WORDS = {int: "an integer", float: "a number"}


def _instance_types(values: dict[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(price_table(values.get("price_table"))))


#: values the panel offers for an option without enforcing them, which only a file knows: the
#: config reads no file, so they are not in its spec (and a price table of your own may name
#: other instances; check_price says which are allowed)
SUGGESTIONS: dict[str, Callable[[dict[str, Any]], tuple[str, ...]]] = {"instance": _instance_types}


def current_panel() -> ControlPanel | None:
    """The panel created last (what `%%smp_train --config panel` uses)."""
    return _current


class _Look:
    """One layout, and one style of each kind, for all of a panel's option widgets: each
    widget's own would be two more widget models in a saved notebook's state (36 options took
    175 KB so, 101 KB shared; the 14 hand-listed ones took 65 KB)."""

    def __init__(self) -> None:
        self.layout = widgets.Layout()
        self.styles: dict[type, widgets.Widget] = {}

    def made(self, cls: Any, **kwargs: Any) -> Any:
        """A `cls` widget with the shared layout and its style class's shared style."""
        style_class = cls.class_traits()["style"].klass
        if style_class not in self.styles:
            self.styles[style_class] = style_class(description_width="150px")
        return cls(layout=self.layout, style=self.styles[style_class], **kwargs)


class Control:
    """One option's widget, and how the widget's value reads into the config and back.

    An option that may be unset (default None) or whose flag has its own `parse` is a text
    box: "" is None, anything else converts as the flag's text does, so the panel and the
    magic read the same text the same way."""

    def __init__(
        self,
        option: Option,
        value: Any,
        suggested: tuple[str, ...] | None = None,
        *,
        look: _Look | None = None,
    ) -> None:
        self.option, self.kind, self.suggested = option, option.type, suggested
        self._made = (look or _Look()).made
        self.is_text = option.default is None or option.parse is not None
        #: the strategies that declare this option, when not all use it
        self.owners = option_owners(option.name)
        self.widget = self._widget()
        self.widget.description = option.name.replace("_", " ")
        only = f" (--strategy {' or '.join(self.owners)})" if self.owners else ""
        help_text = option.help.replace("%%", "%")  # argparse's escape
        self.widget.tooltip = f"{flag_name(option.name)}{only}: {help_text}"
        self.write(value)

    def _widget(self) -> widgets.ValueWidget:
        option, kind = self.option, self.kind
        # one keystroke is no value yet: a text box counts when entered, as a number box does
        if self.is_text:
            return self._made(widgets.Text, placeholder=option.shown or "", continuous_update=False)
        if kind is bool:
            return self._made(widgets.Checkbox, indent=True)
        choices = option.allowed()
        if choices is not None:
            return self._made(widgets.Dropdown, options=choices)
        if self.suggested is not None:
            return self._made(
                widgets.Combobox,
                options=self.suggested,
                ensure_option=False,
                continuous_update=False,
            )
        if kind in (int, float, str):
            text = {int: widgets.IntText, float: widgets.FloatText, str: widgets.Text}[kind]
            return self._made(text, continuous_update=False)
        raise TypeError(
            f"the control panel cannot show {option.name} ({kind!r}): give it a `parse` "
            "(then it is a text box) or declare it `panel=False`"
        )

    def read(self) -> Any:
        """The widget's value as the config takes it; ConfigError for text that is not one."""
        value = self.widget.value
        if not self.is_text:
            return value
        text = value.strip()
        if not text and self.option.default is None:
            return None
        if self.option.parse is not None:
            return self.option.parse(text)
        try:
            return self.kind(text)
        except ValueError:
            word = _WORDS.get(self.kind, str(self.kind))
            raise ConfigError(self.option.name, text, f"must be {word}") from None

    def write(self, value: Any) -> None:
        if not self.is_text:
            self.widget.value = value
        elif value is None:
            self.widget.value = ""
        else:
            self.widget.value = (
                ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            )


def _controls(d: TrainConfig) -> dict[str, Control]:
    """A control per option the panel shows, starting from the values of `d`, in the order of
    the config's fields (a strategy's own options where `strategy_options` stands)."""
    values, look = dataclasses.asdict(d), _Look()
    return {
        o.name: Control(o, d.option(o.name), _suggested(o.name, values), look=look)
        for o in every_option(TrainConfig)
        if o.panel
    }


def _suggested(name: str, values: dict[str, Any]) -> tuple[str, ...] | None:
    """SUGGESTIONS' values for option `name` (None: it has none); () while the file that knows
    them cannot be read (check_price says why)."""
    if name not in SUGGESTIONS:
        return None
    try:
        return SUGGESTIONS[name](values)
    except (OSError, ValueError, KeyError, TypeError):
        return ()


def _sections(controls: dict[str, Control]) -> widgets.Tab:
    """One tab per section of SECTIONS that has a control, in SECTIONS order."""
    tabs, titles = [], []
    for name, section in SECTIONS.items():
        shown = [c.widget for c in controls.values() if c.option.section == name]
        if not shown:
            continue
        grid = widgets.GridBox(
            shown, layout=widgets.Layout(grid_template_columns="repeat(2, 380px)")
        )
        tabs.append(widgets.VBox([widgets.HTML(f"<i>{html.escape(section.about)}</i>"), grid]))
        titles.append(section.title)
    return widgets.Tab(tabs, titles=tuple(titles))


class ControlPanel:
    """The options of `%%smp_train` as widgets; `.config` is the TrainConfig they give."""

    def __init__(self, job: Any = None, **defaults: Any) -> None:
        global _current
        self.job = job
        # the panel starts the pool itself, so it starts from the size a pool gets by default
        # rather than "every engine of the pool that runs"; clearing the box gives that
        defaults.setdefault("engines", DEFAULT_ENGINES)
        base = TrainConfig(**defaults)
        self.options = _controls(base)
        self.controls = {name: c.widget for name, c in self.options.items()}
        # the options left out keep the values the panel was given (strategy options with
        # widgets override theirs in strategy_options: a keyword wins over the pairs)
        self._fixed = {k: v for k, v in dataclasses.asdict(base).items() if k not in self.options}
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
        self.sections = _sections(self.options)
        self.widget = widgets.VBox(
            [
                widgets.HTML("<b>sagenb</b> training options"),
                self.sections,
                self.message,
                self.line,
                widgets.HBox(list(self.buttons.values())),
                self.pool_status,
                self.plan_output,
            ]
        )
        self.widget.add_class("smp-panel")
        self.config: TrainConfig | None = None
        self.error = ""
        self._update()
        self._show_pool()
        _current = self

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # -- options -> config ------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """The options as the config takes them: an option the chosen strategy does not use
        (greyed out) is at its default, so switching strategies back and forth keeps what was
        typed without refusing it; ConfigError for text that is no value."""
        out = {}
        for name, control in self.options.items():
            out[name] = control.option.default if control.widget.disabled else control.read()
        return {**self._fixed, **out}

    def _follow_strategy(self) -> None:
        """Grey out the options only other strategies declare (their descriptions' options)."""
        strategy = self._strategy()
        for control in self.options.values():
            control.widget.disabled = bool(control.owners) and strategy not in control.owners

    def _suggest(self, values: dict[str, Any]) -> None:
        """Offer what the options' files know (the instances of --price-table's table)."""
        for name in SUGGESTIONS.keys() & self.options.keys():
            widget = self.controls[name]
            offered = _suggested(name, values)
            if offered and isinstance(widget, widgets.Combobox) and widget.options != offered:
                widget.options = offered

    def _strategy(self) -> str:
        if "strategy" in self.options:
            return str(self.options["strategy"].read())
        return str(self._fixed["strategy"])

    def _update(self, change: Any = None) -> None:
        self._follow_strategy()
        try:
            values = self.values()
            self._suggest(values)
            self.config = TrainConfig(**values)
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

    def _pool_size(self) -> int:
        """Engines Start and Restart ask for: --engines, else what the options need (one per
        partition for model ...), else the default pool's size while the options are invalid."""
        if self.config is not None:
            return self.config.engines_to_start()
        try:
            engines = self.options["engines"].read() if "engines" in self.options else None
        except ConfigError:
            engines = None
        return engines if isinstance(engines, int) and engines > 0 else DEFAULT_ENGINES

    def _on_start(self, _: Any = None) -> None:
        cluster.start_pool(self._pool_size())
        self._show_pool()

    def _on_stop(self, _: Any = None) -> None:
        cluster.stop_pool()
        self._show_pool()

    def _on_restart(self, _: Any = None) -> None:
        cluster.restart_pool(self._pool_size())
        self._show_pool()

    def plan_text(self) -> str:
        """The Plan button's answer: bubble, instances and price; cut points given a job."""
        cfg = self.config
        if cfg is None:
            return f"fix the options first: {self.error}"
        from sagenb.engine.strategies.pipeline import PipelineOptions, bubble_fraction
        from sagenb.sizing.cost import meter_for

        meter = meter_for(cfg, cfg.engines_to_start())
        lines = [
            f"{meter.instances} x {cfg.instance} at ${meter.price.usd_per_hour:.3f}/h "
            f"(spot ${meter.spot(meter.price.usd_per_hour):.3f}/h), price as of "
            f"{meter.price.as_of}: ${meter.cost(3600):.2f} per hour of training"
        ]
        if describe(cfg.strategy).pipelined:
            pipe = PipelineOptions.of(cfg)
            bubble = bubble_fraction(pipe.partitions, pipe.microbatches, pipe.chunks)
            lines.append(f"pipeline bubble (p-1)/(v m+p-1): {bubble:.1%}")
            if self.job is not None:
                from sagenb.sizing.planner import plan

                lines.append(plan(self.job, cfg).table())
        return "\n".join(lines)

    def _on_plan(self, _: Any = None) -> None:
        self.plan_output.clear_output()
        with self.plan_output:
            print(self.plan_text())
