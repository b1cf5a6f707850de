"""A model's request queue that takes turns between clients, and forms fair batches.

One FIFO per client (the ZeroMQ routing id of its connection, ``ticket.peer``, or
``b""`` for requests made inside the daemon), served round-robin one request at a time:
a client with 500 requests queued delays another client's request by at most one of its
own, not by all 500. Within one client the order is kept.

:meth:`FairQueue.get_batch` forms a batch the same way: requests taken round-robin
across the clients waiting, each client's rows capped at its share of the batch
(``ceil(limit / clients)``), so that a polite client's request rides in the next batch
beside a fair share of a greedy client's rows, not beside 31 of them.

The interface is the part of ``queue.Queue`` the workers use (``put`` with a timeout,
``get`` with ``block``/``timeout``, ``get_nowait``, ``qsize``, ``empty``). A request is an
item with a ``ticket``; anything else is a sentinel (the workers' STOP), served once
every request queued before it has been served, as with a plain FIFO; a sentinel never
waits for room. Requests queued after it stay for the next worker (a model being drained
keeps the requests that arrive meanwhile for its next load).

:meth:`drop` takes out every request of one client (one that has disconnected): they
are answered by the caller instead of run. :meth:`withdraw` takes out the sentinels
(workers given up on will not take theirs).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

MIN_SHARE = 2
"""Requests any client may have queued even when the queue is full."""


class QueueClosed(Exception):
    """A request put into a queue that :meth:`FairQueue.close` closed."""


def _peer(item: Any) -> bytes:
    peer = getattr(item.ticket, "peer", b"")
    return peer if isinstance(peer, bytes) else b""


class FairQueue:
    """Round-robin between clients.

    Args:
        maxsize: requests it holds before :meth:`put` blocks (a stage queue's
            backpressure); 0: unbounded (the model queue: its caller keeps the bound
            and answers RESOURCE_EXHAUSTED instead of blocking the I/O thread).
    """

    def __init__(self, maxsize: int = 0) -> None:
        self._lock = threading.Lock()
        # One token per queued item: a get first takes a token (a C-level blocking
        # wait with timeout), then an item, which is then sure to be there.
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._space = threading.Semaphore(maxsize) if maxsize > 0 else None
        self._peers: OrderedDict[bytes, deque[tuple[int, Any]]] = OrderedDict()
        self._stops: deque[tuple[int, Any]] = deque()  # sentinels and their numbers
        self._seq = 0
        self._size = 0
        self._stale = 0  # tokens of dropped items, still in _tokens
        self._closed = False
        self._room = threading.Condition(self._lock)  # for wait_below
        self._room_waiters = 0
        # A timed wait for a token waits here, never in SimpleQueue.get with a timeout:
        # CPython 3.11's (3.11.7 here) waits forever once a put wakes it after its
        # deadline and another getter took the item first (it retries with a negative
        # timeout, which means "no timeout"): a batch waiting max_delay_ms for company
        # then waited for the next request to arrive.
        self._arrived = threading.Condition(self._lock)
        self._token_waiters = 0

    def put(self, item: Any, timeout: float | None = None) -> None:
        """Queue ``item``; in a bounded queue a request waits for room up to ``timeout``
        seconds (None: as long as it takes).

        Raises:
            queue.Full: no room came in time.
            QueueClosed: a request for a queue that :meth:`close` closed.
        """
        request = getattr(item, "ticket", None) is not None
        if request and self._space is not None and not self._space.acquire(timeout=timeout):
            raise queue.Full
        if request and self._closed:
            raise QueueClosed
        with self._lock:
            self._seq += 1
            if not request:
                self._stops.append((self._seq, item))
            else:
                key = _peer(item)
                fifo = self._peers.get(key)
                if fifo is None:
                    fifo = self._peers[key] = deque()
                fifo.append((self._seq, item))
            self._size += 1
            self._token()

    def _token(self) -> None:
        """Add a token and wake the timed waiters (caller holds the lock)."""
        self._tokens.put(None)
        if self._token_waiters:
            self._arrived.notify_all()

    def _take_token(self, deadline: float | None) -> bool:
        """Take a token, waiting until ``deadline`` (monotonic seconds; None: as long as
        it takes); False if none came in time."""
        if deadline is None:
            self._tokens.get()  # an untimed wait is safe
            return True
        while True:
            try:
                self._tokens.get(False)
                return True
            except queue.Empty:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:  # tokens are put under it: no wake-up is missed
                if self._tokens.empty():
                    self._token_waiters += 1
                    try:
                        self._arrived.wait(left)
                    finally:
                        self._token_waiters -= 1

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next item, taking turns between clients; raises ``queue.Empty`` like
        ``SimpleQueue.get`` when none arrives in time."""
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        while True:
            if not block:
                self._tokens.get(False)
            elif not self._take_token(deadline):
                raise queue.Empty
            with self._lock:
                if self._stale:  # the token of a dropped item: wait for the next one
                    self._stale -= 1
                    continue
                if self._stop_due():
                    self._size -= 1
                    return self._stops.popleft()[1]  # nothing queued before it is left
                key, fifo = next(iter(self._peers.items()))
                item = self._pop(key, fifo)
            if self._space is not None:
                self._space.release()
            return item

    def get_batch(self, limit: int, rows: Callable[[Any], int], delay: float = 0.0,
                  allowed: Callable[[int], bool] | None = None) -> list[Any]:
        """A fair batch of requests, or ``[sentinel]``.

        Blocks for the first item. Then takes requests round-robin across the clients
        waiting, up to ``limit`` rows in all and ``ceil(limit / clients)`` rows of any
        one client (the clients waiting or already in the batch), waiting up to
        ``delay`` seconds for more. A sentinel next in line comes alone; one that comes
        due while the batch forms ends it and stays for the next call. A request bigger
        than what is left is left for the next batch (it runs alone if it is first).

        Args:
            limit: rows the batch may hold.
            rows: the rows of a request (the length of its first dimension).
            delay: seconds the first request may wait for company.
            allowed: whether a batch of so many rows may run (sizes that cost a model no
                switch); the batch is cut back to the longest allowed prefix (at least
                its first request), the rest put back at the head of their queues.
        """
        first = self.get()
        if getattr(first, "ticket", None) is None:
            return [first]
        batch = [first]
        total = rows(first)
        taken = {_peer(first): total}
        until = time.monotonic() + delay
        while total < limit:
            if not self._take_token(until):
                break
            with self._lock:
                if self._stale:
                    self._stale -= 1
                    continue
                picked = None if self._stop_due() else self._pick(limit, total, taken, rows)
                if picked is None:  # nothing may join: the item stays, with its token
                    self._token()
                    break
                key, item, n = picked
            batch.append(item)
            total += n
            taken[key] = taken.get(key, 0) + n
        if allowed is not None and len(batch) > 1 and not allowed(total):
            self._cut(batch, rows, allowed)
        if self._space is not None:  # room for those taken after the first (get's own)
            for _ in range(len(batch) - 1):
                self._space.release()
        return batch

    def _stop_due(self) -> bool:
        """Whether the first sentinel is next: no request queued before it is left
        (caller holds the lock)."""
        return bool(self._stops) and (not self._peers or min(
            f[0][0] for f in self._peers.values()) > self._stops[0][0])

    def _pop(self, key: bytes, fifo: deque[tuple[int, Any]]) -> Any:
        """Take ``key``'s first request (caller holds the lock)."""
        _, item = fifo.popleft()
        if fifo:
            self._peers.move_to_end(key)  # its next request waits for the others'
        else:
            del self._peers[key]  # a client with nothing queued holds nothing
        self._size -= 1
        if self._room_waiters:
            self._room.notify_all()
        return item

    def wait_below(self, bound: int, timeout: float | None = None) -> bool:
        """Wait until fewer than ``bound`` items are queued (an in-process caller's
        backpressure on a queue whose bound its owner keeps); False if ``timeout``
        seconds passed first."""
        with self._lock:
            self._room_waiters += 1
            try:
                return self._room.wait_for(lambda: self._size < bound, timeout)
            finally:
                self._room_waiters -= 1

    def _pick(self, limit: int, total: int, taken: dict[bytes, int],
              rows: Callable[[Any], int]) -> tuple[bytes, Any, int] | None:
        """The next request that may join a batch of ``total`` rows (caller holds the
        lock): the first client in turn whose next request fits the batch and its share."""
        clients = len(taken.keys() | self._peers.keys())
        share = math.ceil(limit / clients)
        for key, fifo in self._peers.items():
            n = rows(fifo[0][1])
            if total + n <= limit and taken.get(key, 0) + n <= share:
                return key, self._pop(key, fifo), n
        return None

    def _cut(self, batch: list[Any], rows: Callable[[Any], int],
             allowed: Callable[[int], bool]) -> None:
        """Cut ``batch`` back to its longest prefix of an allowed size (at least one
        request); put the rest back at the head of their clients' queues, in order."""
        sizes = [rows(item) for item in batch]
        keep = len(batch)
        while keep > 1 and not allowed(sum(sizes[:keep])):
            keep -= 1
        rest = batch[keep:]
        del batch[keep:]
        with self._lock:
            for item in reversed(rest):
                key = _peer(item)
                fifo = self._peers.get(key)
                if fifo is None:
                    fifo = self._peers[key] = deque()
                    self._peers.move_to_end(key, last=False)  # its turn is now
                # seq 0: before any sentinel queued meanwhile, as it was
                fifo.appendleft((0, item))
                self._size += 1
                self._token()  # their room was never released: they keep it

    def drop(self, peer: bytes) -> list[Any]:
        """Take out every request of ``peer`` still queued, in order (for the caller to
        answer); the others keep their turns."""
        with self._lock:
            fifo = self._peers.pop(peer, None)
            if not fifo:
                return []
            self._size -= len(fifo)
            self._stale += len(fifo)
            self._room.notify_all()
        if self._space is not None:
            for _ in fifo:
                self._space.release()
        return [item for _, item in fifo]

    def withdraw(self) -> int:
        """Take out every sentinel still queued (the threads they were meant for will not
        take them); how many."""
        with self._lock:
            n = len(self._stops)
            self._stops.clear()
            self._size -= n
            self._stale += n
        return n

    def close(self) -> list[Any]:
        """Take out every request, in order, and refuse new ones (:class:`QueueClosed`,
        also for a put waiting for room); sentinels may still be put."""
        with self._lock:
            self._closed = True
            items = sorted((entry for fifo in self._peers.values() for entry in fifo),
                           key=lambda e: e[0])
            self._peers.clear()
            self._size -= len(items)
            self._stale += len(items)
        if self._space is not None:
            for _ in range(len(items) + 1024):  # wakes every put waiting for room
                self._space.release()
        return [item for _, item in items]

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
