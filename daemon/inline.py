"""The ops that used to run on the I/O thread (``status``, ``models``, ``metrics``,
``backends``, and requests naming a model the catalog does not know), on a thread of
their own, bounded per client.

On the I/O thread each of them delayed every other client: a ``metrics`` flood took a
well-behaved client's p50 from 0.83 to 7.2 ms, unknown names (each a look at the disk
and a list of what is available) to 10.4 ms. Here:

- they run on the ``inferd-inline`` thread, one at a time, so the I/O thread only hands
  them over;
- each client (connection) may run :data:`RATE` of them a second, after a burst of
  :data:`BURST`; more wait their turn (a flood of them slows its sender, nobody else),
  and more than :data:`MAX_WAITING` waiting are refused RESOURCE_EXHAUSTED at once;
- the metrics, the expensive one (2.8 ms), are collected at most every
  :data:`METRICS_TTL_S` and shared by the requests in between.

A request whose deadline passes while it waits is answered DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.daemon.pipeline import unpin_current_thread
from inferd.daemon.stages import Sleeper
from inferd.ipc.errors import ErrorCode, Failure, InferdError, failure
from inferd.ipc.protocol import Reply
from inferd.ipc.replies import Ticket

log = logging.getLogger(__name__)

RATE = 50.0
"""Inline ops one client may run per second (past the burst)."""
BURST = 20
"""Inline ops one client may run at once before :data:`RATE` applies."""
MAX_WAITING = 64
"""Inline ops of one client that may wait; more are refused at once."""
MAX_CLIENTS = 4096
"""Clients whose turns are remembered (those with nothing waiting are forgotten first)."""
METRICS_TTL_S = 0.25
"""How old the metrics a ``metrics`` request gets may be."""

Deferred = Callable[[], Reply | None]
"""Answers a request (a Reply), or hands it on and returns None."""


@dataclass
class _Client:
    tat: float = 0.0  # the theoretical arrival time of its next op (GCRA)
    waiting: int = 0


class InlineOps(Sleeper):
    """The ``inferd-inline`` thread and its per-client turns.

    Args:
        reply: sends a ticket's reply (``Server.send_reply``; any thread).
        collect_metrics: the metrics op's result, collected afresh.
    """

    def __init__(self, reply: Callable[[Ticket, Reply], None],
                 collect_metrics: Callable[[], dict[str, Any]]) -> None:
        self._reply = reply
        self._collect_metrics = collect_metrics
        self._clients: dict[bytes, _Client] = {}
        self._ready: list[tuple[float, int, bytes, Ticket, Deferred]] = []
        self._order = itertools.count()
        super().__init__("inferd-inline", self._run)
        self._metrics: tuple[float, dict[str, Any]] | None = None
        self.refused = 0

    def submit(self, ticket: Ticket, job: Deferred) -> None:
        """Run ``job`` for ``ticket``'s request in its client's turn (I/O thread).

        Raises:
            InferdError: RESOURCE_EXHAUSTED, too many of this client's wait already.
        """
        now = time.monotonic()
        with self._lock:
            client = self._clients.get(ticket.peer)
            if client is None:
                if len(self._clients) >= MAX_CLIENTS:  # forget those with nothing waiting
                    self._clients = {k: c for k, c in self._clients.items() if c.waiting}
                client = self._clients[ticket.peer] = _Client(now)
            if client.waiting >= MAX_WAITING:
                self.refused += 1
                raise InferdError(f"this client has {client.waiting} status, models, "
                                  f"metrics or backends requests waiting (at most "
                                  f"{RATE:g} a second run); wait for their replies",
                                  ErrorCode.RESOURCE_EXHAUSTED)
            # GCRA: at most BURST at once, then one every 1/RATE s.
            start = max(now, client.tat - BURST / RATE)
            client.tat = max(client.tat, now) + 1 / RATE
            client.waiting += 1
            heapq.heappush(self._ready, (start, next(self._order), ticket.peer, ticket,
                                         job))
            self._wake.notify()

    def metrics(self) -> dict[str, Any]:
        """The metrics op's result, at most :data:`METRICS_TTL_S` old (inline thread)."""
        now = time.monotonic()
        if self._metrics is None or now - self._metrics[0] >= METRICS_TTL_S:
            self._metrics = (now, self._collect_metrics())
        return self._metrics[1]

    def _run(self) -> None:
        unpin_current_thread()
        while True:
            with self._lock:
                while not self._stopping and (
                        not self._ready or self._ready[0][0] > time.monotonic()):
                    self._wake.wait(self._ready[0][0] - time.monotonic()
                                    if self._ready else None)
                if self._stopping:
                    return
                _, _, peer, ticket, job = heapq.heappop(self._ready)
            try:
                self._one(ticket, job)
            finally:
                with self._lock:
                    client = self._clients.get(peer)
                    if client is not None:
                        client.waiting -= 1
                        if client.waiting <= 0 and client.tat <= time.monotonic():
                            del self._clients[peer]

    def _one(self, ticket: Ticket, job: Deferred) -> None:
        request = ticket.request
        if ticket.expired():
            self._reply(ticket, Reply(request.id, error=Failure(
                ErrorCode.DEADLINE_EXCEEDED, f"{request.op}: its timeout passed while it "
                f"waited for its turn")))
            return
        try:
            reply = job()
        except Exception as e:  # a coded refusal, or a bug: either way one reply
            reply = Reply(request.id, error=failure(e, str(request.op), log,
                                                    request_id=request.id))
        if reply is not None:
            self._reply(ticket, reply)

    # stop() (Sleeper's) ends the thread; what still waits is answered by the server's stop
