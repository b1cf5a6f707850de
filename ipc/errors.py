"""The error contract: one root error, one subclass per boundary, one wire code each.

Every failure that reaches a client travels as ``{code, message}`` with a code from
:class:`ErrorCode`. Code inside the daemon raises the subclass for its boundary; the
request paths turn it into an error reply with :func:`failure`, the one conversion:
anything that is not an InferdError becomes INTERNAL, logged with its traceback.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import NamedTuple

_log = logging.getLogger(__name__)


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
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
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


class Failure(NamedTuple):
    """The error of a reply: a wire code and a message (``Reply.error``)."""

    code: ErrorCode
    message: str


def failure(e: BaseException, where: str = "", log: logging.Logger | None = None, *,
            named: bool = True, **fields: str) -> Failure:
    """The one way from an exception to a coded error (every reply path uses it).

    An :class:`InferdError` keeps its code and message: it was raised on purpose. Any
    other exception is a bug or an unforeseen failure: it is logged with its traceback
    (on ``log``, with ``fields`` as structured fields such as ``model`` -> MODEL) and
    becomes INTERNAL with the message ``"<where>: <type>: <text>"``.

    Args:
        e: what was raised.
        where: what failed (a model, a graph, an op), for an unexpected error.
        log: the logger of the caller (default: this module's).
        named: False leaves ``where`` out of the message (the caller adds its own
            words around it) but not out of the log line.
        fields: structured log fields for an unexpected error.
    """
    if isinstance(e, InferdError):
        return Failure(e.code, e.message)
    text = f"{type(e).__name__}: {e}"
    (log or _log).error("%s%s", f"{where}: " if where else "", text, exc_info=e,
                        extra={k.upper(): v for k, v in fields.items()})
    return Failure(ErrorCode.INTERNAL, f"{where}: {text}" if where and named else text)
