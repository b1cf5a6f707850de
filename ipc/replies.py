"""The in-flight record of a request, and the one reply sink every answering thread uses.

A request is answered exactly once, to its *ticket*, and the ticket is the request's one
record while it is in flight (docs/architecture.md, "One record per request"): the
server, the per-client limits, the model queues and the metrics read it instead of
keeping ledgers of their own.

- :class:`Ticket`: a client on the wire. The server makes it when the request's frames
  arrive (sequence number, client, envelope, bytes, receipt time), gives it the decoded
  :class:`~inferd.ipc.protocol.Request` once the header is read, hands the ticket alone
  to the daemon, and turns it back into the client's envelope
  (:meth:`inferd.ipc.server.Server.send_reply`).
- :class:`LocalTicket`: a caller inside the daemon (a graph node calling a model); the
  reply is handed to its ``deliver`` callback.

Both hold their request (``ticket.request``): the id, the model or graph an ``infer``
names, the deadline and the output slot are read from it, never copied beside it.

Both are answered once: :meth:`Ticket.answer` notes the outcome (the code and when) and
says whether this was the first answer, thread-safe, so that whoever answers first (a
stage, a deadline watch, the stop) wins and a later reply is dropped quietly; whatever
counts replies reads the outcome. :class:`ReplySink` sends a reply to either kind, from
any thread; the daemon's model workers and graph threads hold one sink. This module is
neutral ground: the server and the daemon both import it, and neither imports the other
through it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from inferd.ipc.protocol import Op, Reply, Request, Slot

log = logging.getLogger(__name__)

OK = "OK"
"""The outcome of a ticket answered with a result (else its reply's error code)."""

# One lock for every ticket's first answer: held for a compare and a store, so sharing
# it costs less than a lock per ticket.
_ANSWER_LOCK = threading.Lock()


def _answer(ticket: Ticket | LocalTicket, reply: Reply) -> bool:
    code = OK if reply.error is None else str(reply.error.code)
    with _ANSWER_LOCK:
        if ticket.code is not None:
            return False
        ticket.code = code
    ticket.answered = time.monotonic()
    return True


_INFER = Op.INFER  # a module global: read faster than the enum's attribute

UNREAD = Request("", Op.PING)
"""The request of a ticket whose header is not decoded (not yet, or never: a message
refused unread): no id, no model, no timeout. Shared, never changed."""


def _unread() -> Request:
    return UNREAD


class _Record:
    """What both kinds of ticket read from the request they hold: one record, so the
    request's id, model, deadline and output slot are read from its decoded
    :class:`~inferd.ipc.protocol.Request` and kept nowhere else."""

    __slots__ = ()
    request: Request
    received: float
    code: str | None
    answered: float | None

    @property
    def request_id(self) -> str:
        """The client's id ("" until decoded, or if it cannot be read)."""
        return self.request.id

    @property
    def model(self) -> str | None:
        """The model or graph an ``infer`` names ("-" if none); None for the other ops
        (and a request not decoded), which the request metrics do not count."""
        request = self.request
        return (request.model or "-") if request.op is _INFER else None

    @property
    def deadline(self) -> float | None:
        """Monotonic seconds past which it is not run: its receipt plus the request's
        ``timeout_ms`` (None: no timeout)."""
        timeout_ms = self.request.timeout_ms
        return self.received + timeout_ms / 1000.0 if timeout_ms else None

    @property
    def outputs_into(self) -> Slot | None:
        """The shared-memory slot the client asked the outputs into."""
        return self.request.outputs_into

    @property
    def tensor_bytes(self) -> int:
        """Bytes of its tensors once decoded, wherever they travel (frames or a
        shared-memory region), from the header before anything is decoded: what a run
        reads. The I/O thread's fast path decides by it (0 for an in-process call)."""
        return self.request.cost.tensor_bytes

    def expired(self) -> bool:
        timeout_ms = self.request.timeout_ms
        return bool(timeout_ms) and time.monotonic() > self.received + timeout_ms / 1000.0

    def answer(self, reply: Reply) -> bool:
        """Note the reply's outcome if it is the first answer (any thread).

        Returns:
            True for the first answer; False if the ticket was answered already (then
            ``reply`` must not be sent).
        """
        return _answer(cast("Ticket | LocalTicket", self), reply)


@dataclass(slots=True, eq=False)
class Ticket(_Record):
    """The record of one wire request, from its receipt to its reply.

    Made by the I/O thread when the frames arrive; ``request`` is set once the header
    is decoded (it stays :data:`UNREAD` for a message refused unread), and the id,
    model, deadline and output slot are read from it. ``code`` and ``answered`` are
    set once, by the first :meth:`answer`, on the thread that answers.

    Attributes:
        seq: the server's number for the request (unique in one server's life).
        received: monotonic seconds at receipt.
        request: the decoded request (:data:`UNREAD` until then).
        peer: the client connection (its ZeroMQ routing id): the limits count per peer,
            the model queues take turns between peers.
        uid: the client's user id (SO_PEERCRED), None if unknown: a worker's death is
            charged to it (daemon/workers/quarantine.py).
        envelope: the frames that address the reply (routing id, REQ delimiter).
        size: bytes of the request's frames (what libzmq received).
        held: bytes counted against the client's and the daemon's limits: its frames,
            and once its header is read what decoding its tensors will make (unpacked
            packed types, string objects; :class:`~inferd.ipc.clients.ClientLimits`
            sets it, and gives back what it set).
        code: "OK" or the reply's error code, once answered.
        answered: monotonic seconds when the reply was made.
        unread_id: the id read from a message refused before its header was decoded
            (its reply carries it), "" otherwise.
    """

    seq: int
    received: float
    request: Request = field(default_factory=_unread)
    peer: bytes = b""
    uid: int | None = None
    envelope: list[Any] = field(default_factory=list)
    size: int = 0
    held: int = 0
    code: str | None = None
    answered: float | None = None
    unread_id: str = ""

    @property
    def request_id(self) -> str:
        """The client's id ("" until decoded, or if it cannot be read)."""
        return self.request.id or self.unread_id


@dataclass(slots=True, eq=False)
class LocalTicket(_Record):
    """An in-process request (a graph node calling a model): the reply is handed to
    ``deliver`` (any thread).

    Attributes:
        request: the request (an ``infer``; its ``timeout_ms`` counts from
            ``received``).
        deliver: called with the reply.
        received, code, answered: as for :class:`Ticket`.
        peer: the client the call is made for (b"": the daemon itself, for the fair
            queues); uid: the client's uid (None: the daemon's own call).
    """

    request: Request
    deliver: Callable[[Reply], None]
    received: float = field(default_factory=time.monotonic)
    code: str | None = None
    answered: float | None = None
    peer: bytes = b""
    uid: int | None = None


AnyTicket = Ticket | LocalTicket
Observer = Callable[[AnyTicket], None]
"""Told about every ticket once it is answered (the request metrics)."""


def _no_observer(ticket: AnyTicket) -> None:
    return None


class ReplySink:
    """Sends replies for tickets from any thread.

    Args:
        send: answers a wire :class:`Ticket` (the server's ``send_reply``, which also
            notes the outcome and tells its observer); None for a sink that only serves
            :class:`LocalTicket` s (tests, benchmarks).
        observe: told about each :class:`LocalTicket` answered (wire tickets are
            observed by the server, where every wire reply passes).
    """

    def __init__(self, send: Callable[[Any, Reply], None] | None = None,
                 observe: Observer = _no_observer) -> None:
        self._send = send
        self._observe = observe

    def send(self, ticket: Any, reply: Reply) -> None:
        """Answer ``ticket`` with ``reply``, any thread. Only the first answer of a
        ticket is sent; a later one (a stage finishing after a deadline watch or the
        stop answered) is dropped quietly."""
        if isinstance(ticket, LocalTicket):
            if not ticket.answer(reply):
                log.debug("second reply to in-process request %s dropped (answered %s)",
                          ticket.request_id, ticket.code,
                          extra={"REQUEST_ID": ticket.request_id})
                return
            self._observe(ticket)
            ticket.deliver(reply)
        elif self._send is not None:
            self._send(ticket, reply)
        else:
            raise TypeError(f"this reply sink has no wire to answer {ticket!r} on")
