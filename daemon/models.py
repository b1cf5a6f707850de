"""The model manager: the warm model cache's entries and their state machine.

One :class:`~inferd.daemon.model_entry.ModelEntry` per (model, version): its state
(unloaded -> loading -> ready -> draining -> unloaded, or failed), its bounded queue and
its workers. The manager submits and queues requests, starts loads, answers what a
failed load leaves queued, drains and unloads, unloads idle models, stops, and describes
the cache. What it delegates, one module each:

- :mod:`inferd.daemon.catalog`: what the repository offers (scan, pins, settings);
- :mod:`inferd.daemon.budget`: the memory budget (make room, evict, measured costs);
- :mod:`inferd.daemon.loading`: loading one version (backend, warm-up, measure, workers);
- :mod:`inferd.daemon.draining`: draining and unloading (explicit, idle, evicted, stop);
- :mod:`inferd.daemon.reload`: applying a reload through the public methods here.

Rules: a request for a model that is not loaded starts the load once (single flight)
and waits in the model's queue; a model with requests queued or running is never pulled
from under them; a failed load is remembered for ``cache.failed_load_hold_s`` (requests
meanwhile get its reason at once); idle unpinned models are unloaded after their
keep-alive; requests that reach a retired version go to the version that replaced it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from inferd.daemon.budget import MemoryBudget
from inferd.daemon.catalog import Catalog
from inferd.daemon.draining import Draining
from inferd.daemon.loading import ModelLoader
from inferd.daemon.memory import WorkingLedger
from inferd.daemon.model_entry import ModelEntry, ModelKey, State, describe_cache
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.reload import reload_catalog
from inferd.daemon.repository import Repository
from inferd.daemon.units import request_keep_alive
from inferd.daemon.worker import WorkItem, Workers
from inferd.ipc.errors import ErrorCode, Failure, InferdError, ModelError
from inferd.ipc.protocol import Reply, Request
from inferd.ipc.replies import AnyTicket, ReplySink
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.registry import Registry

log = logging.getLogger(__name__)


class ModelManager(Draining):
    """The model cache of one runtime.

    Args:
        repo: the model repository.
        registry: backends to choose from.
        config: the daemon configuration (replaced on reload: :meth:`use_config`).
        sink: where the workers' replies go (any thread).
    """

    def __init__(self, repo: Repository, registry: Registry, config: Any,
                 sink: ReplySink) -> None:
        self.registry = registry
        self.catalog = Catalog(repo, config)
        self.budget = MemoryBudget(lambda: self.config.cache.max_memory, self._all_entries,
                                   self._pinned, self._evict)
        self._loader = ModelLoader(self.catalog, registry, self.budget, lambda: self.config,
                                   sink, self._done)
        self.ledger = WorkingLedger(
            self.budget, lambda: self.config.cache.max_memory,
            lambda key: self._entries.get(key), lambda: self.cache_status()["used_bytes"],
            lambda: self._loader.pool.submit(self._enforce_budget))
        self._loader.ledger = self.ledger
        self._sink = sink
        self._entries: dict[ModelKey, ModelEntry] = {}
        self._lock = threading.Lock()  # the entries dict
        self._reload_lock = threading.Lock()
        self._stopping = threading.Event()
        self.left_running: list[Workers] = []  # workers a drain gave up on (still alive)
        self._idle_thread: threading.Thread | None = None

    @property
    def config(self) -> Any:
        return self.catalog.config

    @property
    def repo(self) -> Repository:
        return self.catalog.repo

    @property
    def processors(self) -> ProcessorRegistry | None:
        return self._loader.processors

    @processors.setter
    def processors(self, registry: ProcessorRegistry | None) -> None:
        self._loader.processors = registry  # set by the runtime

    @property
    def observer(self) -> Any:
        return self._loader.observer

    @observer.setter
    def observer(self, observer: Any) -> None:
        self._loader.observer = observer  # metrics hooks, set by the runtime

    @property
    def customops(self) -> OpRegistry | None:
        return self._loader.customops

    @customops.setter
    def customops(self, ops: OpRegistry | None) -> None:
        self._loader.customops = ops  # set by the runtime

    def start(self) -> None:
        """Start the idle-unload thread (``inferd-cache-idle``)."""
        self._idle_thread = threading.Thread(target=self._idle_loop, name="inferd-cache-idle",
                                             daemon=True)
        self._idle_thread.start()

    # ----------------------------------------------------------------- entries

    def entry(self, name: str, version: int | None = None) -> ModelEntry:
        """The entry for ``name`` at ``version`` (default: the version it serves by
        default), created on first use.

        Raises:
            ModelError: invalid name (INVALID_ARGUMENT), unknown model or version
                (NOT_FOUND, listing what exists), unusable model.toml (INTERNAL).
        """
        spec = self.catalog.spec(name)
        if version is None:
            version = spec.default
        elif version not in spec.versions:
            raise ModelError(f"model {name!r} has no version {version}; available: "
                             f"{', '.join(map(str, spec.versions))}", ErrorCode.NOT_FOUND)
        with self._lock:
            entry = self._entries.get((name, version))
            if entry is None:
                entry = ModelEntry(name, version, self.catalog.settings(spec).queue_size)
                self._entries[(name, version)] = entry
        return entry

    def _all_entries(self) -> list[ModelEntry]:
        with self._lock:
            return list(self._entries.values())

    def _pinned(self, entry: ModelEntry) -> bool:
        return self.catalog.pinned(entry.name, entry.version)

    # ----------------------------------------------------------------- requests

    def submit(self, request: Request, ticket: AnyTicket) -> None:
        """Queue an infer request (I/O thread). Raises InferdError to refuse it."""
        if request.model is None:
            raise ModelError("infer needs 'model'")
        keep_alive = request_keep_alive(request.params)
        entry = self.entry(request.model, request.version)
        self._enqueue(entry, WorkItem(request, ticket), keep_alive)

    def _enqueue(self, entry: ModelEntry, item: WorkItem, keep_alive: float | None) -> None:
        if self._stopping.is_set():
            raise InferdError("inferd is shutting down", ErrorCode.UNAVAILABLE)
        with entry.lock:
            if entry.state is State.FAILED:
                held = self.config.cache.failed_load_hold_s
                ago = time.monotonic() - entry.failed_at
                if ago < held:
                    raise InferdError(f"model {entry.label} failed to load {ago:.1f} s ago "
                                      f"(next try after {held:g} s): {entry.error}",
                                      entry.error_code)
                entry.set_state(State.UNLOADED)
            if entry.queue.qsize() >= entry.queue_size and not entry.queue.below_share(
                    getattr(item.ticket, "peer", b"")):
                raise InferdError(f"model {entry.label}: queue is full "
                                  f"({entry.queue_size} requests waiting)",
                                  ErrorCode.RESOURCE_EXHAUSTED)
            entry.in_flight += 1
            entry.touch(keep_alive)
            if entry.state is State.UNLOADED:
                self._loader.start(entry)
            # DRAINING: the request waits in the queue; the drain restarts the load.
            # Last: the put wakes a worker, which then waits for this thread's GIL.
            entry.queue.put(item)

    def cancel_peer(self, peer: bytes) -> int:
        """Answer CANCELLED every request of a client that has disconnected and is still
        queued for a model, instead of running it for nobody (I/O thread); how many."""
        with self._lock:
            entries = list(self._entries.values())
        dropped = 0
        for entry in entries:
            items = entry.queue.drop(peer)
            if not items:
                continue
            with entry.lock:
                entry.in_flight -= len(items)
            for item in items:
                self._sink.send(item.ticket, Reply(item.request.id, error=Failure(
                    ErrorCode.CANCELLED, f"model {entry.label}: the client disconnected "
                    f"before the request ran")))
            dropped += len(items)
        return dropped

    def _done(self, entry: ModelEntry, ok: bool) -> None:
        with entry.lock:
            entry.in_flight -= 1
            if ok:
                entry.served += 1
            else:
                entry.failed_requests += 1
            entry.touch()

    def _evict(self, entry: ModelEntry, reason: str) -> bool:
        return self._unload_entry(entry, reason, only_if_idle=True)

    # ----------------------------------------------------------------- control

    def load(self, name: str, version: int | None = None) -> ModelEntry:
        """Load ``name`` (or wait for the load in progress); blocking. An explicit load
        retries a remembered failure at once.

        Raises:
            InferdError: the load failed, with its code and reason.
        """
        entry = self.entry(name, version)
        with entry.lock:
            entry.changed.wait_for(lambda: entry.state is not State.DRAINING)
            entry.touch(request=False)
            if entry.state is State.FAILED:
                entry.set_state(State.UNLOADED)
            if entry.state is State.UNLOADED:
                future = self._loader.start(entry)
            elif entry.state is State.LOADING:
                future = entry.load_future
            else:
                future = None
        if future is not None:
            future.result()
        return entry

    def load_pinned(self, before_each: Callable[[int, int, str], None] | None = None
                    ) -> list[str]:
        """Load every pinned model not loaded yet; the names that failed (logged).

        Args:
            before_each: called with (position from 1, count, name) before each load
                (the runtime tells systemd the preload is progressing).
        """
        failed = []
        names = self.catalog.pinned_names()
        for i, name in enumerate(names, 1):
            if before_each is not None:
                before_each(i, len(names), name)
            try:
                self.load(name)
            except InferdError as e:
                log.error("pinned model %s failed to load: %s", name, e.message,
                          extra={"MODEL": name})
                failed.append(name)
        return failed

    def reload(self, config: Any) -> dict[str, list[str]]:
        """Take a new configuration and re-read the repository, failing no request
        (see :func:`inferd.daemon.reload.reload_catalog`). Returns what changed."""
        with self._reload_lock:
            return reload_catalog(self, config)

    # Used by reload_catalog: each step keeps every request answered.

    def refresh_keep_alives(self) -> None:
        """Give loaded models the keep-alive now in force (config or model.toml)."""
        for e in self._all_entries():  # keep_alive may have changed in config or model.toml
            spec = self.catalog.get(e.name)
            keep_alive = self.catalog.settings(spec).keep_alive if spec and not spec.error \
                else None
            with e.lock:
                if keep_alive is not None and e.state is State.READY:
                    e.keep_alive = keep_alive

    def version_state(self, name: str, version: int) -> State:
        e = self._entries.get((name, version))
        return e.state if e is not None else State.UNLOADED

    def retire_stale(self) -> None:
        """Retire every loaded version its model no longer offers."""
        with self._lock:
            stale = [k for k in self._entries if self.catalog.knows(k[0])
                     and not self.catalog.servable(*k)]
        for name, version in stale:
            self.unload(name, version, reason="version no longer offered by the repository")

    def load_after(self, name: str, version: int, first: Any) -> ModelEntry:
        """Mark ``version`` loading (requests for it wait in its queue), run ``first()``,
        then load it on this thread.

        Raises:
            InferdError: the load failed (its queued requests got the reason).
        """
        entry = self.entry(name, version)
        future: Future[ModelEntry] = Future()
        with entry.lock:
            entry.load_future = future
            entry.set_state(State.LOADING)
        first()
        try:
            future.set_result(self._loader.run(entry))
        except InferdError as e:
            future.set_exception(e)
            raise
        return entry

    def stop(self, timeout: float) -> bool:
        """Finish queued work and unload every model; True if all threads ended."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            left = max(0.1, deadline - time.monotonic())
            self._unload_wait(entry, "daemon stopping", left)
        ok = not any(t.is_alive() for w in self.left_running for t in w.threads)
        self._loader.pool.shutdown(wait=False, cancel_futures=True)
        if self._idle_thread is not None:
            self._idle_thread.join(max(0.1, deadline - time.monotonic()))
        return ok

    # ----------------------------------------------------------------- state

    def describe(self) -> list[dict[str, Any]]:
        """Every model the repository offers, and every version in memory, with state."""
        with self._lock:
            entries = dict(self._entries)
        rows = describe_cache(self.catalog.snapshot(), entries, self._pinned,
                              self.catalog.settings)
        for info in rows:
            self.ledger.describe(info)
        return rows

    def _enforce_budget(self) -> None:
        """Evict idle models after a model's working memory grew (loader thread)."""
        try:
            self.budget.enforce()
        except InferdError as e:
            log.warning("cache is over its budget and cannot evict more: %s", e.message)

    def cache_status(self) -> dict[str, Any]:
        """Budget and use, for the status op."""
        with self._lock:
            entries = list(self._entries.values())
        return {"max_memory_bytes": self.config.cache.max_memory,
                "used_bytes": sum(e.cost() for e in entries),
                "loads": sum(e.loads for e in entries)}

    def loaded(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries.values() if e.state is State.READY]

    def dead_worker_threads(self) -> list[str]:
        """Names of worker threads of ready models that have ended (the watchdog's
        probe): the threads themselves are asked, so two versions of a model whose
        threads share a name cannot hide each other."""
        with self._lock:
            entries = list(self._entries.values())
        return [t.name for e in entries if e.state is State.READY and e.workers
                for t in e.workers.threads if not t.is_alive()]
