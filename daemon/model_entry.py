"""One cache entry: the state of one version of one model, its queue, its counters; and
the ``models`` listing built from the entries (:func:`describe_cache`)."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import StrEnum
from typing import Any

from inferd.daemon.placement import ModelPlacement
from inferd.daemon.worker import WorkItem, Workers, WorkQueue
from inferd.ipc.errors import ErrorCode
from inferd.libbackends.contract import LoadedModel

ModelKey = tuple[str, int]
"""(model name, version)"""


class State(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


class ModelEntry:
    """One version of one model. Guarded by ``lock``; the queue is thread-safe.

    ``in_flight`` counts the requests queued or running: a model with any is busy and
    is not evicted or unloaded for idleness.
    """

    def __init__(self, name: str, version: int, queue_size: int) -> None:
        self.name = name
        self.version = version
        self.label = f"{name} version {version}"
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.state = State.UNLOADED
        # Takes turns between clients; the bound is kept by ModelManager._enqueue under
        # ``lock``.
        self.queue: WorkQueue = WorkQueue()
        self.queue_size = queue_size
        self.backend: str | None = None
        self.placement: ModelPlacement | None = None  # backend, device and why
        self.model: LoadedModel | None = None
        self.workers: Workers | None = None
        self.error: str | None = None
        self.error_code: ErrorCode = ErrorCode.INTERNAL
        self.failed_at = 0.0
        self.memory_bytes: int | None = None
        self.memory_rss_bytes: int | None = None
        self.memory_reported_bytes: int | None = None
        self.reserved = 0
        self.load_future: Future[ModelEntry] | None = None
        self.loads = 0
        self.served = 0
        self.failed_requests = 0
        self.in_flight = 0
        self.last_used: float | None = None
        self.used_at = time.monotonic()
        self.keep_until = 0.0
        self.keep_alive = math.inf

    def set_state(self, state: State) -> None:
        """Change state (caller holds ``lock``) and wake whoever waits on a change."""
        self.state = state
        self.changed.notify_all()

    def touch(self, keep_alive: float | None = None, request: bool = True) -> None:
        """Restart the idle clock (caller holds ``lock``); ``request``: a request used
        it (shown as last used); a request's keep-alive extends how long it stays."""
        now = time.monotonic()
        self.used_at = now
        if request:
            self.last_used = time.time()
        if keep_alive is not None:
            self.keep_until = max(self.keep_until, now + keep_alive)

    def take_queued(self) -> list[WorkItem]:
        """Empty the queue (caller holds ``lock``): the requests in it, which the caller
        must answer or pass on; sentinels are dropped."""
        items = []
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, WorkItem):
                items.append(item)
        self.in_flight -= len(items)
        return items

    def cost(self) -> int:
        """Bytes this entry holds against the budget now."""
        if self.state is State.LOADING:
            return self.reserved
        if self.state in (State.READY, State.DRAINING):
            return self.memory_bytes or 0
        return 0

    def describe(self) -> dict[str, Any]:
        m = self.model
        return {
            "name": self.name, "state": str(self.state), "version": self.version,
            "backend": self.backend, "error": self.error,
            "device": self.placement.device if self.placement else None,
            "device_kind": str(self.placement.kind) if self.placement else None,
            "chosen": self.placement.why if self.placement else None,
            "inputs": [s.to_json() for s in m.inputs] if m else [],
            "outputs": [s.to_json() for s in m.outputs] if m else [],
            "memory_bytes": self.memory_bytes,
            "memory_rss_bytes": self.memory_rss_bytes,
            "memory_reported_bytes": self.memory_reported_bytes,
            "requests": self.served, "failed_requests": self.failed_requests,
            "loads": self.loads, "in_flight": self.in_flight,
            "queued": self.queue.qsize(), "last_used": self.last_used,
            "idle_s": (round(time.monotonic() - self.used_at, 3)
                       if self.state is State.READY and not self.in_flight else None),
            "keep_alive_s": None if math.isinf(self.keep_alive) else self.keep_alive,
            "threads": [t.name for t in self.workers.threads] if self.workers else [],
            "placement": self.workers.placement() if self.workers else [],
            "batching": self.workers.batching() if self.workers else None,
            "plan": m.describe().get("plan") if m else None,
        }


def describe_cache(catalog: dict[str, Any], entries: dict[ModelKey, ModelEntry],
                   pinned: Callable[[ModelEntry], bool],
                   settings: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """The ``models`` listing: every model the catalog offers (its default version,
    loaded or not) and every version in memory, with state, pins and settings."""
    out = []
    for name in sorted(set(catalog) | {n for n, _ in entries}):
        spec = catalog.get(name)
        rows = [e for (n, _), e in sorted(entries.items()) if n == name
                and (e.state is not State.UNLOADED or (spec and e.version == spec.default))]
        if spec and (name, spec.default) not in entries:
            rows.append(ModelEntry(name, spec.default, 1))
        for e in rows:
            with e.lock:
                info = e.describe()
                info["pinned"] = pinned(e)
            if spec is None:
                info["error"] = info["error"] or "removed from the repository"
            elif spec.error:
                info.update(state=str(State.FAILED), error=spec.error)
            if e.state is State.UNLOADED and spec and not spec.error:
                keep = settings(spec).keep_alive
                info["keep_alive_s"] = None if math.isinf(keep) else keep
            if spec and not spec.error and info["batching"] is None:  # as configured
                info["batching"] = {"max_batch": spec.settings.max_batch,
                                    "max_delay_ms": spec.settings.max_delay_ms,
                                    "mode": spec.settings.batching}
            info["versions"] = list(spec.versions) if spec else []
            info["default"] = bool(spec and spec.default == e.version)
            out.append(info)
    return out
