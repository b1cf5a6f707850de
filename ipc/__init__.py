"""inferd's wire: protocol v1, the server loop, and the clients.

Applications use ``from inferd.ipc import Client`` (or ``AsyncClient``).
"""

from inferd.ipc.client import AsyncClient, Client, Pending, default_endpoint
from inferd.ipc.errors import ErrorCode, InferdError, RequestError

__all__ = ["AsyncClient", "Client", "ErrorCode", "InferdError", "Pending", "RequestError",
           "default_endpoint"]
