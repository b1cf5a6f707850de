"""The error contract: one root error, one subclass per boundary, one wire code each.

Every failure that reaches a client travels as ``{code, message}`` with a code from
:class:`ErrorCode`. Code inside the daemon raises the subclass for its boundary; the
request loop turns it into an error reply. Nothing else is turned into a code.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The fixed set of wire error codes (documented in docs/protocol.md)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNSUPPORTED = "UNSUPPORTED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class InferdError(Exception):
    """Root of every error inferd raises on purpose.

    Args:
        message: what went wrong, naming the model, backend, op or file involved.
        code: the wire code the error maps to; each subclass has a default.
    """

    default_code = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code


class ProtocolError(InferdError):
    """A message that does not follow the wire protocol."""

    default_code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, code: ErrorCode | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message, code)
        self.request_id = request_id


class ConfigError(InferdError):
    """An invalid configuration file or command-line value."""

    default_code = ErrorCode.INVALID_ARGUMENT


class ModelError(InferdError):
    """A model that cannot be found, loaded or run, or inputs that do not fit it."""

    default_code = ErrorCode.INVALID_ARGUMENT


class BackendError(InferdError):
    """A backend (built-in or plugin) that failed or is not usable."""

    default_code = ErrorCode.UNAVAILABLE


class RequestError(InferdError):
    """Raised by the clients when the daemon answers a request with an error.

    Attributes:
        code: the wire code from the reply (:class:`ErrorCode`).
        message: the daemon's message.
    """
