"""inferd's wire: protocol v1, the server loop, and the clients.

Applications use ``from inferd.ipc import Client`` (or ``AsyncClient``). The clients are
imported on first use, so that importing :mod:`inferd.ipc.errors` (which the backends
share) does not bring in ZeroMQ and the protocol.
"""

from __future__ import annotations

import importlib
from typing import Any

from inferd.ipc.errors import ErrorCode, InferdError, RequestError

__all__ = ["AsyncClient", "Client", "ErrorCode", "InferdError", "Pending", "Region",
           "RequestError", "default_endpoint"]

_CLIENT = ("AsyncClient", "Client", "Pending", "default_endpoint")


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        return getattr(importlib.import_module("inferd.ipc.client"), name)
    if name == "Region":
        return importlib.import_module("inferd.ipc.shm").Region
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
