"""The private ipykernel name sagenb relies on, and the only sagenb module that reads it.

The dashboard's Stop button must be heard while its cell still runs. A widget's message from
the browser comes on the kernel's shell channel, and ipykernel 7 hands every shell message to
the main thread in the order it came: behind the running cell, which is the run being
followed. A widget's `on_msg` handler hears the click once the run is over.

ipykernel 7.4's shell-channel thread reads each shell message as it arrives and, for a
`comm_msg`, asks the comm it is for which subshell should handle it
(`BaseComm._reply_subshell_for(data, default)`: a reply goes to the loop that sent the request,
JEP 91). `on_arrival` wraps that method on one comm: the wrapper sees the message's data when it
arrives, tells its callback, and returns the kernel's own answer. Nothing is taken from a queue,
answered early or reordered: every message, the click too, is still handled in its turn on the
main thread, so a cell queued behind the running one runs after it, once. There is no public
API for this in the pinned release (pyproject.toml: ipykernel>=7.4,<7.5).

What was not done, and why:
- jupyter-ui-poll runs the kernel's event loop inside the cell, holding every execute_request
  back to replay it after (for ipykernel 7, with the main shell's lock set aside): the next
  cell's request handled out of its order, and cells reported hung with its ipykernel 7
  release (jupyter-ui-poll issue 54).
- Subshells: JupyterLab 4.6 sends comm messages on a subshell by default, but ipykernel sends a
  widget's messages back to the main shell once the widget has published from it, which a
  widget made in a cell has (measured: the click is handled when the cell ends, either way).

tests/test_private_apis.py resolves `PRIVATE_NAMES` on the installed ipykernel, and
tests/test_stop_button.py checks in a real kernel that the click is heard during a busy cell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PRIVATE_NAMES", "on_arrival"]

#: (module, attribute, what in sagenb needs it)
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    (
        "ipykernel.comm.comm",
        "BaseComm._reply_subshell_for",
        "display.live_figure.LiveFigure's Stop button, heard while its cell runs",
    ),
)


def on_arrival(comm: Any, callback: Callable[[Any], None]) -> bool:
    """Call `callback(data)` in ipykernel's shell-channel thread as each message from the page
    to `comm` arrives, before the main thread handles it in its turn. Whether it could: False
    for a comm of no ipykernel 7 kernel (a script's or a test's DummyComm, another kernel)."""
    route = getattr(comm, "_reply_subshell_for", None)
    kernel = getattr(comm, "kernel", None)
    if route is None or getattr(kernel, "shell_channel_thread", None) is None:
        return False

    def heard(data: Any, default: Any) -> Any:
        try:
            callback(data)
        except Exception:  # noqa: BLE001 - never in the way of the kernel's own routing
            pass
        return route(data, default)

    comm._reply_subshell_for = heard
    return True
