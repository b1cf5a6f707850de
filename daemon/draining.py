"""Draining and unloading the model cache's entries: the manager's way out.

A READY entry is drained (its workers finish what is queued and running) and unloaded
on request (``inferctl unload``), when idle past its keep-alive (the
``inferd-cache-idle`` thread), when the memory budget evicts it, when a reload retires
its version, and at stop. Requests that arrive during a drain wait in the queue; after
it they start a new load, go to the version that replaced this one, or get NOT_FOUND.

:class:`Draining` is a part of :class:`inferd.daemon.models.ModelManager` (its base
class); it uses the manager's entries, catalog, budget, loader and reply sink.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from inferd.daemon.budget import MemoryBudget
from inferd.daemon.catalog import Catalog
from inferd.daemon.loading import ModelLoader
from inferd.daemon.model_entry import ModelEntry, ModelKey, State
from inferd.daemon.repository import check_name
from inferd.daemon.worker import WorkItem, Workers
from inferd.ipc.errors import ErrorCode, InferdError, ModelError, failure
from inferd.ipc.protocol import Reply
from inferd.ipc.replies import ReplySink

# The manager's logger: operators filter on it ("model ... unloaded: ..." lines).
log = logging.getLogger("inferd.daemon.models")


class Draining:
    """Drain and unload entries of the model cache (a base of ModelManager, which sets
    the attributes declared here)."""

    catalog: Catalog
    budget: MemoryBudget
    left_running: list[Workers]
    _entries: dict[ModelKey, ModelEntry]
    _lock: threading.Lock
    _stopping: threading.Event
    _loader: ModelLoader
    _sink: ReplySink

    if TYPE_CHECKING:
        @property
        def observer(self) -> Any: ...

        @property
        def config(self) -> Any: ...

        def entry(self, name: str, version: int | None = None) -> ModelEntry: ...

        def _enqueue(self, entry: ModelEntry, item: WorkItem,
                     keep_alive: float | None) -> None: ...

    def _unload_entry(self, entry: ModelEntry, reason: str, only_if_idle: bool = False,
                      timeout: float | None = None) -> bool:
        """Drain and unload a READY entry; False if it was not (or no longer) eligible.

        Requests that arrive during the drain wait in the queue; afterwards they start
        a new load, go to the version that replaced this one, or get NOT_FOUND if the
        model is gone.
        """
        with entry.lock:
            if entry.state is not State.READY:
                return False
            if only_if_idle and not self.budget.evictable(entry):
                return False
            entry.set_state(State.DRAINING)
            workers, model = entry.workers, entry.model
        assert workers is not None and model is not None
        finished = workers.stop(timeout)
        if finished:
            model.unload()
            self.budget.meter.trim()
        else:
            log.error("model %s: workers did not finish within %.3g s; left running",
                      entry.label, timeout, extra={"MODEL": entry.name})
            self.left_running.append(workers)
        leftovers: list[WorkItem] = []
        with entry.lock:
            entry.model = entry.workers = entry.backend = entry.placement = None
            entry.memory_bytes = entry.memory_rss_bytes = entry.memory_reported_bytes = None
            entry.set_state(State.UNLOADED)
            if finished and not entry.queue.empty():
                if (self.catalog.servable(entry.name, entry.version)
                        and not self._stopping.is_set()):
                    self._loader.start(entry)
                else:
                    leftovers = entry.take_queued()
        log.info("model %s unloaded: %s", entry.label, reason, extra={"MODEL": entry.name})
        if self.observer is not None:
            self.observer.unloaded(entry.name, reason.startswith("evicted"))
        for item in leftovers:
            self._reroute(entry, item)
        return True

    def _reroute(self, retired: ModelEntry, item: WorkItem) -> None:
        """A request that reached a version just retired: hand it to the model's current
        default version if it named none, else answer NOT_FOUND."""
        try:
            if item.request.version is not None:
                raise ModelError(f"model {retired.label} was removed from the repository",
                                 ErrorCode.NOT_FOUND)
            self._enqueue(self.entry(retired.name), item, None)
        except Exception as e:
            self._sink.send(item.ticket, Reply(item.request.id, error=failure(
                e, f"model {retired.label}", log, model=retired.name)))

    def unload_idle(self) -> list[str]:
        """Unload every unpinned model idle longer than its keep-alive; their labels."""
        now = time.monotonic()
        with self._lock:
            entries = list(self._entries.values())
        done = []
        for e in entries:
            with e.lock:
                if e.state is not State.READY or e.in_flight or now < e.keep_until:
                    continue
                idle = now - e.used_at
                if idle < e.keep_alive:
                    continue
            if self._unload_entry(e, f"idle for {idle:.1f} s (keep_alive "
                                  f"{e.keep_alive:g} s)", only_if_idle=True):
                done.append(e.label)
        return done

    def _idle_loop(self) -> None:
        while not self._stopping.wait(self.config.cache.idle_check_s):
            try:
                self.unload_idle()
            except Exception:  # the idle check must outlive one bad unload
                log.exception("idle check failed")

    def unload(self, name: str, version: int | None = None, timeout: float | None = None,
               reason: str = "unload requested") -> ModelEntry:
        """Drain and unload ``name`` (every loaded version, or just ``version``): queued
        requests finish first; blocking. Entries the catalog no longer offers are
        dropped (a version retired by a reload). Returns the default version's entry."""
        check_name(name)
        with self._lock:
            entries = [e for (n, v), e in self._entries.items()
                       if n == name and (version is None or v == version)]
        if not entries:
            spec = self.catalog.get(name)
            if spec is not None and spec.error:  # nothing loaded, nothing to do
                return ModelEntry(name, version or spec.default, 1)
            return self.entry(name, version)  # NOT_FOUND if unknown, else unloaded
        for entry in entries:
            self._unload_wait(entry, reason, timeout)
            with self._lock:
                if (not self.catalog.servable(entry.name, entry.version)
                        and entry.state is State.UNLOADED):
                    self._entries.pop((entry.name, entry.version), None)
        spec = self.catalog.get(name)
        return next((e for e in entries if spec and e.version == spec.default), entries[0])

    def _unload_wait(self, entry: ModelEntry, reason: str, timeout: float | None) -> None:
        with entry.lock:
            future = entry.load_future if entry.state is State.LOADING else None
        if future is not None:
            try:
                future.result()
            except (InferdError, CancelledError):
                pass  # a failed load answered its requests; a cancelled one, the server
        with entry.lock:
            entry.changed.wait_for(lambda: entry.state is not State.DRAINING, timeout)
            if entry.state is State.FAILED:
                entry.set_state(State.UNLOADED)
        self._unload_entry(entry, reason, timeout=timeout)
