"""What one client may hold in the daemon, how many connections all of them may hold,
and giving memory back when clients go.

The I/O thread counts, per connection (the ZeroMQ routing id), the requests received
and not yet answered and their bytes, as each request's ticket (its in-flight record,
``ipc/replies.py``) says: :meth:`ClientLimits.admit` and :meth:`ClientLimits.done` take
the ticket, so what is counted in is what is counted out. A request over either limit
is answered RESOURCE_EXHAUSTED at once, so one client cannot fill the models' queues or the
daemon's memory for the others; a lone request is always admitted (its size is bounded
by ``max_message_bytes``). A client with nothing in flight has no entry at all.

A reply's large frames (:data:`REPLY_TRACK_BYTES` and over) go out without a copy and
tracked (``zmq.Frame(track=True)``), and their bytes count against the client, as a
request's do, until libzmq has let go of them: a client that does not read its replies
(a DEALER with a receive high-water mark of 1 never does) otherwise had every big reply
kept for it in the daemon, up to ``max_replies_queued_per_client`` of them per
connection (600 replies of 1.2 MB: +850 MiB of RSS, unbounded by any limit). libzmq
releases the messages of one connection in the order they were sent, so each client's
replies are looked at from the oldest: when that client sends a request, and every
client's when the daemon-wide bound would refuse one and every :data:`SETTLE_S` while any
are counted (a client that went away is counted out then).

Daemon-wide, the bytes of every request in flight are bounded too
(``server.max_bytes_in_flight``): many connections with one request each can no more
fill the daemon's memory than one connection with many. The last quarter of that bound
is kept for users (uids) holding less than a quarter of it, so one user filling the
daemon leaves a polite one its turn.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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
REFUSED_TRIM_S = 0.1
"""How long after the last of a burst of requests refused for their bytes (32 MiB or
more together) their memory goes back."""
REPLY_TRACK_BYTES = 64 * 2**10
"""Reply frames of at least this size are sent tracked and count against their client
until libzmq has released them; smaller ones are copied by pyzmq (at most
``max_replies_queued_per_client`` x this many bytes wait per connection untracked)."""
SETTLE_S = 0.1
"""While replies are counted as unread, every client's are looked at this often (a client
that went away or read them after its last request is counted out within it)."""
IDLE_TRIM_S = 2.0
"""How long no inference may have finished before the free pages go back (a client
pausing that long pays for faulting its next request's buffers in again). Other
requests (pings, a status poll, ``inferctl top``) do not put the trim off."""


@dataclass
class _Use:
    owner: object  # whose requests (a uid, or the connection itself)
    requests: int = 0
    bytes: int = 0  # of its requests in flight and of its replies libzmq still holds
    unread: deque[tuple[int, Any]] = field(default_factory=deque)
    """(bytes, tracker) of each reply sent with tracked frames, oldest first."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class ClientLimits:
    """Per-client and daemon-wide counts of requests in flight (I/O thread only).

    Args:
        max_requests: requests one client may have in flight.
        max_bytes: bytes of requests one client may have in flight.
        max_held: bytes of requests the whole daemon may hold in flight (0: no bound).
            Past three quarters of it, a user (the ``owner`` given to :meth:`admit`)
            whose requests hold a quarter of it already is refused, so a polite user
            still gets a turn beside one that fills the daemon; a lone request on a
            daemon that holds nothing is always taken (up to ``max_message_bytes``).
    """

    def __init__(self, max_requests: int, max_bytes: int, max_held: int = 0) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.max_held = max_held
        self._use: dict[bytes, _Use] = {}
        self._owned: dict[object, int] = {}  # bytes in flight by owner (a uid)
        self._in_flight = 0
        self.held = 0  # bytes of every request in flight and of unread big replies
        self._unread = 0  # replies counted in held until libzmq releases them
        self._settled_at = 0.0
        self._since_trim = 0
        self._worked = 0.0  # when the last inference finished
        self._refused_bytes = 0  # of requests refused for their bytes, since the trim
        self._refused_at = 0.0
        self.refused = 0
        self.trims = 0

    def admit(self, ticket: Ticket, owner: object = None) -> str | None:
        """Count the request of ``ticket`` (its peer and size; ``owner``: whose it is,
        by default its connection); why it is over a limit, or None.

        Every call is matched by one :meth:`done` (also for a refused request)."""
        key, size = ticket.peer, ticket.size
        ticket.held = size
        use = self._use.get(key)
        if use is None:
            use = self._use[key] = _Use(key if owner is None else owner)
        elif use.unread:
            self._settle(use)
        bound = self.max_held
        if bound and self.held + size > bound * 3 // 4 and self._unread:
            self._settle_all()  # released replies of other clients no longer count
        held, owned = self.held, self._owned.get(use.owner, 0)
        use.requests += 1
        use.bytes += size
        self._owned[use.owner] = owned + size
        self.held += size
        self._in_flight += 1
        self._since_trim += size
        if use.requests > self.max_requests:
            self.refused += 1
            return (f"this client has {use.requests - 1} requests in flight, the limit "
                    f"(server.max_requests_per_client = {self.max_requests}); wait for "
                    f"replies before sending more")
        if use.bytes > self.max_bytes and (use.requests > 1 or use.unread):
            self.refused += 1
            waiting = (f" and {len(use.unread)} replies it has not read" if use.unread
                       else "")
            return (f"this client has {use.bytes - size} bytes of requests in flight"
                    f"{waiting}; this one ({size} bytes) would pass the limit "
                    f"(server.max_bytes_per_client = {self.max_bytes}); read the replies "
                    f"before sending more")
        if bound and held and (held + size > bound or (held + size > bound * 3 // 4
                                                      and owned + size > bound // 4)):
            self.refused += 1
            self._refused_bytes += size
            self._refused_at = time.monotonic()
            why = ("would pass the limit" if held + size > bound else
                   f"would pass three quarters of the limit, past which one user may hold "
                   f"at most a quarter ({_mib(bound // 4)}; this user holds {_mib(owned)})")
            return (f"the daemon holds {_mib(held)} of requests not yet answered; this one "
                    f"({_mib(size)}) {why} of {_mib(bound)} (server.max_bytes_in_flight); "
                    f"retry when replies have come")
        return None

    def decoding(self, ticket: Ticket, extra: int) -> str | None:
        """Count ``extra`` bytes more for the admitted request of ``ticket``: what
        decoding its tensors will make (unpacked packed types, string objects), priced
        from its header before anything is decoded; why that is over a limit, or None.
        No request is exempt here: its frames were all a lone request could bring."""
        use = self._use.get(ticket.peer)
        if use is None or extra <= 0:
            return None
        held, owned = self.held, self._owned.get(use.owner, 0)
        ticket.held += extra
        self._release(use, -extra)
        bound = self.max_held
        total = ticket.held
        what = (f"this request's tensors would take {_mib(total)} once decoded "
                f"({_mib(ticket.size)} received; packed types unpacked to a byte per "
                f"element, strings as Python objects)")
        if use.bytes > self.max_bytes:
            self.refused += 1
            return (f"{what}; with the {_mib(use.bytes - total)} this client holds already "
                    f"that passes the limit of {_mib(self.max_bytes)} "
                    f"(server.max_bytes_per_client); send smaller tensors")
        if bound and (held + extra > bound or (held + extra > bound * 3 // 4
                                               and owned + extra > bound // 4)):
            self.refused += 1
            self._refused_bytes += ticket.size  # what was received: nothing was decoded
            self._refused_at = time.monotonic()
            why = ("would pass the limit" if held + extra > bound else
                   f"would pass three quarters of the limit, past which one user may hold "
                   f"at most a quarter ({_mib(bound // 4)}; this user's other requests "
                   f"hold {_mib(owned - ticket.size)})")
            return (f"{what}; with the {_mib(held - ticket.size)} of requests the daemon "
                    f"holds already that {why} of {_mib(bound)} "
                    f"(server.max_bytes_in_flight); send smaller tensors, or retry when "
                    f"replies have come")
        self._since_trim += extra  # decoded, later freed: worth an idle trim
        return None

    def holds(self, key: bytes) -> bool:
        """Whether client ``key`` has requests in flight."""
        use = self._use.get(key)
        return use is not None and use.requests > 0

    def done(self, ticket: Ticket, unread: tuple[int, Any] | None = None) -> None:
        """The request of ``ticket`` was answered; ``unread``: (bytes, tracker) of its
        reply's tracked frames, which count for the client until the tracker is done."""
        use = self._use.get(ticket.peer)
        self._in_flight -= 1
        if ticket.model is not None:  # an inference (its tensors may be in shared memory)
            self._worked = time.monotonic()
        if use is None:
            self.held -= ticket.held
            return
        use.requests -= 1
        if unread is not None:
            use.unread.append(unread)
            self._unread += 1
        self._release(use, ticket.held - (unread[0] if unread is not None else 0))
        self._forget_if_idle(ticket.peer, use)

    def _forget_if_idle(self, key: bytes, use: _Use) -> None:
        """Drop the entry of a client with nothing in flight nor unread."""
        if use.requests <= 0 and not use.unread:
            del self._use[key]

    def _release(self, use: _Use, size: int) -> None:
        """``size`` bytes of ``use``'s no longer count (negative: more count)."""
        use.bytes -= size
        self.held -= size
        left = self._owned.get(use.owner, 0) - size
        if left > 0:
            self._owned[use.owner] = left
        else:
            self._owned.pop(use.owner, None)

    def _settle(self, use: _Use) -> None:
        """Stop counting the client's replies that libzmq has released (oldest first:
        one connection's messages leave in order)."""
        unread = use.unread
        while unread and unread[0][1].done:
            self._release(use, unread.popleft()[0])
            self._unread -= 1

    def settle_in(self) -> float | None:
        """Seconds until every client's unread replies are looked at again (0: now), or
        None if none are counted."""
        if not self._unread:
            return None
        return max(0.0, self._settled_at + SETTLE_S - time.monotonic())

    def settle_if_due(self) -> None:
        """Look at every client's unread replies if :data:`SETTLE_S` has passed."""
        if self._unread and time.monotonic() >= self._settled_at + SETTLE_S:
            self._settle_all()

    def _settle_all(self) -> None:
        self._settled_at = time.monotonic()
        for key, use in list(self._use.items()):
            if use.unread:
                self._settle(use)
                self._forget_if_idle(key, use)

    def unread(self) -> int:
        """Replies whose tracked frames libzmq held at the last look."""
        return self._unread

    def connection_closed(self) -> None:
        """A client connection closed: its buffers are free memory now, trimmed once
        the closing has settled (as after an inference)."""
        self._since_trim += CONNECTION_BYTES
        self._worked = time.monotonic()

    def trim_in(self) -> float | None:
        """Seconds until an idle trim is due (0: now), or None if none is waiting (too
        little received since the last one, or requests in flight: the next answer
        asks again). Requests refused for their bytes are garbage at once: a burst of
        them is trimmed :data:`REFUSED_TRIM_S` after the last, in flight or not."""
        if self._refused_bytes >= TRIM_AFTER_BYTES:
            return max(0.0, self._refused_at + REFUSED_TRIM_S - time.monotonic())
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
        self._since_trim = self._refused_bytes = 0
        if malloc_trim():
            self.trims += 1
            log.debug("returned free memory to the system (malloc_trim)")

    def clients(self) -> int:
        """Clients with requests in flight."""
        return sum(1 for use in self._use.values() if use.requests > 0)


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
        self.fd_limit = fd_limit
        self.fd_brake = max(self.max, fd_limit - FD_RESERVE)
        """Open descriptors of the process at which accepting pauses whatever the count
        says: libzmq accepts on its own thread and its monitor's events arrive late, so
        a burst of connections is open before it is counted (at load 3, 1,100 at once
        held 751 descriptors while 517 were counted)."""
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
