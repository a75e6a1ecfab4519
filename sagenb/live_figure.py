"""The live chart: a small anywidget (https://anywidget.dev) that draws a plotly figure and
takes each redraw as the points added and the values changed since the last one.

Why not plotly's FigureWidget (issue 17): its front end is plotly's 4.8 MB bundle as the
widget's ES module, evaluated anew for every widget (1-1.5 s of browser CPU per run's first
draw) and saved with every executed notebook (~5 MB of widget state per dashboard); each redraw
sent every trace whole. Here:

- plotly.js (the copy the plotly package ships, plotly.offline.get_plotlyjs()) travels as a
  binary trait and is evaluated once per page: the front end keeps it on `window` under its
  version, and later widgets skip it. The trait is emptied when the run ends, so a saved
  notebook does not carry it (nbclient saves every widget's last state).
- A redraw is a custom message (not widget state: nothing accumulates in a saved notebook) of
  splices, one per changed trace key: keep the first `keep` values, append `tail`. A growing
  line sends its new points only. Messages that reach the front end before the widget's module
  has loaded are lost (anywidget has no queue for them, and the kernel, busy training, answers
  no request), so the first RESYNC_FIRST redraws and every RESYNC_EVERY-th send whole arrays.
  The front end applies them to the model's copy of the data (shared by every view of it)
  and redraws with Plotly.react.
- The Python side applies the same splices to its own copy (`shown`), which is what the front
  end holds: tests read it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import anywidget
import numpy as np
import plotly
import traitlets

__all__ = ["LiveFigure", "splices"]

RESYNC_FIRST, RESYNC_EVERY = 5, 30

_ESM = r"""
const CACHE = "__sagenb_plotly";
// anywidget hands initialize and render a new proxy of the model each: the model's data lives
// here, by the widget's uid, shared by every view of it
const FIGURES = (window.__sagenb_figures ||= new Map());

function plotlyOf(model) {
  const cache = (window[CACHE] ||= {});
  const version = model.get("version");
  if (!cache[version]) {
    const lib = model.get("library");
    if (!lib || !lib.byteLength) return null;  // emptied after the run: the static copy shows
    const module = { exports: {} };
    new Function("module", "exports", "define", new TextDecoder().decode(lib))(
      module, module.exports, undefined);
    cache[version] = module.exports;
  }
  return cache[version];
}

function apply(data, ops) {
  for (const op of ops) {
    const trace = data[op.i];
    for (const [key, value] of Object.entries(op.set || {})) trace[key] = value;
    for (const [key, [keep, tail]] of Object.entries(op.splice || {})) {
      const old = trace[key] || [];
      trace[key] = (keep === old.length ? old : old.slice(0, keep)).concat(tail);
    }
  }
}

export default {
  initialize({ model }) {
    const state = JSON.parse(model.get("figure"));
    state.views = new Set();
    state.revision = 0;
    FIGURES.set(model.get("uid"), state);
    model.on("msg:custom", (msg) => {
      apply(state.data, msg.ops);
      state.layout.datarevision = ++state.revision;
      for (const draw of state.views) draw();
    });
  },
  render({ model, el }) {
    const state = FIGURES.get(model.get("uid"));
    const Plotly = plotlyOf(model);
    const div = document.createElement("div");
    el.appendChild(div);
    if (!Plotly) {
      div.textContent = "(the live chart ended with its run)";
      return;
    }
    const config = { displaylogo: false, responsive: false };
    let pending = false;
    const draw = () => {  // at most once a frame, however many messages came
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        // new objects for plotly to diff against the ones it holds (it keeps references)
        Plotly.react(div, state.data.map((t) => ({ ...t })), { ...state.layout }, config);
      });
    };
    Plotly.newPlot(div, state.data.map((t) => ({ ...t })), { ...state.layout }, config);
    state.views.add(draw);
    return () => { state.views.delete(draw); Plotly.purge(div); };
  },
};
"""


def _tolist(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _splice(old: Any, new: Any) -> tuple[int, list] | None:
    """(kept prefix length, tail) turning the 1-D sequence `old` into `new`, or None when
    `new` is not a sequence of the same kind."""
    old, new = _plain(old), _plain(new)
    if not isinstance(old, list) or not isinstance(new, list):
        return None
    keep = 0
    for a, b in zip(old, new):
        if a != b:
            break
        keep += 1
    return keep, new[keep:]


def splices(
    old: Mapping[str, Any] | None, new: Mapping[str, Any], *, whole: bool = False
) -> dict[str, dict[str, Any]]:
    """What changed from one trace's data to the next: {'splice': {key: (keep, tail)},
    'set': {key: value}}, each only where that key changed; {} when nothing did. `whole`:
    every key as 'set', changed or not."""
    op: dict[str, dict[str, Any]] = {}
    for key, value in new.items():
        before = None if old is None else old.get(key)
        plain = _plain(value)
        if whole:
            op.setdefault("set", {})[key] = plain
            continue
        if before is not None and _plain(before) == plain:
            continue
        cut = None if before is None else _splice(before, value)
        if cut is not None:
            op.setdefault("splice", {})[key] = cut
        else:
            op.setdefault("set", {})[key] = plain
    return op


class LiveFigure(anywidget.AnyWidget):
    """A plotly figure in the browser, redrawn from the data of its traces by name."""

    _esm = traitlets.Unicode(_ESM).tag(sync=True)
    figure = traitlets.Unicode("{}").tag(sync=True)  # the first draw: the figure's JSON
    library = traitlets.Bytes(b"").tag(sync=True)  # plotly.min.js until the run ends
    version = traitlets.Unicode(plotly.__version__).tag(sync=True)
    uid = traitlets.Unicode().tag(sync=True)

    def __init__(self, fig: Any) -> None:
        from plotly.offline import get_plotlyjs

        # numpy arrays as lists (to_json would write them as base64 typed arrays, which the
        # splices cannot extend)
        spec = json.loads(json.dumps(fig.to_plotly_json(), default=_tolist))
        self.names = [trace.get("meta") for trace in spec["data"]]
        self.shown: dict[str, dict[str, Any]] = {
            trace["meta"]: trace for trace in spec["data"] if "meta" in trace
        }
        super().__init__(
            figure=json.dumps(spec), library=get_plotlyjs().encode(), uid=uuid.uuid4().hex
        )
        self.sent_values = 0  # how many values the redraws sent (the benchmark reports it)
        self.updates = 0

    def update_traces(self, data: Mapping[str, Mapping[str, Any]]) -> bool:
        """Send what changed in each named trace's data; whether anything did."""
        ops = []
        self.updates += 1
        whole = self.updates <= RESYNC_FIRST or self.updates % RESYNC_EVERY == 0
        for name, values in data.items():
            old = self.shown[name]
            op = splices(old, values, whole=whole)
            if not op:
                continue
            for key, (keep, tail) in op.get("splice", {}).items():
                old[key] = list(_plain(old.get(key)) or [])[:keep] + tail
                self.sent_values += len(tail)
            for key, value in op.get("set", {}).items():
                old[key] = value
                self.sent_values += len(value) if isinstance(value, list) else 1
            ops.append({"i": self.names.index(name), **op})
        if ops:
            self.send({"ops": ops})
        return bool(ops)

    def release(self) -> None:
        """The run ended: drop plotly.js from the widget's state, so nothing saves it."""
        self.library = b""
