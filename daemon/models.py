"""The model manager: one entry per model name, its state, its queue and its workers.

A request for a model that is not loaded starts the load (once, however many requests
wait) and waits in the model's bounded queue; the workers start when the load finishes.
A failed load answers everything queued with its reason and is remembered for a short
time, so a storm of requests does not retry it each time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import psutil

from inferd.daemon.repository import Repository, check_name
from inferd.daemon.worker import STOP, ReplyFn, WorkItem, Workers, error_for
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.protocol import Request
from inferd.ipc.server import Ticket
from inferd.libbackends.contract import LoadedModel, LoadOptions
from inferd.libbackends.registry import Registry

log = logging.getLogger(__name__)

FAILED_LOAD_MEMORY_S = 5.0


class State(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


@dataclass
class Settings:
    """Per-model settings: config defaults overridden by the model's model.toml."""

    instances: int
    queue_size: int
    backends: list[str] | None


class ModelEntry:
    """State of one model name. Guarded by ``lock``; the queue is thread-safe."""

    def __init__(self, name: str, queue_size: int) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.state = State.UNLOADED
        self.queue: queue.Queue[WorkItem | None] = queue.Queue(queue_size)
        self.version: int | None = None
        self.backend: str | None = None
        self.model: LoadedModel | None = None
        self.workers: Workers | None = None
        self.error: str | None = None
        self.error_code: ErrorCode = ErrorCode.INTERNAL
        self.failed_at = 0.0
        self.memory_bytes: int | None = None
        self.load_future: Future[ModelEntry] | None = None
        self.served = 0
        self.failed_requests = 0
        self.last_used: float | None = None

    def describe(self) -> dict[str, Any]:
        m = self.model
        return {
            "name": self.name, "state": str(self.state), "version": self.version,
            "backend": self.backend, "error": self.error,
            "inputs": [s.to_json() for s in m.inputs] if m else [],
            "outputs": [s.to_json() for s in m.outputs] if m else [],
            "memory_bytes": self.memory_bytes, "requests": self.served,
            "failed_requests": self.failed_requests,
            "queued": self.queue.qsize(), "last_used": self.last_used,
            "threads": [t.name for t in self.workers.threads] if self.workers else [],
        }


