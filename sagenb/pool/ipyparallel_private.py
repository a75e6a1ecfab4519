"""The one private ipyparallel name sagenb relies on, and the only sagenb module that reads it.

As engine/torch_private.py does for torch: a private name carries no promise between releases,
pyproject.toml pins ipyparallel>=9.2,<9.3 (the release CI tests), and tests/test_private_apis.py
resolves every entry of `PRIVATE_NAMES` on the installed ipyparallel and checks that no other
sagenb module reads it. This module imports nothing: cluster.py stays the only importer of
ipyparallel's client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRIVATE_NAMES", "client_config"]


def client_config(client: Any) -> dict[str, Any]:
    """The connection info an ipyparallel Client connected with ("interface", "location", the
    ports, ...), its address already resolved against the controller's location."""
    # no public accessor in ipyparallel 9.2: the connection file holds the same keys, but
    # before Client.__init__ disambiguates the interface's address (util.disambiguate_ip_address)
    return client._config


#: (module, dotted attribute from it, the sagenb code that stops working without it); the same
#: layout as engine/torch_private.py's
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    (
        "ipyparallel",
        "Client._config",
        "pool.cluster.EnginePool.controller_host (every run's rendezvous)",
    ),
)
