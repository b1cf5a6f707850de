"""What one client may hold in the daemon, how many connections all of them may hold,
and giving memory back when clients go.

The I/O thread counts, per connection (the ZeroMQ routing id), the requests received
and not yet answered and their bytes, as each request's ticket (its in-flight record,
``ipc/replies.py``) says: :meth:`ClientLimits.admit` and :meth:`ClientLimits.done` take
the ticket, so what is counted in is what is counted out. A request over either limit
is answered RESOURCE_EXHAUSTED at once, so one client cannot fill the models' queues or the
daemon's memory for the others; a lone request is always admitted (its size is bounded
by ``max_message_bytes``). A client with nothing in flight has no entry at all.

Freed request buffers stay in the C allocator's free lists (glibc keeps them per
arena), so the daemon's RSS would stay at its peak after a burst. Once no inference has
finished for :data:`IDLE_TRIM_S` and enough had been received before, :meth:`trim`
calls ``malloc_trim(0)`` at a moment with nothing in flight to return the free pages to
the system. Only then: a trim between two requests of a steady client would make the next
request fault its buffers in again, page by page (the server's loop asks
:meth:`ClientLimits.trim_in` how long it may sleep). Closed connections count too: each
left about :data:`CONNECTION_BYTES` of libzmq's buffers in the free lists.

:class:`Connections` bounds the connections open at once (``server.max_connections``,
and never more than the open-files limit leaves room for): libzmq accepts every
connection itself and aborts the process when ``accept`` fails with EMFILE, so the
server closes each connection past the bound as soon as libzmq reports it.
"""

from __future__ import annotations

import logging
import time

from inferd.ipc.libc import malloc_trim
from inferd.ipc.replies import Ticket

log = logging.getLogger(__name__)

CONNECTION_BYTES = 32 * 2**10
"""What one closed connection leaves in malloc's free lists (libzmq's session, engine,
pipes and buffers: 28 KiB measured)."""
FD_RESERVE = 256
"""Descriptors kept for everything but client connections (model files, plugin pipes,
the daemon's own sockets), below the open-files limit."""

TRIM_AFTER_BYTES = 32 * 2**20
"""Bytes received since the last trim that make an idle moment worth a malloc_trim."""
IDLE_TRIM_S = 2.0
"""How long no inference may have finished before the free pages go back (a client
pausing that long pays for faulting its next request's buffers in again). Other
requests (pings, a status poll, ``inferctl top``) do not put the trim off."""


class ClientLimits:
    """Per-client counts of requests in flight (I/O thread only).

    Args:
        max_requests: requests one client may have in flight.
        max_bytes: bytes of requests one client may have in flight.
    """

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._use: dict[bytes, list[int]] = {}
        self._in_flight = 0
        self._since_trim = 0
        self._worked = 0.0  # when the last inference finished
        self.refused = 0
        self.trims = 0

    def admit(self, ticket: Ticket) -> str | None:
        """Count the request of ``ticket`` (its peer and size); why it is over a limit,
        or None.

        Every call is matched by one :meth:`done` (also for a refused request)."""
        key, size = ticket.peer, ticket.size
        use = self._use.get(key)
        if use is None:
            use = self._use[key] = [0, 0]
        use[0] += 1
        use[1] += size
        self._in_flight += 1
        self._since_trim += size
        if use[0] > self.max_requests:
            self.refused += 1
            return (f"this client has {use[0] - 1} requests in flight, the limit "
                    f"(server.max_requests_per_client = {self.max_requests}); wait for "
                    f"replies before sending more")
        if use[1] > self.max_bytes and use[0] > 1:
            self.refused += 1
            return (f"this client has {use[1] - size} bytes of requests in flight; this "
                    f"one ({size} bytes) would pass the limit (server.max_bytes_per_client"
                    f" = {self.max_bytes}); wait for replies before sending more")
        return None

    def holds(self, key: bytes) -> bool:
        """Whether client ``key`` has requests in flight."""
        return key in self._use

    def done(self, ticket: Ticket) -> None:
        """The request of ``ticket`` was answered."""
        use = self._use.get(ticket.peer)
        if use is not None:
            use[0] -= 1
            use[1] -= ticket.size
            if use[0] <= 0:
                del self._use[ticket.peer]
        self._in_flight -= 1
        if ticket.model is not None:  # an inference (its tensors may be in shared memory)
            self._worked = time.monotonic()

    def connection_closed(self) -> None:
        """A client connection closed: its buffers are free memory now, trimmed once
        the closing has settled (as after an inference)."""
        self._since_trim += CONNECTION_BYTES
        self._worked = time.monotonic()

    def trim_in(self) -> float | None:
        """Seconds until an idle trim is due (0: now), or None if none is waiting (too
        little received since the last one, or requests in flight: the next answer
        asks again)."""
        if self._since_trim < TRIM_AFTER_BYTES or self._in_flight:
            return None
        return max(0.0, self._worked + IDLE_TRIM_S - time.monotonic())

    def trim_if_due(self) -> None:
        """Trim if no inference has finished for :data:`IDLE_TRIM_S` and nothing is in
        flight now (I/O thread)."""
        if self.trim_in() == 0.0:
            self.trim()

    def trim(self) -> None:
        """Give free heap pages back to the system."""
        self._since_trim = 0
        if malloc_trim():
            self.trims += 1
            log.debug("returned free memory to the system (malloc_trim)")

    def clients(self) -> int:
        """Clients with requests in flight."""
        return len(self._use)


class Connections:
    """The client connections open on the socket, by descriptor (I/O thread only; fed
    by libzmq's monitor events), and their bound.

    Args:
        max_connections: ``server.max_connections``.
        fd_limit: the soft limit of open files; the bound is lowered to leave
            :data:`FD_RESERVE` descriptors (and half of the limit) for the rest.
    """

    def __init__(self, max_connections: int, fd_limit: int) -> None:
        room = max(1, min(fd_limit - FD_RESERVE, fd_limit // 2))
        self.configured = max_connections
        self.max = min(max_connections, room)
        self._open: set[int] = set()
        self.refused = 0
        self.peak = 0

    def accepted(self, fd: int) -> bool:
        """A connection was accepted on ``fd``; False if it is over the bound (the caller
        closes it: it stays counted until libzmq reports it closed)."""
        self._open.add(fd)
        self.peak = max(self.peak, len(self._open))
        if len(self._open) <= self.max:
            return True
        self.refused += 1
        return False

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` closed."""
        self._open.discard(fd)

    def count(self) -> int:
        """Connections open now."""
        return len(self._open)
