"""Loading one model version: make room in the budget, choose the backend, load (through
the custom-op planner), warm up, measure, build its worker threads, and either make the
entry READY or FAILED (answering what waited in its queue with the reason).

:meth:`ModelLoader.start` begins a load on the loader threads (``inferd-loader``);
:meth:`ModelLoader.load` does the work and returns one :class:`Loaded` result with
everything the model's workers need. Loads run one at a time (``_lock``), so a
resident-memory delta is the load's own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from inferd.daemon.budget import MemoryBudget, estimate_cost, format_bytes, model_cost
from inferd.daemon.catalog import Catalog, Settings
from inferd.daemon.memory import WorkingLedger
from inferd.daemon.model_entry import ModelEntry, State
from inferd.daemon.pipeline import PipelineSpec, parse_spec, unpin_current_thread
from inferd.daemon.placement import backend_options, place
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.warmup import warm_up
from inferd.daemon.worker import Workers
from inferd.ipc.errors import ErrorCode, Failure, InferdError, ModelError, failure
from inferd.ipc.protocol import Reply
from inferd.ipc.replies import ReplySink
from inferd.libbackends.contract import DeviceKind, LoadedModel, LoadOptions
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.plan import load_planned, plan_note
from inferd.libbackends.registry import Choice, Registry

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """A loaded, warmed-up and measured model version, ready for its workers."""

    model: LoadedModel
    backend: str
    settings: Settings
    pipeline: PipelineSpec


class ModelLoader:
    """Loads model versions for the cache.

    Args:
        catalog: what the repository offers, and each model's settings.
        registry: the backends to choose from.
        budget: the cache's memory budget.
        config: returns the daemon configuration now (``[onnxruntime]``, ``[cache]``).
        sink: where replies go (the workers', and those of requests a failed load
            leaves queued).
        on_done: called by the workers after each request: (entry, succeeded).
    """

    def __init__(self, catalog: Catalog, registry: Registry, budget: MemoryBudget,
                 config: Callable[[], Any], sink: ReplySink,
                 on_done: Callable[[ModelEntry, bool], None]) -> None:
        self.catalog = catalog
        self.registry = registry
        self.budget = budget
        self._config = config
        self._sink = sink
        self._on_done = on_done
        self._lock = threading.Lock()  # one load at a time: its RSS delta is its own
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inferd-loader",
                                       initializer=unpin_current_thread)
        self.processors: ProcessorRegistry | None = None  # set by the runtime
        self.customops: OpRegistry | None = None  # set by the runtime
        self.ledger: WorkingLedger | None = None  # working memory (daemon/memory.py)
        self.observer: Any = None  # metrics hooks (daemon/metrics.py), set by the runtime

    def start(self, entry: ModelEntry) -> Future[ModelEntry]:
        """Begin loading on a loader thread (caller holds entry.lock, saw UNLOADED)."""
        entry.set_state(State.LOADING)
        entry.error = None
        entry.load_future = self.pool.submit(self.run, entry)
        return entry.load_future

    def run(self, entry: ModelEntry) -> ModelEntry:
        """Load ``entry`` (state LOADING) and make it READY with its workers running.

        Raises:
            InferdError: the load failed; the entry is FAILED and what waited in its
                queue got the reason.
        """
        started = time.monotonic()
        try:
            loaded = self.load(entry)
        except Exception as e:
            code, message = failure(e, f"model {entry.label}: unexpected error while "
                                    f"loading", log, named=False, model=entry.name)
            log.error("model %s failed to load: %s", entry.label, message,
                      extra={"MODEL": entry.name, "CODE": str(code)})
            self._fail(entry, code, message)
            if self.observer is not None:
                self.observer.loaded(entry.name, time.monotonic() - started, False)
            raise InferdError(message, code) from e
        # The one place a model's worker threads are built (daemon/worker.py).
        workers = Workers(entry.name, loaded.model, entry.queue, self._sink,
                          loaded.settings.instances,
                          on_done=lambda ok: self._on_done(entry, ok),
                          spec=loaded.pipeline, backend=loaded.backend,
                          observe=self.observer.for_model(entry.name)
                          if self.observer is not None else None)
        with entry.lock:
            entry.model, entry.workers, entry.backend = loaded.model, workers, loaded.backend
            entry.keep_alive = loaded.settings.keep_alive
            entry.touch(request=False)
            entry.set_state(State.READY)
        workers.start()
        if self.observer is not None:
            self.observer.loaded(entry.name, time.monotonic() - started, True)
        where = entry.placement
        log.info("model %s loaded on %s, device %s, in %.0f ms, %s%s; chosen: %s",
                 entry.label, loaded.backend, where and where.device,
                 (time.monotonic() - started) * 1000, format_bytes(entry.memory_bytes),
                 plan_note(loaded.model), where and where.why,
                 extra={"MODEL": entry.name, "BACKEND": loaded.backend,
                        "DEVICE": where and where.device})
        return entry

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

    def load(self, entry: ModelEntry) -> Loaded:
        """Make room, load, warm up and measure ``entry``'s version.

        Raises:
            InferdError: anything that stops it (the model is unloaded again first).
        """
        with self._lock:
            return self._load(entry)

    def _load(self, entry: ModelEntry) -> Loaded:
        key = (entry.name, entry.version)
        spec = self.catalog.get(entry.name)
        if spec is None or entry.version not in spec.versions:
            raise ModelError(f"model {entry.label} is no longer in the repository",
                             ErrorCode.NOT_FOUND)
        if spec.error:
            raise ModelError(spec.error, ErrorCode.INTERNAL)
        settings = self.catalog.settings(spec)
        # model.toml's steps (daemon/pipeline.py): a bad one fails the load here, before
        # anything is loaded
        pipeline = parse_spec(entry.name, spec.settings, self.processors,
                              self.catalog.model_path)
        repo = self.catalog.repo
        source = repo.resolve(entry.name, entry.version)
        plan = self.registry.plan(entry.name, source.path, settings.backends)
        known = self.budget.measured(key)
        if known:
            need = known
            self.budget.make_room(entry, need, "measured at its last load")
        else:
            # Only a guess: if it does not fit, room for the file itself will do; the
            # measured cost is checked against the budget once loaded.
            size = source.path.stat().st_size
            need = self.budget.make_room(entry, estimate_cost(size), "estimated from its "
                                         "file size", floor=size)
        with entry.lock:
            entry.reserved = need
            entry.loads += 1
        config = self._config()
        meter = self.budget.meter
        meter.trim()
        before = meter.rss()
        # The first entry of the plan that loads (daemon/placement.py); custom ops and
        # nodes the backend lacks make a partitioned plan (libbackends/customops).
        fallbacks = self.registry.available()
        # a fallback backend's sub-graphs get the same options it would get as the
        # model's own backend: its config section under its model.toml table
        tables = {b.id: backend_options(config, spec.settings, b.id) for b in fallbacks}

        def load_on(choice: Choice, options: LoadOptions) -> LoadedModel:
            return load_planned(choice.backend, source.path, options, model=entry.label,
                                model_dir=repo.root / entry.name, ops=self.customops,
                                fallbacks=fallbacks, tables=tables,
                                probe_timeout_s=config.backends.probe_timeout_s)
        placement, model = place(entry.name, plan, spec.settings, config, load_on)
        entry.placement = placement
        try:
            warm_up(entry.label, model, source.path, spec.settings, config.cache.warmup_dim)
            rss = meter.rss() - before
            reported = model.memory_bytes()
            cost = model_cost(rss, reported, placement.kind is not DeviceKind.CPU)
            if self.ledger is not None:  # plus the working memory measured so far
                cost, model = self.ledger.loaded(entry, cost, model)
            self.budget.record(key, cost)
            with entry.lock:
                entry.reserved = cost
                entry.memory_bytes, entry.memory_rss_bytes = cost, rss
                entry.memory_reported_bytes = reported
            self.budget.make_room(entry, cost, "measured")
        except BaseException:
            model.unload()
            meter.trim()
            raise
        return Loaded(model, placement.backend, settings, pipeline)
