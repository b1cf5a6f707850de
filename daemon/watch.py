"""The watch: one thread (``inferd-watch``) that keeps two promises no stage can break.

1. **Deadlines.** Every wire request with a deadline is answered ``DEADLINE_EXCEEDED``
   when the deadline passes, whatever the stage holding it is doing (a hung processor,
   a driver that never returns, a queue behind either). The stages still check
   deadlines themselves before they run a request; the watch answers the ones they
   cannot reach. It reads the server's open tickets (the one record per request: no
   ledger of its own), every :data:`GRAIN_S` while some are open, and sleeps while none
   is. A ticket is answered once (:meth:`~inferd.ipc.replies.Ticket.answer`): the
   stage's late reply is dropped.
2. **Stuck stages.** A stage inside one call for longer than ``[models] stuck_after_s``
   (a pre/post step, a model run, a graph node) is reported: one WARNING when it gets
   stuck (and an INFO line when it returns), ``inferctl status`` and ``models``, the
   gauge ``inferd_stuck_stages``, and, with ``[systemd] watchdog_stuck``, the watchdog's
   health check while every inference thread of a ready model is stuck. It looks every
   :data:`SCAN_S` (or a quarter of ``stuck_after_s`` if that is shorter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from inferd.daemon.stages import Busy, Sleeper, describe_call
from inferd.ipc.errors import ErrorCode, Failure
from inferd.ipc.protocol import Reply
from inferd.ipc.replies import ReplySink

log = logging.getLogger(__name__)

GRAIN_S = 0.05
"""How often the open requests are looked at while there are some: a request is
answered at most this late."""
SCAN_S = 1.0
"""The longest gap between two looks for stuck stages (shorter for a small
``stuck_after_s``)."""


class Staged(Protocol):
    """Something with stage threads that note their calls (ModelThreads, graph executors)."""

    busy: Busy


class OpenRequests(Protocol):
    def open_tickets(self) -> list[Any]: ...


class Running(Protocol):
    def running_threads(self) -> list[Any]: ...


class Graphs(Protocol):
    def executors(self) -> list[tuple[str, Any]]: ...


class Watch(Sleeper):
    """Answers expired requests and reports stuck stages.

    Args:
        sink: where the DEADLINE_EXCEEDED replies go.
        requests: the server (its open tickets).
        models: the model manager (its running workers).
        graphs: the graph manager (its running executors).
        config: returns the configuration in force (``models.stuck_after_s``): the
            runtime's, read where it is kept (a reload replaces it there).
    """

    def __init__(self, sink: ReplySink, requests: OpenRequests, models: Running, graphs: Graphs,
                 config: Callable[[], Any]) -> None:
        self._sink = sink
        self._requests = requests
        self._models = models
        self._graphs = graphs
        self._config = config
        super().__init__("inferd-watch", self._loop)
        self._idle = True  # no open request had a deadline at the last look
        self._arrived = 0  # requests with a deadline tracked (see track)
        self._stuck: dict[str, list[str]] = {}  # model or graph -> its stuck stages
        self._reported: dict[tuple[str, float], str] = {}  # (thread, since) -> owner

    # ----------------------------------------------------------------- deadlines

    def track(self, ticket: Any) -> None:
        """A request arrived (I/O thread): if it has a deadline and the watch sleeps
        because none had, wake it (a counter and a flag read otherwise)."""
        if ticket.deadline is None:
            return
        self._arrived += 1  # no lock: the thread only checks that it moved
        if self._idle:
            with self._lock:
                self._wake.notify()

    def expire(self) -> bool:
        """Answer every open infer request past its deadline; True if some with a
        deadline are still open (worth another look in :data:`GRAIN_S`)."""
        now = time.monotonic()
        waiting = False
        for t in self._requests.open_tickets():
            if t.deadline is None or t.model is None or t.code is not None:
                continue  # no deadline, not an infer (a control op), or answered
            if t.deadline > now:
                waiting = True
                continue
            owner = t.model
            stuck = self._stuck.get(owner)
            where = f"; stuck: {'; '.join(stuck)}" if stuck else ""
            self._sink.send(t, Reply(t.request_id, error=Failure(
                ErrorCode.DEADLINE_EXCEEDED, f"{owner}: the deadline of "
                f"{(t.deadline - t.received) * 1000:.0f} ms passed before it was answered "
                f"(still queued or in a stage){where}")))
        return waiting

    # ----------------------------------------------------------------- stuck stages

    def stuck(self) -> dict[str, list[str]]:
        """The stages stuck now, by model or graph name (as of the last scan)."""
        with self._lock:
            return {k: list(v) for k, v in self._stuck.items()}

    def all_stuck(self) -> dict[str, list[str]]:
        """The ready models whose every inference thread is stuck, with the stuck calls
        (the watchdog's health check)."""
        after = self._config().models.stuck_after_s
        return {w.name: w.stuck(after) for w in self._models.running_threads()
                if w.all_stuck(after)}

    def _owners(self) -> Iterable[tuple[str, Staged]]:
        for w in self._models.running_threads():
            yield w.name, w
        for name, ex in self._graphs.executors():
            yield name, ex

    def scan(self) -> None:
        """Look for stuck stages once: log the new ones and the ones that returned."""
        after = self._config().models.stuck_after_s
        seen: dict[tuple[str, float], str] = {}
        stuck: dict[str, list[str]] = {}
        for owner, staged in self._owners():
            for thread, stage, since, what in staged.busy.calls(after):
                seen[(thread, since)] = owner
                stuck.setdefault(owner, []).append(describe_call(thread, stage, since, what))
                if (thread, since) not in self._reported:
                    log.warning("stage stuck: %s %s (models.stuck_after_s = %g)", owner,
                                describe_call(thread, stage, since, what), after,
                                extra={"MODEL": owner, "STAGE": stage})
        for (thread, since), owner in self._reported.items():
            if (thread, since) not in seen:
                log.info("stage no longer stuck: %s %s returned after %.1f s", owner, thread,
                         time.monotonic() - since, extra={"MODEL": owner})
        with self._lock:
            self._reported = seen
            self._stuck = stuck

    # ----------------------------------------------------------------- thread

    def _loop(self) -> None:
        next_scan = 0.0
        while True:
            seen = self._arrived
            try:
                waiting = self.expire()
                if time.monotonic() >= next_scan:
                    self.scan()
                    next_scan = time.monotonic() + min(SCAN_S,
                                                       self._config().models.stuck_after_s / 4)
            except Exception:  # the watch must outlive one bad scan or reply
                log.exception("the watch failed once; it goes on")
                waiting = True
            with self._lock:
                if self._stopping:
                    return
                # idle first, then the check: a request tracked after the check sees
                # the flag and wakes the thread; one tracked before it is seen here
                self._idle = True
                if waiting or self._arrived != seen:
                    self._idle = False
                gap = max(0.0, next_scan - time.monotonic())
                self._wake.wait(gap if self._idle else min(GRAIN_S, gap))
