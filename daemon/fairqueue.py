"""A model's request queue that takes turns between clients.

One FIFO per client (the ZeroMQ routing id of its connection, or ``b""`` for requests
made inside the daemon), served round-robin one request at a time: a client with 500
requests queued delays another client's request by at most one of its own, not by
all 500. Within one client the order is kept.

The interface is the part of ``queue.SimpleQueue`` the workers use (``put``, ``get``
with ``block``/``timeout``, ``get_nowait``, ``qsize``, ``empty``). A request is an item
with a ``ticket``; anything else is a sentinel (the workers' STOP), served once every
request queued before it has been served, as with a plain FIFO. Requests queued after
it stay for the next worker (a model being drained keeps the requests that arrive
meanwhile for its next load).

:meth:`drop` takes out every request of one client (one that has disconnected): they
are answered by the caller instead of run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any


MIN_SHARE = 2
"""Requests any client may have queued even when the queue is full."""


class FairQueue:
    """Round-robin between clients; unbounded (the caller keeps the bound)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # One token per queued item: a get first takes a token (a C-level blocking
        # wait with timeout), then an item, which is then sure to be there.
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._peers: OrderedDict[bytes, deque[tuple[int, Any]]] = OrderedDict()
        self._stops: deque[tuple[int, Any]] = deque()  # sentinels and their numbers
        self._seq = 0
        self._size = 0
        self._stale = 0  # tokens of dropped items, still in _tokens

    def put(self, item: Any) -> None:
        with self._lock:
            self._seq += 1
            ticket = getattr(item, "ticket", None)
            if ticket is None:
                self._stops.append((self._seq, item))
            else:
                peer = getattr(ticket, "peer", b"")
                key = peer if isinstance(peer, bytes) else b""
                fifo = self._peers.get(key)
                if fifo is None:
                    fifo = self._peers[key] = deque()
                fifo.append((self._seq, item))
            self._size += 1
        self._tokens.put(None)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next item, taking turns between clients; raises ``queue.Empty`` like
        ``SimpleQueue.get`` when none arrives in time."""
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._tokens.get(block, left)
            with self._lock:
                if self._stale:  # the token of a dropped item: wait for the next one
                    self._stale -= 1
                    continue
                self._size -= 1
                if self._stops and (not self._peers or min(
                        f[0][0] for f in self._peers.values()) > self._stops[0][0]):
                    return self._stops.popleft()[1]  # nothing queued before it is left
                key, fifo = next(iter(self._peers.items()))
                _, item = fifo.popleft()
                if fifo:
                    self._peers.move_to_end(key)  # its next request waits for the others'
                else:
                    del self._peers[key]  # a client with nothing queued holds nothing
                return item

    def drop(self, peer: bytes) -> list[Any]:
        """Take out every request of ``peer`` still queued, in order (for the caller to
        answer); the others keep their turns."""
        with self._lock:
            fifo = self._peers.pop(peer, None)
            if not fifo:
                return []
            self._size -= len(fifo)
            self._stale += len(fifo)
            return [item for _, item in fifo]

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        return self._size

    def empty(self) -> bool:
        return self._size == 0

    def below_share(self, peer: bytes) -> bool:
        """Whether ``peer`` has fewer than :data:`MIN_SHARE` requests queued: such a
        client is admitted even to a full queue, so that clients that filled it cannot
        lock the others out (the queue may then pass its bound by a few per client)."""
        fifo = self._peers.get(peer)
        return fifo is None or len(fifo) < MIN_SHARE

    def peers(self) -> int:
        """How many clients have requests queued."""
        return len(self._peers)
