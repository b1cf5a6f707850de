"""Where replies go: the reply targets and the one reply sink every answering thread uses.

A request is answered exactly once, to a *ticket*:

- :class:`Ticket`: a client on the wire; the server made it when the request arrived and
  turns it back into the client's envelope (:meth:`inferd.ipc.server.Server.send_reply`).
- :class:`LocalTicket`: a caller inside the daemon (a graph node calling a model); the
  reply is handed to its ``deliver`` callback.

:class:`ReplySink` sends a reply to either kind, from any thread; the daemon's model
workers and graph threads hold one sink instead of a reply function and a thread-exit
hook each. This module is neutral ground: the server and the daemon both import it, and
neither imports the other through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.ipc.protocol import Reply


@dataclass(slots=True)
class Ticket:
    """What a handler needs to answer a wire request later: an opaque sequence number
    plus the request's id, arrival time and deadline (monotonic seconds, or None), and
    the client connection it came on (its routing id: the model queues take turns
    between clients)."""

    seq: int
    request_id: str
    received: float
    deadline: float | None
    peer: bytes = b""

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


class LocalTicket:
    """An in-process reply target: the reply is handed to ``deliver`` (any thread)."""

    def __init__(self, request_id: str, deliver: Callable[[Reply], None],
                 deadline: float | None = None) -> None:
        self.request_id = request_id
        self.received = time.monotonic()
        self.deadline = deadline
        self.deliver = deliver

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


AnyTicket = Ticket | LocalTicket


def _no_release() -> None:
    return None


class ReplySink:
    """Sends replies for tickets from any thread.

    Args:
        send: answers a wire :class:`Ticket` (the server's ``send_reply``); None for a
            sink that only serves :class:`LocalTicket` s (tests, benchmarks).
        release_thread: called by a thread that used the sink when it ends (the server
            closes that thread's reply socket).
    """

    def __init__(self, send: Callable[[Any, Reply], None] | None = None,
                 release_thread: Callable[[], None] = _no_release) -> None:
        self._send = send
        self.release_thread = release_thread

    def send(self, ticket: Any, reply: Reply) -> None:
        """Answer ``ticket`` with ``reply``: exactly once per ticket, any thread."""
        if isinstance(ticket, LocalTicket):
            ticket.deliver(reply)
        elif self._send is not None:
            self._send(ticket, reply)
        else:
            raise TypeError(f"this reply sink has no wire to answer {ticket!r} on")
