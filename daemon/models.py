"""The model manager: the warm model cache. One entry per (model, version) with its state,
its bounded queue and its workers; a catalog of what the repository offers.

- A request for a model that is not loaded starts the load (once, however many requests
  wait: single flight) and waits in the model's queue; the workers start when it is done.
- Before a load, and again once its memory is measured, the cache budget is enforced:
  idle unpinned models are unloaded least recently used first; a model with a request
  queued or running is never pulled from under it. If nothing can make room, the load
  fails with RESOURCE_EXHAUSTED naming what it needs and what is pinned or busy.
- A failed load is remembered for ``cache.failed_load_hold_s``: requests meanwhile get
  its reason at once instead of retrying it.
- Idle models are unloaded after their keep-alive (config, model.toml, or a request's
  ``keep_alive``), unless pinned (``models.preload`` or model.toml ``pin = true``).
- :meth:`ModelManager.reload` re-reads the repository: new models appear, removed ones
  are drained, a new default version is loaded beside the old one and swapped in when
  ready. Requests that reach a retired version are handed to the one that replaced it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from inferd.daemon.cache import (
    Evictable, MemoryMeter, choose_victims, estimate_cost, format_bytes, model_cost,
    parse_duration, request_keep_alive,
)
from inferd.daemon.model_entry import ModelKey, ModelEntry, Settings, State
from inferd.daemon.pipeline import PipelineSpec, parse_spec, unpin_current_thread
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.reload import reload_catalog
from inferd.daemon.repository import ModelSpec, Repository, check_name
from inferd.daemon.warmup import warm_up
from inferd.daemon.worker import WorkItem, Workers
from inferd.ipc.errors import ErrorCode, Failure, InferdError, ModelError, failure
from inferd.ipc.protocol import Reply, Request
from inferd.ipc.replies import AnyTicket, ReplySink
from inferd.libbackends.contract import DeviceKind, LoadedModel, LoadOptions
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.plan import load_planned, plan_note
from inferd.libbackends.registry import Registry

log = logging.getLogger(__name__)


class ModelManager:
    """The model cache of one runtime.

    Args:
        repo: the model repository.
        registry: backends to choose from.
        config: the daemon configuration (read again on each use; see :meth:`reload`).
        sink: where the workers' replies go (any thread).
    """

    def __init__(self, repo: Repository, registry: Registry, config: Any,
                 sink: ReplySink) -> None:
        self.repo = repo
        self.registry = registry
        self.config = config
        self._sink = sink
        self._catalog: dict[str, ModelSpec] = repo.scan()
        self._entries: dict[ModelKey, ModelEntry] = {}
        self._lock = threading.Lock()  # the catalog and the entries dict
        self._load_lock = threading.Lock()  # one load at a time: its RSS delta is its own
        self._reload_lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inferd-loader",
                                          initializer=unpin_current_thread)
        self._meter = MemoryMeter()
        self._measured: dict[ModelKey, int] = {}
        self._held: set[ModelKey] = set()
        self._stopping = threading.Event()
        self.left_running: list[Workers] = []  # workers a drain gave up on (still alive)
        self._idle_thread: threading.Thread | None = None
        self.processors: ProcessorRegistry | None = None  # set by the runtime
        self.customops: OpRegistry | None = None  # set by the runtime
        self._pipelines: dict[ModelKey, PipelineSpec] = {}  # built by a load, used by its workers

    def start(self) -> None:
        """Start the idle-unload thread (``inferd-cache-idle``)."""
        self._idle_thread = threading.Thread(target=self._idle_loop, name="inferd-cache-idle",
                                             daemon=True)
        self._idle_thread.start()

    # ----------------------------------------------------------------- lookup

    def _spec(self, name: str) -> ModelSpec:
        check_name(name)
        spec = self._catalog.get(name)
        if spec is None:
            raise ModelError(f"model {name!r} not found in {self.repo.root}; available: "
                             f"{', '.join(sorted(self._catalog)) or 'none'}",
                             ErrorCode.NOT_FOUND)
        if spec.error:
            raise ModelError(spec.error, ErrorCode.INTERNAL)
        return spec

    def _settings(self, spec: ModelSpec) -> Settings:
        raw, cfg = spec.settings, self.config
        backends = raw.get("backends")
        if backends is not None and not (isinstance(backends, list)
                                         and all(isinstance(b, str) for b in backends)):
            raise ModelError(f"model {spec.name}: model.toml 'backends' must be a list of "
                             f"backend ids or kinds", ErrorCode.INTERNAL)
        keep_alive = cfg.cache.keep_alive
        if "keep_alive" in raw:
            try:
                keep_alive = parse_duration(raw["keep_alive"])
            except ValueError:
                raise ModelError(f"model {spec.name}: model.toml keep_alive = "
                                 f"{raw['keep_alive']!r}: expected a duration such as 30, "
                                 f"'5m' or 'forever'", ErrorCode.INTERNAL) from None
        return Settings(instances=int(raw.get("instances", cfg.models.instances)),
                        queue_size=int(raw.get("queue_size", cfg.models.queue_size)),
                        backends=backends, keep_alive=keep_alive)

    def entry(self, name: str, version: int | None = None) -> ModelEntry:
        """The entry for ``name`` at ``version`` (default: the version it serves by
        default), created on first use.

        Raises:
            ModelError: invalid name (INVALID_ARGUMENT), unknown model or version
                (NOT_FOUND, listing what exists), unusable model.toml (INTERNAL).
        """
        spec = self._spec(name)
        if version is None:
            version = spec.default
        elif version not in spec.versions:
            raise ModelError(f"model {name!r} has no version {version}; available: "
                             f"{', '.join(map(str, spec.versions))}", ErrorCode.NOT_FOUND)
        with self._lock:
            entry = self._entries.get((name, version))
            if entry is None:
                entry = ModelEntry(name, version, self._settings(spec).queue_size)
                self._entries[(name, version)] = entry
        return entry

    def _pinned(self, entry: ModelEntry) -> bool:
        spec = self._catalog.get(entry.name)
        return (spec is not None and spec.default == entry.version
                and (spec.settings.get("pin") is True
                     or entry.name in self.config.models.preload))

    def _servable(self, entry: ModelEntry) -> bool:
        spec = self._catalog.get(entry.name)
        return spec is not None and entry.version in spec.versions

    def pinned_names(self) -> list[str]:
        """Models to keep loaded: ``models.preload`` first, then model.toml pins."""
        names = list(self.config.models.preload)
        names += [n for n, s in sorted(self._catalog.items())
                  if s.settings.get("pin") is True and n not in names]
        return names

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
            if entry.queue.qsize() >= entry.queue_size:
                raise InferdError(f"model {entry.label}: queue is full "
                                  f"({entry.queue_size} requests waiting)",
                                  ErrorCode.RESOURCE_EXHAUSTED)
            entry.in_flight += 1
            entry.touch(keep_alive)
            if entry.state is State.UNLOADED:
                self._start_load(entry)
            # DRAINING: the request waits in the queue; the drain restarts the load.
            # Last: the put wakes a worker, which then waits for this thread's GIL.
            entry.queue.put(item)

    def _done(self, entry: ModelEntry, ok: bool) -> None:
        with entry.lock:
            entry.in_flight -= 1
            if ok:
                entry.served += 1
            else:
                entry.failed_requests += 1
            entry.touch()

    # ----------------------------------------------------------------- loading

    def _start_load(self, entry: ModelEntry) -> Future[ModelEntry]:
        """Begin loading (caller holds entry.lock and saw UNLOADED)."""
        entry.set_state(State.LOADING)
        entry.error = None
        entry.load_future = self._loader.submit(self._load, entry)
        return entry.load_future

    def _load(self, entry: ModelEntry) -> ModelEntry:
        started = time.monotonic()
        try:
            with self._load_lock:
                settings, backend_id, model = self._load_measured(entry)
        except Exception as e:
            code, message = failure(e, f"model {entry.label}: unexpected error while "
                                    f"loading", log, named=False, model=entry.name)
            log.error("model %s failed to load: %s", entry.label, message,
                      extra={"MODEL": entry.name, "CODE": str(code)})
            self._fail(entry, code, message)
            raise InferdError(message, code) from e
        workers = self._start_workers(entry, model, settings, backend_id)
        with entry.lock:
            entry.model, entry.workers, entry.backend = model, workers, backend_id
            entry.keep_alive = settings.keep_alive
            entry.touch(request=False)
            entry.set_state(State.READY)
        workers.start()
        log.info("model %s loaded on %s in %.0f ms, %s%s", entry.label, backend_id,
                 (time.monotonic() - started) * 1000, format_bytes(entry.memory_bytes),
                 plan_note(model),
                 extra={"MODEL": entry.name, "BACKEND": backend_id})
        return entry

    def _start_workers(self, entry: ModelEntry, model: LoadedModel,
                       settings: Settings, backend_id: str) -> Workers:
        # The one place workers are built: pre/infer/post stages (daemon/worker.py).
        pipeline = self._pipelines.pop((entry.name, entry.version), None)
        return Workers(entry.name, model, entry.queue, self._sink, settings.instances,
                       on_done=lambda ok: self._done(entry, ok), spec=pipeline,
                       backend=backend_id)

    def _load_measured(self, entry: ModelEntry) -> tuple[Settings, str, LoadedModel]:
        """Make room, load, warm up and measure (caller holds ``_load_lock``)."""
        key = (entry.name, entry.version)
        spec = self._catalog.get(entry.name)
        if spec is None or entry.version not in spec.versions:
            raise ModelError(f"model {entry.label} is no longer in the repository",
                             ErrorCode.NOT_FOUND)
        if spec.error:
            raise ModelError(spec.error, ErrorCode.INTERNAL)
        settings = self._settings(spec)
        # model.toml's stages, batching and pinning (daemon/pipeline.py): a bad one fails
        # the load here, before anything is loaded
        self._pipelines[key] = parse_spec(entry.name, spec.settings, self.processors,
                                          lambda other: self.repo.resolve(other).path)
        source = self.repo.resolve(entry.name, entry.version)
        backend = self.registry.choose(entry.name, source.path, settings.backends)
        known = self._measured.get(key)
        if known:
            need = known
            self._make_room(entry, need, "measured at its last load")
        else:
            # Only a guess: if it does not fit, room for the file itself will do; the
            # measured cost is checked against the budget once loaded.
            size = source.path.stat().st_size
            need = self._make_room(entry, estimate_cost(size), "estimated from its file "
                                   "size", floor=size)
        with entry.lock:
            entry.reserved = need
            entry.loads += 1
        ort = self.config.onnxruntime
        self._meter.trim()
        before = self._meter.rss()
        options = spec.settings.get(backend.id, {})
        if not isinstance(options, dict):
            raise ModelError(f"model {entry.name}: model.toml '{backend.id}' must be a table "
                             f"([{backend.id}]) of settings for that backend",
                             ErrorCode.INTERNAL)
        # Custom ops and nodes the backend lacks: a partitioned plan (libbackends/customops)
        model = load_planned(backend, source.path, LoadOptions(
            ort.intra_op_threads, ort.inter_op_threads, ort.allow_spinning, dict(options)),
            model=entry.label, model_dir=self.repo.root / entry.name, ops=self.customops,
            fallbacks=self.registry.available(), tables=spec.settings,
            probe_timeout_s=self.config.backends.probe_timeout_s)
        try:
            warm_up(entry.label, model, source.path, spec.settings,
                    self.config.cache.warmup_dim)
            rss = self._meter.rss() - before
            reported = model.memory_bytes()
            cost = model_cost(rss, reported, backend.kind is not DeviceKind.CPU)
            self._measured[key] = cost
            with entry.lock:
                entry.reserved = cost
                entry.memory_bytes, entry.memory_rss_bytes = cost, rss
                entry.memory_reported_bytes = reported
            self._make_room(entry, cost, "measured")
        except BaseException:
            model.unload()
            self._meter.trim()
            raise
        return settings, backend.id, model

    def _fail(self, entry: ModelEntry, code: ErrorCode, message: str) -> None:
        with entry.lock:
            entry.error, entry.error_code = message, code
            entry.failed_at = time.monotonic()
            entry.memory_bytes = entry.memory_rss_bytes = entry.memory_reported_bytes = None
            entry.reserved = 0
            waiting = entry.take_queued()
            entry.set_state(State.FAILED)
        for item in waiting:
            self._sink.send(item.ticket, Reply(item.request.id, error=Failure(
                code, f"model {entry.label} failed to load: {message}")))

    # ----------------------------------------------------------------- budget

    def _evictable(self, entry: ModelEntry) -> bool:
        return (entry.state is State.READY and not entry.in_flight
                and not self._pinned(entry) and (entry.name, entry.version) not in self._held)

    @contextmanager
    def hold(self, name: str, version: int) -> Iterator[None]:
        """Keep ``version`` from eviction while the block runs (the old version during
        a swap: loading the new one must not push out the one still serving)."""
        self._held.add((name, version))
        try:
            yield
        finally:
            self._held.discard((name, version))

    def _make_room(self, entry: ModelEntry, need: int, how: str,
                   floor: int | None = None) -> int:
        """Unload idle unpinned models, least recently used first, until ``need`` more
        bytes fit in the budget beside every other entry (or, failing that, ``floor``).

        Returns:
            The bytes made room for: ``need``, or ``floor``.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): nothing evictable makes enough room.
        """
        budget = self.config.cache.max_memory
        if budget is None:
            return need
        wanted = need
        while True:
            with self._lock:
                others = [e for e in self._entries.values() if e is not entry]
            used = sum(e.cost() for e in others)
            if used + need <= budget:
                return need
            candidates = [Evictable(e, e.cost(), e.used_at) for e in others
                          if self._evictable(e)]
            victims = choose_victims(candidates, used + need - budget)
            if victims is None and floor is not None and floor < need:
                need = floor
                continue
            if victims is None:
                raise InferdError(self._no_room(entry, wanted, how, budget, used, others),
                                  ErrorCode.RESOURCE_EXHAUSTED)
            for v in victims:
                self._unload_entry(v.key, f"evicted to make room for {entry.label}",
                                   only_if_idle=True)

    def _no_room(self, entry: ModelEntry, need: int, how: str, budget: int, used: int,
                 others: list[ModelEntry]) -> str:
        def names(entries: list[ModelEntry]) -> str:
            return ", ".join(f"{e.label} ({format_bytes(e.cost())})" for e in entries) \
                or "none"
        holding = [e for e in others if e.cost()]
        pinned = [e for e in holding if self._pinned(e)]
        busy = [e for e in holding if e not in pinned and not self._evictable(e)]
        return (f"model {entry.label} needs {format_bytes(need)} ({how}) but the cache "
                f"budget is {format_bytes(budget)} with {format_bytes(used)} in use; "
                f"pinned: {names(pinned)}; busy, loading or being replaced: "
                f"{names(busy)}")

    def enforce_budget(self) -> None:
        """Evict idle unpinned models until the loaded ones fit the budget (after the
        budget shrank); logs what does not fit."""
        try:
            self._make_room(_NOBODY, 0, "")
        except InferdError as e:
            log.warning("cache is over its budget and cannot evict more: %s", e.message)

    # ----------------------------------------------------------------- unloading

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
            if only_if_idle and not self._evictable(entry):
                return False
            entry.set_state(State.DRAINING)
            workers, model = entry.workers, entry.model
        assert workers is not None and model is not None
        finished = workers.stop(timeout)
        if finished:
            model.unload()
            self._meter.trim()
        else:
            log.error("model %s: workers did not finish within %.3g s; left running",
                      entry.label, timeout, extra={"MODEL": entry.name})
            self.left_running.append(workers)
        leftovers: list[WorkItem] = []
        with entry.lock:
            entry.model = entry.workers = entry.backend = None
            entry.memory_bytes = entry.memory_rss_bytes = entry.memory_reported_bytes = None
            entry.set_state(State.UNLOADED)
            if finished and not entry.queue.empty():
                if self._servable(entry) and not self._stopping.is_set():
                    self._start_load(entry)
                else:
                    leftovers = entry.take_queued()
        log.info("model %s unloaded: %s", entry.label, reason, extra={"MODEL": entry.name})
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
                future = self._start_load(entry)
            elif entry.state is State.LOADING:
                future = entry.load_future
            else:
                future = None
        if future is not None:
            future.result()
        return entry

    def unload(self, name: str, version: int | None = None,
               timeout: float | None = None) -> ModelEntry:
        """Drain and unload ``name`` (every loaded version, or just ``version``): queued
        requests finish first; blocking. Returns the default version's entry."""
        check_name(name)
        with self._lock:
            entries = [e for (n, v), e in self._entries.items()
                       if n == name and (version is None or v == version)]
        if not entries:
            return self.entry(name, version)  # NOT_FOUND if unknown, else unloaded
        for entry in entries:
            self._unload_wait(entry, "unload requested", timeout)
        spec = self._catalog.get(name)
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

    def load_pinned(self, before_each: Callable[[int, int, str], None] | None = None
                    ) -> list[str]:
        """Load every pinned model not loaded yet; the names that failed (logged).

        Args:
            before_each: called with (position from 1, count, name) before each load
                (the runtime tells systemd the preload is progressing).
        """
        failed = []
        names = self.pinned_names()
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

    def use_config(self, config: Any) -> dict[str, ModelSpec]:
        """Adopt ``config`` (its repository too); the repository's models as of now."""
        self.config = config
        root = Path(config.models.repository).resolve()
        if root != self.repo.root:
            self.repo = Repository(root)
        return self.repo.scan()

    def knows(self, name: str | None) -> bool:
        """Whether ``name`` is a model of the repository catalog (a dict lookup: used on
        the I/O thread for every infer request, so no filesystem access)."""
        return name in self._catalog

    @property
    def catalog(self) -> dict[str, ModelSpec]:
        return dict(self._catalog)

    def install(self, specs: dict[str, ModelSpec]) -> None:
        """Offer ``specs`` (by name, over what was offered); refresh the keep-alives of
        loaded models from the settings now in force."""
        with self._lock:
            self._catalog.update(specs)
            entries = list(self._entries.values())
        for e in entries:  # keep_alive may have changed in the config or a model.toml
            spec = self._catalog.get(e.name)
            try:
                keep_alive = self._settings(spec).keep_alive if spec and not spec.error \
                    else None
            except ModelError:
                keep_alive = None
            with e.lock:
                if keep_alive is not None and e.state is State.READY:
                    e.keep_alive = keep_alive

    def forget(self, names: list[str]) -> None:
        """Stop offering ``names``: new requests for them get NOT_FOUND."""
        with self._lock:
            for name in names:
                self._catalog.pop(name, None)

    def version_state(self, name: str, version: int) -> State:
        e = self._entries.get((name, version))
        return e.state if e is not None else State.UNLOADED

    def retire(self, name: str, version: int | None, reason: str) -> None:
        """Drain and unload ``name`` (one version or all) and forget entries no longer
        offered."""
        with self._lock:
            entries = [e for (n, v), e in self._entries.items()
                       if n == name and (version is None or v == version)]
        for e in entries:
            self._unload_wait(e, reason, None)
            with self._lock:
                if not self._servable(e) and e.state is State.UNLOADED:
                    self._entries.pop((e.name, e.version), None)

    def retire_stale(self) -> None:
        """Retire every loaded version its model no longer offers."""
        with self._lock:
            stale = [k for k in self._entries
                     if k[0] in self._catalog and k[1] not in self._catalog[k[0]].versions]
        for name, version in stale:
            self.retire(name, version, "version no longer offered by the repository")

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
            future.set_result(self._load(entry))
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
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self._idle_thread is not None:
            self._idle_thread.join(max(0.1, deadline - time.monotonic()))
        return ok

    # ----------------------------------------------------------------- state

    def describe(self) -> list[dict[str, Any]]:
        """Every model the repository offers, and every version in memory, with state."""
        with self._lock:
            catalog, entries = dict(self._catalog), dict(self._entries)
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
                    info["pinned"] = self._pinned(e)
                if spec is None:
                    info["error"] = info["error"] or "removed from the repository"
                elif spec.error:
                    info.update(state=str(State.FAILED), error=spec.error)
                if e.state is State.UNLOADED and spec and not spec.error:
                    try:
                        keep = self._settings(spec).keep_alive
                        info["keep_alive_s"] = None if math.isinf(keep) else keep
                    except ModelError as err:
                        info["error"] = err.message
                info["versions"] = list(spec.versions) if spec else []
                info["default"] = bool(spec and spec.default == e.version)
                out.append(info)
        return out

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


_NOBODY = ModelEntry("-", 0, 1)
"""Stands for "no model" when only the budget itself is checked."""
