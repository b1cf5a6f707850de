"""The model manager: the warm model cache's entries, their queues and their workers.

One :class:`~inferd.daemon.model_entry.ModelEntry` per (model, version): its state
(unloaded -> loading -> ready -> draining -> unloaded, or failed; the entry's own
transitions), its bounded queue and its workers. The manager submits and queues
requests, starts loads and makes the entry READY (building its workers) or FAILED
(answering what waited), drains and unloads (on request, when idle past the keep-alive,
when the budget evicts, when a reload retires a version, at stop), and describes the
cache. What it delegates, one module each:

- :mod:`inferd.daemon.catalog`: what the repository offers (scan, pins, settings);
- :mod:`inferd.daemon.loading`: loading one version (backend, warm-up, measure): a
  result or an error, nothing else;
- :mod:`inferd.daemon.budget`: what each model counts, admission, the choice of victims;
- :mod:`inferd.daemon.memory`: measuring;
- :mod:`inferd.daemon.reload`: applying a reload through the public methods here.

Rules: a request for a model that is not loaded starts the load once (single flight)
and waits in the model's queue; a model with requests queued or running is never pulled
from under them; a failed load is remembered for ``cache.failed_load_hold_s`` (requests
meanwhile get its reason at once); idle unpinned models are unloaded after their
keep-alive; requests that reach a retired version go to the version that replaced it.
Evictions run on one thread of their own (``inferd-cache-evict``), never on the worker
thread of the model that needs the room.

Threads: loads on ``inferd-loader`` (2; loads themselves one at a time), evictions on
``inferd-cache-evict``, the idle check on ``inferd-cache-idle``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

from inferd.daemon.budget import MemoryBudget, format_bytes
from inferd.daemon.catalog import Catalog
from inferd.daemon.loading import ModelLoader
from inferd.daemon.memory import METER, Estimate, LoadFigures
from inferd.daemon.model_entry import ModelEntry, ModelKey, State
from inferd.daemon.pipeline import unpin_current_thread
from inferd.daemon.placer import Placer
from inferd.daemon.processors import ProcessorRegistry, release
from inferd.daemon.reload import reload_catalog
from inferd.daemon.repository import Repository, check_name
from inferd.daemon.units import request_keep_alive
from inferd.daemon.streams import Admission, lost_error, no_stream_table, stream_loss
from inferd.daemon.model_threads import ModelThreads, Queued, RunAdmission, Watch
from inferd.daemon.workers.pool import WorkerPool
from inferd.daemon.workers.quarantine import Quarantine
from inferd.ipc.errors import ErrorCode, Failure, InferdError, ModelError, failure
from inferd.ipc.protocol import Reply, Request
from inferd.ipc.replies import AnyTicket, ReplySink
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.registry import Registry

log = logging.getLogger(__name__)


class ModelManager:
    """The model cache of one runtime.

    Args:
        repo: the model repository.
        registry: backends to choose from.
        config: returns the daemon configuration in force: read from the one place that
            holds it (the runtime's ``config``; a reload replaces it there), never copied
            by the cache, its catalog or its placer.
        sink: where the workers' replies go (any thread).
        observer: metrics hooks (:class:`~inferd.daemon.metrics.Metrics`: ``loaded``,
            ``unloaded``, ``for_model``), or None.
        processors: the steps model.toml may name (filled by the runtime at start).
        customops: the daemon's custom ops (filled by the runtime at start), or None.
    """

    def __init__(self, repo: Repository, registry: Registry, config: Callable[[], Any],
                 sink: ReplySink, *, observer: Any = None,
                 processors: ProcessorRegistry | None = None,
                 customops: OpRegistry | None = None, workers: WorkerPool | None = None,
                 watch: Watch | None = None) -> None:
        self.registry = registry
        self._watch = watch  # the I/O loop's: runs sent to a worker from the I/O thread
        self.catalog = Catalog(repo, config)
        self.budget = MemoryBudget()  # figures and verdicts; evictions are ours
        # measuring placement loads and runs rivals only while no request is in flight
        self.placer = Placer(config, self,
                             busy=lambda: any(e.in_flight for e in self.entries()))
        self._loader = ModelLoader(self.catalog, registry, self.budget, self.make_room, processors,
                                   customops, self.placer, workers)
        w = config().workers
        # who keeps killing a model's worker (daemon/workers/quarantine.py)
        self.quarantine = Quarantine(w.refuse_client_after, w.refuse_client_s,
                                     w.set_aside_after)
        self._sink = sink
        self._observer = observer
        self._entries: dict[ModelKey, ModelEntry] = {}
        self._lock = threading.Lock()  # the entries dict
        self._reload_lock = threading.Lock()
        self._stopping = threading.Event()
        self.left_running: list[ModelThreads] = []  # workers a drain gave up on (still alive)
        self._loads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inferd-loader",
                                         initializer=unpin_current_thread)
        self._evictor = ThreadPoolExecutor(max_workers=1,
                                           thread_name_prefix="inferd-cache-evict",
                                           initializer=unpin_current_thread)
        self._idle_thread: threading.Thread | None = None

    @property
    def config(self) -> Any:
        return self.catalog.config

    @property
    def repo(self) -> Repository:
        return self.catalog.repo

    def start(self) -> None:
        """Start the idle-unload thread (``inferd-cache-idle``)."""
        self._idle_thread = threading.Thread(target=self._idle_loop, name="inferd-cache-idle",
                                             daemon=True)
        self._idle_thread.start()

    # ----------------------------------------------------------------- the budget

    @property
    def max_memory(self) -> int | None:
        return self.config.cache.max_memory  # type: ignore[no-any-return]

    def entries(self) -> list[ModelEntry]:
        with self._lock:
            return list(self._entries.values())

    def pinned(self, entry: ModelEntry) -> bool:
        return self.catalog.pinned(entry.name, entry.version)

    def used(self) -> int:
        """What the cache counts against its budget now (engines and rivals on trial
        included)."""
        return self.budget.used(self.entries())

    def make_room(self, entry: ModelEntry | None, need: int, how: str,
                  floor: int | None = None, here: bool = False) -> int:
        """Evict what the budget names (daemon/budget.py: idle unpinned models, least
        recently used first) until ``need`` bytes fit for ``entry`` beside every other
        entry (or, failing that, ``floor``); returns the bytes made room for.

        Evictions drain on ``inferd-cache-evict`` while the calling thread (a loader, or
        a model's thread whose run needs room) waits; ``here``: the caller is that thread.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): nothing evictable makes enough room.
        """
        label = entry.label if entry is not None else "the models loaded"
        while True:
            budget = self.max_memory
            verdict = self.budget.room(entry, need, how, self.entries(), budget,
                                       self.pinned, floor)
            if not verdict.victims:
                return verdict.need
            reason = (f"evicted to make room for {label} within the cache budget "
                      f"({format_bytes(budget)})")
            for victim in verdict.victims:
                if here:
                    self._drain(victim, reason, only_if_idle=True)
                else:
                    self._evictor.submit(self._drain, victim, reason, True).result()

    def enforce(self, here: bool = False) -> None:
        """Evict idle unpinned models until the loaded ones fit (after the budget shrank,
        or a model's working memory grew); raises RESOURCE_EXHAUSTED naming what does
        not fit."""
        self.make_room(None, 0, "", here=here)

    def _enforce_soon(self) -> None:
        """:meth:`enforce` on ``inferd-cache-evict`` if the loaded models no longer fit;
        returns at once (a model's working memory grew on its thread)."""
        budget = self.max_memory
        if budget is not None and self.used() > budget:
            self._evictor.submit(self._enforce)

    def _enforce(self) -> None:
        try:
            self.enforce(here=True)
        except InferdError as e:
            log.warning("cache is over its budget and cannot evict more: %s", e.message)

    @contextmanager
    def kept(self, name: str, version: int) -> Iterator[None]:
        """Keep ``version`` of ``name`` from eviction while the block runs (the old
        version during a swap)."""
        with self.entry(name, version).keep():
            yield

    def admit(self, entry: ModelEntry, inputs: dict[str, Any]) -> Estimate:
        """The admission step of a run of ``entry`` on ``inputs`` (its thread calls it
        before the engine): its working memory estimated; a need beyond what the model
        counts has room made for it (idle models evicted, on the cache's thread) and
        counts from now on; one that cannot fit is refused when the estimate is reliable
        (unreliable: the run goes ahead and is measured).

        Raises:
            InferdError (RESOURCE_EXHAUSTED): the run cannot fit, with the figures.
        """
        working = entry.memory.working
        estimate = working.estimate(inputs)
        need = self.budget.run_need(entry, estimate, self.max_memory)
        if need:
            load = entry.memory.load
            assert load is not None  # run_need asks room only beside a measured load
            try:
                self.make_room(entry, need, f"{format_bytes(need - load.cost)} of it "
                               f"working memory, {estimate.how}")
            except InferdError as e:
                if estimate.reliable:
                    raise
                log.debug("model %s: no room made for its working memory: %s",
                          entry.label, e.message, extra={"MODEL": entry.name})
        if estimate.bytes > 0:
            working.admit(estimate)  # it counts from now on (a settled one already does)
        return estimate

    def grew(self, entry: ModelEntry) -> None:
        """A run of ``entry`` needed more working memory than any before: it counts now;
        idle models are evicted if the loaded ones no longer fit."""
        memory = entry.memory
        log.info("model %s: working memory %s; counts %s against the budget", entry.label,
                 format_bytes(memory.working.peak), format_bytes(memory.total()),
                 extra={"MODEL": entry.name})
        self._enforce_soon()

    # what measuring placement needs of the cache (daemon/placement.py's Room)

    def measured(self, key: ModelKey) -> int | None:
        """What the model version ``key`` cost at its last load (its working memory
        included), if it was loaded before."""
        with self._lock:
            entry = self._entries.get(key)
        return entry.memory.total() if entry is not None else None

    def reserve(self, label: str, need: int, runs_here: bool = True
                ) -> AbstractContextManager[None]:
        """Count ``need`` bytes while the block runs (a rival on trial; ``runs_here``: in
        the daemon's own process); evicts nothing. Raises RESOURCE_EXHAUSTED if it does
        not fit beside what is in use."""
        return self.budget.reserve(label, need, self.used(), self.max_memory, runs_here)

    def recost(self, entry: ModelEntry, figures: LoadFigures) -> None:
        """``entry``'s load was measured again (its engine changed under it): it counts
        ``figures.cost`` plus its working memory from now on; idle models are evicted if
        the loaded ones no longer fit."""
        entry.memory.loaded(figures)
        self._enforce_soon()

    def engines(self) -> dict[str, int]:
        return self.budget.engines()

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

    # ----------------------------------------------------------------- requests

    def submit(self, ticket: AnyTicket, io_thread: bool = False) -> None:
        """Queue an infer request. Raises InferdError to refuse it.

        Args:
            ticket: the request's record (``ticket.request``: the request).
            io_thread: the caller is the I/O thread with a wire request: a small one
                (``ticket.tensor_bytes``, its tensors wherever they travel, frames or
                shared memory) to a model that runs it in less time than the two thread
                hand-overs would cost is run here and now (``[models] io_run_max_us``,
                :meth:`ModelThreads.may_run_on_io_thread`).
        """
        request = ticket.request
        if request.model is None:
            raise ModelError("infer needs 'model'")
        keep_alive = request_keep_alive(request.params)
        self.quarantine.check(request.model, ticket.uid)
        entry = self.entry(request.model, request.version)
        item = Queued(ticket)
        if request.stream is not None and not self._stream_turn(entry, item, keep_alive):
            return  # held behind an earlier chunk of its stream, or answered
        try:
            workers = entry.threads
            if (io_thread and workers is not None
                    and workers.may_run_on_io_thread(ticket.tensor_bytes)
                    # its admission decided already: nothing to estimate or evict here
                    # (a stream's chunk runs on its state too: shapes its [stream] table
                    # fixes, settled with the model's first runs on its threads)
                    and (item.chunk is not None
                         or entry.memory.working.settled(request.inputs))
                    and not self._stopping.is_set()
                    and entry.begin_io_run(workers, keep_alive)):
                workers.run_on_io_thread(item)
                return
            self._enqueue(entry, item, keep_alive)
        except BaseException:
            if item.chunk is not None:  # refused before it ran: its stream is as it was
                entry.streams.release(item)
            raise

    def _stream_turn(self, entry: ModelEntry, item: Queued,
                     keep_alive: float | None) -> bool:
        """Admit a request that names a stream (daemon/streams.py): True if it goes on
        to the model now; False if its stream holds it (an earlier chunk is in flight)
        or it was answered here (an end without a chunk).

        Raises:
            InferdError: the model has no [stream] table (INVALID_ARGUMENT), the stream
                is not started or was lost (FAILED_PRECONDITION), a limit on open
                streams or no room in the cache budget for its state
                (RESOURCE_EXHAUSTED).
        """
        spec = self.catalog.spec(entry.name).settings.stream
        if spec is None:
            raise no_stream_table(entry.name)
        budget = self.max_memory
        # what the budget counts, read before the locks (it reads every table)
        start = item.request.stream is not None and item.request.stream.start
        room = (budget, self.used()) if budget is not None and start else None
        with entry.lock:  # the entry's lock first, then its table's (as everywhere)
            verdict = entry.streams.admit(item, spec, self.config.streams.max_per_client,
                                          partial(entry.hold, keep_alive), room)
        if isinstance(verdict, Reply):
            self._sink.send(item.ticket, verdict)
            return False
        return verdict is Admission.RUN

    def _enqueue(self, entry: ModelEntry, item: Queued, keep_alive: float | None) -> None:
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
                entry.retry()
            if entry.queue.qsize() >= entry.queue_size and not entry.queue.below_share(
                    item.ticket.peer):
                raise InferdError(f"model {entry.label}: queue is full "
                                  f"({entry.queue_size} requests waiting)",
                                  ErrorCode.RESOURCE_EXHAUSTED)
            if entry.state is State.UNLOADED:
                self._start_load(entry)
            # DRAINING: the request waits in the queue; the drain restarts the load.
            entry.enqueue(item, keep_alive)

    def wait_for_room(self, request: Request, timeout: float | None) -> bool:
        """Wait until ``request``'s model queue has room (an in-process caller's
        backpressure, where a client gets RESOURCE_EXHAUSTED); False if ``timeout``
        seconds passed first."""
        entry = self.entry(request.model or "", request.version)
        return entry.queue.wait_below(entry.queue_size, timeout)

    def cancel_peer(self, peer: bytes) -> int:
        """Answer CANCELLED every request of a client that has disconnected and is still
        queued for a model, instead of running it for nobody, and free its streams (I/O
        thread); how many requests."""
        dropped = 0
        for entry in self.entries():
            items = entry.queue.drop(peer)
            held = entry.streams.drop_peer(peer)  # its streams go with it
            items += held
            if not items:
                continue
            entry.dropped(items)
            for item in items:
                self._sink.send(item.ticket, Reply(item.request.id, error=Failure(
                    ErrorCode.CANCELLED, f"model {entry.label}: the client disconnected "
                    f"before the request ran")))
            dropped += len(items)
        return dropped

    # ----------------------------------------------------------------- loading

    def _start_load(self, entry: ModelEntry) -> Future[ModelEntry]:
        """Begin loading on a loader thread (``entry`` is UNLOADED)."""
        with entry.lock:  # the loader thread's first step on it waits for the state
            future = self._loads.submit(self._load, entry)
            entry.begin_load(future)
        return future

    def _load(self, entry: ModelEntry) -> ModelEntry:
        """Load ``entry`` (LOADING) and make it READY with its workers running.

        Raises:
            InferdError: the load failed; the entry is FAILED and what waited in its
                queue got the reason.
        """
        started = time.monotonic()
        try:
            loaded = self._loader.load(entry)
        except Exception as e:
            code, message = failure(e, f"model {entry.label}: unexpected error while "
                                    f"loading", log, named=False, model=entry.name)
            if code is ErrorCode.INVALID_ARGUMENT:
                # What backends raise for a file they cannot load: not the request's
                # fault but the model's, so INTERNAL (a client does not retry it; the
                # failure stands until its files change: _failure_stands).
                code = ErrorCode.INTERNAL
            log.error("model %s failed to load: %s", entry.label, message,
                      extra={"MODEL": entry.name, "CODE": str(code)})
            for item in entry.fail(code, message, self.catalog.get(entry.name)):
                self._sink.send(item.ticket, Reply(item.request.id, error=Failure(
                    code, f"model {entry.label} failed to load: {message}")))
            if self._observer is not None:
                self._observer.loaded(entry.name, time.monotonic() - started, False)
            raise InferdError(message, code) from e
        # The one place a model's worker threads are built (daemon/model_threads.py).
        workers = ModelThreads(entry.name, loaded.model, entry.queue, self._sink,
                          loaded.settings.instances, on_done=entry.done,
                          spec=loaded.pipeline, backend=loaded.placement.backend,
                          observe=self._observer.for_model(entry.name)
                          if self._observer is not None else None,
                          io_run_max_s=self.config.models.io_run_max_us / 1e6,
                          quarantine=self.quarantine, streams=entry.streams,
                          stream_model=loaded.streams,
                          admission=RunAdmission(partial(self.admit, entry),
                                                 entry.memory.working,
                                                 partial(self.grew, entry)),
                          watch=self._watch)
        entry.memory.loaded(loaded.figures, loaded.graph, loaded.placement.backend,
                            loaded.meter)
        workers.warm_up()  # its batches sized before its requests come
        entry.ready(loaded.model, workers, loaded.placement, loaded.settings.keep_alive,
                    loaded.streams)
        workers.start()
        if self._observer is not None:
            self._observer.loaded(entry.name, time.monotonic() - started, True)
        from inferd.libbackends.customops.contract import plan_note

        where = loaded.placement
        log.info("model %s loaded on %s, device %s, in %.0f ms, %s%s; chosen: %s",
                 entry.label, where.backend, where.device,
                 (time.monotonic() - started) * 1000,
                 format_bytes(self.budget.cost(entry)), plan_note(loaded.model), where.why,
                 extra={"MODEL": entry.name, "BACKEND": where.backend,
                        "DEVICE": where.device})
        return entry

    def load(self, name: str, version: int | None = None) -> ModelEntry:
        """Load ``name`` (or wait for the load in progress); blocking. A remembered
        failure caused by the model's files is answered again at once until its files
        change or a reload scans the repository again; others are retried at once.

        Raises:
            InferdError: the load failed, with its code and reason.
        """
        entry = self.entry(name, version)
        with entry.lock:
            entry.changed.wait_for(lambda: entry.state is not State.DRAINING)
            entry.touch(request=False)
            if entry.state is State.FAILED:
                if self._failure_stands(entry):
                    raise InferdError(f"model {entry.label} failed to load and its files "
                                      f"have not changed since (new files or a reload "
                                      f"retry it): {entry.error}", entry.error_code)
                entry.retry()
            if entry.state is State.UNLOADED:
                future = self._start_load(entry)
            elif entry.state is State.LOADING:
                future = entry.load_future
            else:
                future = None
        if future is not None:
            future.result()
        return entry

    def _failure_stands(self, entry: ModelEntry) -> bool:
        """Whether ``entry``'s failed load (lock held) would fail again: its cause is in
        its files (not the budget or a backend), no reload has scanned since, and its
        files are as that scan saw them."""
        spec = self.catalog.get(entry.name)
        return (entry.error_code not in (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE)
                and spec is not None and spec is entry.failed_scan
                and self.repo.unchanged(spec, entry.version))

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

    # ----------------------------------------------------------------- reload

    def reload(self, previous: Any) -> dict[str, list[str]]:
        """Apply the configuration now in force (its holder replaced it) and re-read the
        repository, failing no request (see
        :func:`inferd.daemon.reload.reload_catalog`); ``previous``: the configuration
        before (what was pinned). Returns what changed."""
        with self._reload_lock:
            self.placer.reloaded()
            self.quarantine.lift()  # set-aside models are tried again
            return reload_catalog(self, previous)

    # Used by reload_catalog: each step keeps every request answered.

    def refresh_keep_alives(self) -> None:
        """Give loaded models the keep-alive now in force (config or model.toml)."""
        for e in self.entries():
            spec = self.catalog.get(e.name)
            if spec and not spec.error:
                e.refresh_keep_alive(self.catalog.settings(spec).keep_alive)

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
            if entry.state is State.FAILED:  # the try beside the old version just failed
                entry.retry()
            entry.begin_load(future)
        first()
        try:
            future.set_result(self._load(entry))
        except InferdError as e:
            future.set_exception(e)
            raise
        return entry

    # ----------------------------------------------------------------- draining

    def _drain(self, entry: ModelEntry, reason: str, only_if_idle: bool = False,
               timeout: float | None = None) -> bool:
        """Drain and unload a READY entry; False if it was not (or no longer) eligible.

        Requests that arrive during the drain wait in the queue; afterwards they start
        a new load, go to the version that replaced this one, or get NOT_FOUND if the
        model is gone.
        """
        with entry.lock:
            if entry.state is not State.READY:
                return False
            if only_if_idle and (not entry.evictable() or self.pinned(entry)):
                return False
            lost = stream_loss(reason)
            workers, model = entry.drain(lost)
        # never waits on a stuck stage (issue 20): past stuck_after_s inside one call,
        # the workers are given up (what they held answered UNAVAILABLE naming it)
        began = time.monotonic()
        finished = workers.stop(timeout, self.config.models.stuck_after_s)
        # its steps in the processors worker (a stuck call there keeps its own until it
        # returns)
        release(workers.spec.pre + workers.spec.post)
        if finished:
            model.unload()
            METER.trim()
        else:
            stuck = "; ".join(workers.stuck()) or "requests still queued"
            workers.abandon()
            log.error("model %s: threads did not finish within %.3g s; left running: %s",
                      entry.label, time.monotonic() - began, stuck,
                      extra={"MODEL": entry.name})
            self.left_running.append(workers)
        leftovers: list[Queued] = []
        with entry.lock:
            entry.unloaded(lost)
            if not entry.queue.empty():  # given-up workers withdrew their STOP
                if (self.catalog.servable(entry.name, entry.version)
                        and not self._stopping.is_set()):
                    self._start_load(entry)
                else:
                    leftovers = entry.take_queued()
        log.info("model %s unloaded: %s", entry.label, reason, extra={"MODEL": entry.name})
        if self._observer is not None:
            self._observer.unloaded(entry.name, reason.startswith("evicted"))
        for item in leftovers:
            self._reroute(entry, item)
        self._hand_on_lost(entry)
        return True

    def _hand_on_lost(self, retired: ModelEntry) -> None:
        """The streams lost with a version that is no longer the default are told why
        by the default (where their next chunk goes unless it names a version), not
        "not started"."""
        try:
            successor = self.entry(retired.name)
        except InferdError:
            return  # the model is gone: its next chunk is told NOT_FOUND
        if successor is not retired:
            successor.streams.adopt_lost(retired.streams)

    def _reroute(self, retired: ModelEntry, item: Queued) -> None:
        """A request that reached a version just retired: hand it to the model's current
        default version if it named none, else answer NOT_FOUND. A chunk of a stream
        is told its stream's state went with the version (and so are the chunks its
        stream held behind it)."""
        if item.chunk is not None:
            self._stream_gone(retired, item)
            return
        try:
            if item.request.version is not None:
                raise ModelError(f"model {retired.label} was removed from the repository",
                                 ErrorCode.NOT_FOUND)
            self._enqueue(self.entry(retired.name), item, None)
        except Exception as e:
            self._sink.send(item.ticket, Reply(item.request.id, error=failure(
                e, f"model {retired.label}", log, model=retired.name)))

    def _stream_gone(self, retired: ModelEntry, item: Queued) -> None:
        todo = [item]
        while todo:
            it = todo.pop()
            assert it.chunk is not None
            reason = it.chunk.stream.lost or "model unloaded"
            self._sink.send(it.ticket, Reply(it.request.id, error=Failure(
                ErrorCode.FAILED_PRECONDITION,
                lost_error(it.chunk.ref.id, retired.name, reason).message)))
            for nxt, _ in retired.streams.finished(it, False):
                retired.dropped([nxt])  # counted in flight when its stream held it
                todo.append(nxt)

    def unload_idle(self) -> list[str]:
        """Unload every unpinned model idle longer than its keep-alive; their labels."""
        now = time.monotonic()
        done = []
        for e in self.entries():
            with e.lock:
                if (e.state is not State.READY or e.in_flight or now < e.keep_until
                        or e.streams.open()):  # open streams: freed when idle first
                    continue
                idle = now - e.used_at
                if idle < e.keep_alive:
                    continue
            if self._drain(e, f"idle for {idle:.1f} s (keep_alive {e.keep_alive:g} s)",
                           only_if_idle=True):
                done.append(e.label)
        return done

    def expire_streams(self) -> int:
        """Free the streams idle past their model's ``idle_timeout_s``; how many."""
        now = time.monotonic()
        freed = 0
        for e in self.entries():
            bound = e.streams.bound
            if bound is not None and e.streams.open():
                freed += len(e.streams.expire(now, bound.spec.idle_timeout_s))
        return freed

    def _idle_loop(self) -> None:
        while not self._stopping.wait(self.config.cache.idle_check_s):
            try:
                self.expire_streams()
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
        given_up: list[ModelThreads] = []
        for entry in entries:
            before = len(self.left_running)
            self._unload_wait(entry, reason, timeout)
            given_up += [w for w in self.left_running[before:] if w.name == name]
            with self._lock:
                if (not self.catalog.servable(entry.name, entry.version)
                        and entry.state is State.UNLOADED):
                    self._entries.pop((entry.name, entry.version), None)
        if given_up:
            raise InferdError(f"model {name}: unloaded, but a stage did not end: "
                              f"{'; '.join(s for w in given_up for s in w.stuck())}; the "
                              f"requests it held were answered UNAVAILABLE, its threads "
                              f"are left running", ErrorCode.UNAVAILABLE)
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
                entry.retry()
        self._drain(entry, reason, timeout=timeout)

    def running_threads(self) -> list[ModelThreads]:
        """The workers of every ready model, and those a drain gave up on (the
        stuck-stage watch, daemon/watch.py)."""
        return [e.threads for e in self.entries()
                if e.state is State.READY and e.threads is not None] + list(self.left_running)

    def stop(self, timeout: float) -> bool:
        """Finish queued work and unload every model; True if all threads ended."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        placed = self.placer.stop(timeout)  # measuring first: it loads rivals
        for entry in self.entries():
            left = max(0.1, deadline - time.monotonic())
            self._unload_wait(entry, "daemon stopping", left)
        ok = not any(t.is_alive() for w in self.left_running for t in w.threads) and placed
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._evictor.shutdown(wait=False, cancel_futures=True)
        if self._idle_thread is not None:
            self._idle_thread.join(max(0.1, deadline - time.monotonic()))
        return ok

    # ----------------------------------------------------------------- state

    def describe(self) -> list[dict[str, Any]]:
        """The ``models`` listing: every model the catalog offers (its default version,
        loaded or not) and every version in memory, with state, pins, settings and
        memory."""
        catalog = self.catalog.snapshot()
        with self._lock:
            entries = dict(self._entries)
        out = []
        for name in sorted(set(catalog) | {n for n, _ in entries}):
            spec = catalog.get(name)
            rows = [e for (n, _), e in sorted(entries.items()) if n == name
                    and (e.state is not State.UNLOADED
                         or (spec and e.version == spec.default))]
            if spec and (name, spec.default) not in entries:
                rows.append(ModelEntry(name, spec.default, 1))
            for e in rows:
                info = self.describe_entry(e)
                if spec is None:
                    info["error"] = info["error"] or "removed from the repository"
                elif spec.error:
                    info.update(state=str(State.FAILED), error=spec.error)
                elif name in self.quarantine.set_aside:
                    info.update(state=str(State.FAILED),
                                error=self.quarantine.set_aside[name])
                if e.state is State.UNLOADED and spec and not spec.error:
                    keep = self.catalog.settings(spec).keep_alive
                    info["keep_alive_s"] = None if math.isinf(keep) else keep
                if spec and not spec.error and info["batching"] is None:  # as configured
                    info["batching"] = {"max_batch": spec.settings.max_batch,
                                        "max_delay_ms": spec.settings.max_delay_ms,
                                        "mode": spec.settings.batching}
                info["versions"] = list(spec.versions) if spec else []
                info["default"] = bool(spec and spec.default == e.version)
                out.append(info)
        return out

    def describe_entry(self, entry: ModelEntry) -> dict[str, Any]:
        """One version's row (the reply to a load or unload): its state, pin and
        memory."""
        with entry.lock:
            info = entry.describe()
            info["pinned"] = self.pinned(entry)
            info.update(self.budget.describe(entry))
        return info

    def engine_pinning(self, name: str, version: int) -> list[dict[str, Any]]:
        """The worker threads that run a loaded version (``inferctl models --verbose``;
        :meth:`ModelThreads.engine_pinning`); none for a version not loaded, or loaded in
        the daemon itself."""
        with self._lock:
            entry = self._entries.get((name, version))
        threads = entry.threads if entry is not None else None
        return threads.engine_pinning() if threads is not None else []

    def cache_status(self) -> dict[str, Any]:
        """Budget and use, for the status op."""
        entries = self.entries()
        return {"max_memory_bytes": self.config.cache.max_memory,
                "used_bytes": self.budget.used(entries), "engines_bytes": self.budget.engines(),
                "loads": sum(e.loads for e in entries)}

    def loaded(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries.values() if e.state is State.READY]

    def dead_worker_threads(self) -> list[str]:
        """Names of worker threads of ready models that have ended (the watchdog's
        probe): the threads themselves are asked, so two versions of a model whose
        threads share a name cannot hide each other."""
        return [t.name for e in self.entries() if e.state is State.READY and e.threads
                for t in e.threads.threads if not t.is_alive()]