class ModelManager:
    """All model entries of one runtime.

    Args:
        repo: the model repository.
        registry: backends to choose from.
        config: the daemon configuration.
        reply: sends a reply for a ticket from any thread.
        release_thread: called by worker threads on exit.
    """

    def __init__(self, repo: Repository, registry: Registry, config: Any, reply: ReplyFn,
                 release_thread: Any) -> None:
        self.repo = repo
        self.registry = registry
        self.config = config
        self._reply = reply
        self._release = release_thread
        self._entries: dict[str, ModelEntry] = {}
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inferd-loader")
        self._proc = psutil.Process()

    # ----------------------------------------------------------------- lookup

    def _settings(self, name: str) -> Settings:
        raw = self.repo.settings(name)
        cfg = self.config.models
        backends = raw.get("backends")
        if backends is not None and not (isinstance(backends, list)
                                         and all(isinstance(b, str) for b in backends)):
            raise ModelError(f"model {name}: model.toml 'backends' must be a list of "
                             f"backend ids or kinds", ErrorCode.INTERNAL)
        return Settings(instances=int(raw.get("instances", cfg.instances)),
                        queue_size=int(raw.get("queue_size", cfg.queue_size)),
                        backends=backends)

    def entry(self, name: str) -> ModelEntry:
        """The entry for ``name``, created on first use if the repository has it.

        Raises:
            ModelError: invalid name (INVALID_ARGUMENT) or unknown model (NOT_FOUND).
        """
        check_name(name)
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        if not self.repo.versions(name):
            self.repo.resolve(name)  # raises NOT_FOUND listing what exists
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                entry = ModelEntry(name, self._settings(name).queue_size)
                self._entries[name] = entry
        return entry

    # ----------------------------------------------------------------- requests

    def submit(self, request: Request, ticket: Ticket) -> None:
        """Queue an infer request (I/O thread). Raises InferdError to refuse it."""
        if request.model is None:
            raise ModelError("infer needs 'model'")
        entry = self.entry(request.model)
        with entry.lock:
            if entry.state is State.FAILED:
                if time.monotonic() - entry.failed_at < FAILED_LOAD_MEMORY_S:
                    raise InferdError(f"model {entry.name} failed to load: {entry.error}",
                                      entry.error_code)
                entry.state = State.UNLOADED
            if entry.state is State.DRAINING:
                raise InferdError(f"model {entry.name} is being unloaded",
                                  ErrorCode.UNAVAILABLE)
            if (request.version is not None and entry.state is not State.UNLOADED
                    and entry.version != request.version):
                raise InferdError(f"model {entry.name}: version {entry.version} is loaded, "
                                  f"version {request.version} was asked for; unload it first",
                                  ErrorCode.UNAVAILABLE)
            try:
                entry.queue.put_nowait(WorkItem(request, ticket))
            except queue.Full:
                raise InferdError(f"model {entry.name}: queue is full "
                                  f"({entry.queue.maxsize} requests waiting)",
                                  ErrorCode.RESOURCE_EXHAUSTED) from None
            entry.last_used = time.time()
            if entry.state is State.UNLOADED:
                self._start_load(entry, request.version)

    def _start_load(self, entry: ModelEntry, version: int | None) -> Future[ModelEntry]:
        """Begin loading (caller holds entry.lock and saw UNLOADED)."""
        entry.state = State.LOADING
        entry.error = None
        entry.load_future = self._loader.submit(self._load, entry, version)
        return entry.load_future

    def _load(self, entry: ModelEntry, version: int | None) -> ModelEntry:
        name = entry.name
        started = time.monotonic()
        try:
            source = self.repo.resolve(name, version)
            settings = self._settings(name)
            backend = self.registry.choose(name, source.path, settings.backends)
            ort = self.config.onnxruntime
            rss_before = self._proc.memory_info().rss
            model = backend.load(source.path, LoadOptions(ort.intra_op_threads,
                                                          ort.inter_op_threads))
            rss = self._proc.memory_info().rss - rss_before
        except Exception as e:
            code = e.code if isinstance(e, InferdError) else ErrorCode.INTERNAL
            message = e.message if isinstance(e, InferdError) else f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", name, message, extra={"MODEL": name})
            with entry.lock:
                entry.state = State.FAILED
                entry.error, entry.error_code = message, code
                entry.failed_at = time.monotonic()
                waiting = _drain(entry.queue)
            for item in waiting:
                self._reply(item.ticket, error_for(
                    item, code, f"model {name} failed to load: {message}"))
            raise
        reported = model.memory_bytes()
        workers = Workers(name, model, entry.queue, self._reply, self._release,
                          settings.instances, on_done=lambda ok: _count(entry, ok))
        with entry.lock:
            entry.model, entry.workers = model, workers
            entry.version, entry.backend = source.version, backend.id
            entry.memory_bytes = reported if reported is not None else max(rss, 0)
            entry.state = State.READY
        workers.start()
        log.info("model %s version %s loaded on %s in %.0f ms", name, source.version,
                 backend.id, (time.monotonic() - started) * 1000,
                 extra={"MODEL": name, "BACKEND": backend.id})
        return entry

    # ----------------------------------------------------------------- control

    def load(self, name: str, version: int | None = None) -> ModelEntry:
        """Load ``name`` (or wait for the load in progress); blocking.

        Raises:
            InferdError: the load failed, with its code and reason.
        """
        entry = self.entry(name)
        with entry.lock:
            if entry.state is State.FAILED:
                entry.state = State.UNLOADED
            if entry.state is State.DRAINING:
                raise InferdError(f"model {name} is being unloaded", ErrorCode.UNAVAILABLE)
            if entry.state is State.UNLOADED:
                future = self._start_load(entry, version)
            else:
                future = entry.load_future
        if future is not None:
            future.result()
        return entry

    def unload(self, name: str, timeout: float | None = None) -> ModelEntry:
        """Drain and unload ``name``: queued requests finish first; blocking."""
        entry = self.entry(name)
        with entry.lock:
            if entry.state is State.LOADING:
                future = entry.load_future
            else:
                future = None
        if future is not None:
            try:
                future.result()
            except InferdError:
                pass  # the failed load already answered its requests
        with entry.lock:
            if entry.state is not State.READY:
                if entry.state is State.FAILED:
                    entry.state = State.UNLOADED
                return entry
            entry.state = State.DRAINING
            workers, model = entry.workers, entry.model
        assert workers is not None and model is not None
        finished = workers.stop(timeout)
        if finished:
            model.unload()
        else:
            log.error("model %s: workers did not finish within %s s; left running", name,
                      timeout, extra={"MODEL": name})
        with entry.lock:
            entry.state = State.UNLOADED
            entry.model = entry.workers = None
            entry.memory_bytes = None
        log.info("model %s unloaded", name, extra={"MODEL": name})
        return entry

    def stop(self, timeout: float) -> bool:
        """Finish queued work and unload every model; True if all threads ended."""
        deadline = time.monotonic() + timeout
        ok = True
        for name in list(self._entries):
            left = max(0.1, deadline - time.monotonic())
            entry = self.unload(name, left)
            ok = ok and entry.workers is None
        self._loader.shutdown(wait=False, cancel_futures=True)
        return ok

    def describe(self) -> list[dict[str, Any]]:
        """Every model in the repository or in memory, with its state."""
        names = sorted(set(self.repo.names()) | set(self._entries))
        out = []
        for name in names:
            entry = self._entries.get(name)
            if entry is None:
                out.append({"name": name, "state": str(State.UNLOADED),
                            "versions": self.repo.versions(name)})
                continue
            with entry.lock:
                info = entry.describe()
            info["versions"] = self.repo.versions(name)
            out.append(info)
        return out

    def loaded(self) -> list[str]:
        return [n for n, e in self._entries.items() if e.state is State.READY]


def _count(entry: ModelEntry, ok: bool) -> None:
    # Counters are only written from worker threads of this entry; a lost increment
    # under several instances would skew a statistic, not a result.
    if ok:
        entry.served += 1
    else:
        entry.failed_requests += 1


def _drain(q: queue.Queue[WorkItem | None]) -> list[WorkItem]:
    items = []
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return items
        if item is not STOP:
            items.append(item)
