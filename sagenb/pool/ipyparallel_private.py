"""The private ipyparallel names sagenb relies on, and the only sagenb module that reads them.

As engine/torch_private.py does for torch: a private name carries no promise between releases,
pyproject.toml pins ipyparallel>=9.2,<9.3 (the release CI tests), and tests/test_private_apis.py
resolves every entry of `PRIVATE_NAMES` on the installed ipyparallel and checks that no other
sagenb module reads it. This module imports no ipyparallel: cluster.py stays the only importer of
ipyparallel's client, and passes the Client class in.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["PRIVATE_NAMES", "client_config", "iopub_guarded"]


def client_config(client: Any) -> dict[str, Any]:
    """The connection info an ipyparallel Client connected with ("interface", "location", the
    ports, ...), its address already resolved against the controller's location."""
    # no public accessor in ipyparallel 9.2: the connection file holds the same keys, but
    # before Client.__init__ disambiguates the interface's address (util.disambiguate_ip_address)
    return client._config


#: one client made at a time inside iopub_guarded, so two never swap the class attribute at once
_CONNECTING = threading.Lock()


@contextmanager
def iopub_guarded(client_class: Any) -> Iterator[None]:
    """Clients of `client_class` made inside the block survive an error of their IOPub handler:
    it is logged (once per kind) and the message ignored.

    Why: the handler runs as a ZMQStream callback, and a callback that raises leaves the stream
    without its next poll, so no later IOPub message arrives: a run's published metrics among
    them. ipyparallel 9.2's raises AttributeError on every comm message (a widget drawn on an
    engine) when `get_ipython()` is an IPython without a kernel (terminal ipython), as it reads
    `.kernel` unguarded. No public hook: a Client binds `self._dispatch_iopub` to its IOPub
    stream in its constructor (`_setup_streams`), so the guard is the class attribute while
    the client is made, put back after (other clients of the process keep ipyparallel's)."""
    with _CONNECTING:
        original = client_class.__dict__["_dispatch_iopub"]
        client_class._dispatch_iopub = _guarded(original)
        try:
            yield
        finally:
            client_class._dispatch_iopub = original


def _guarded(dispatch: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    logged: set[str] = set()

    @functools.wraps(dispatch)
    def guarded(client: Any, msg_parts: Any) -> None:
        try:
            dispatch(client, msg_parts)
        except Exception as err:  # noqa: BLE001 - the stream must go on to the next message
            what = f"{type(err).__name__}: {err}"
            if what not in logged:
                logged.add(what)
                logging.getLogger("sagenb.pool").warning(
                    "ipyparallel could not handle a message from an engine (%s): it was "
                    "ignored, and the run's other messages still arrive",
                    what,
                )

    return guarded


#: (module, dotted attribute from it, the sagenb code that stops working without it); the same
#: layout as engine/torch_private.py's
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    (
        "ipyparallel",
        "Client._config",
        "pool.cluster.EnginePool.controller_host (every run's rendezvous)",
    ),
    (
        "ipyparallel",
        "Client._dispatch_iopub",
        "pool.cluster's clients, guarded so that an IOPub message ipyparallel cannot handle "
        "(an engine's widget in an IPython without a kernel) does not stop a run's metrics",
    ),
)
