"""One cache entry: the state of one version of one model and its transitions, its
queue, its counters and its measured memory."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

from inferd.daemon.memory import ModelMemory
from inferd.daemon.placement import ModelPlacement
from inferd.daemon.streams import StreamModel, StreamTable
from inferd.daemon.model_threads import Queued, ModelThreads, WorkQueue
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
    """One version of one model: its state, its queue, its counters.

    The entry is the only code that changes its state: each transition is a method
    (:meth:`begin_load`, :meth:`ready`, :meth:`fail`, :meth:`drain`, :meth:`unloaded`,
    :meth:`retry`), checks the state it starts from and wakes whoever waits on
    ``changed``. Each takes ``lock`` itself; it is reentrant, so a caller that must
    decide and act in one step (the manager's queueing) holds it around both.

    ``in_flight`` counts the requests queued or running: a model with any is busy and
    is not evicted or unloaded for idleness. ``reserved`` is what a load in progress
    counts against the budget (:meth:`reserve`); ``kept`` marks an entry that must not
    be evicted (:meth:`keep`: the old version during a swap).
    """

    def __init__(self, name: str, version: int, queue_size: int) -> None:
        self.name = name
        self.version = version
        self.label = f"{name} version {version}"
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._state = State.UNLOADED
        # Takes turns between clients; the bound is kept by ModelManager._enqueue under
        # ``lock``.
        self.queue: WorkQueue = WorkQueue()
        self.queue_size = queue_size
        self.placement: ModelPlacement | None = None  # backend, device and why
        # the placer's contest of its current load's rivals (daemon/placer.py), while
        # one is open: measured, or kept for `inferctl reload --remeasure`
        self.contest: Any = None
        self.model: LoadedModel | None = None
        self.threads: ModelThreads | None = None
        self.error: str | None = None
        self.error_code: ErrorCode = ErrorCode.INTERNAL
        self.failed_at = 0.0
        self.failed_scan: Any = None  # the model's ModelSpec when the load failed
        self.memory = ModelMemory(self.label)  # measured; counted by daemon/budget.py
        self.reserved = 0  # bytes a load in progress counts (LOADING only)
        self.kept = 0  # blocks that keep it from eviction (keep)
        self.streams = StreamTable(name)  # its clients' streams (daemon/streams.py)
        self.load_future: Future[ModelEntry] | None = None
        self.loads = 0
        self.served = 0
        self.failed_requests = 0
        self.in_flight = 0
        self.last_used: float | None = None
        self.used_at = time.monotonic()
        self.keep_until = 0.0
        self.keep_alive = math.inf

    @property
    def state(self) -> State:
        return self._state

    @property
    def backend(self) -> str | None:
        """The backend the loaded model runs on (from its placement)."""
        return self.placement.backend if self.placement is not None else None

    def _become(self, state: State, *expected: State) -> None:
        if self._state not in expected:
            raise RuntimeError(f"model {self.label}: {self._state} -> {state}; expected "
                               f"from {', '.join(map(str, expected))}")
        self._state = state
        self.changed.notify_all()

    # ----------------------------------------------------------------- transitions

    def begin_load(self, future: Future[ModelEntry]) -> None:
        """UNLOADED -> LOADING: ``future`` gets the load's outcome."""
        with self.lock:
            self._become(State.LOADING, State.UNLOADED)
            self.error = None
            self.load_future = future
            self.loads += 1

    def ready(self, model: LoadedModel, workers: ModelThreads, placement: ModelPlacement,
              keep_alive: float, streams: StreamModel | None = None) -> None:
        """LOADING -> READY with the loaded model and its (not yet started) workers
        (``streams``: its [stream] table bound to it, or None)."""
        with self.lock:
            self._become(State.READY, State.LOADING)
            self.reserved = 0  # it counts its measured memory from now on
            self.model, self.threads, self.placement = model, workers, placement
            self.streams.bound = streams
            self.keep_alive = keep_alive
            self.touch(request=False)

    def fail(self, code: ErrorCode, message: str, scan: Any = None) -> list[Queued]:
        """LOADING -> FAILED, remembering why, when and under which scan of the
        repository (``scan``: the model's ModelSpec then); returns the requests that
        waited in the queue, which the caller must answer."""
        with self.lock:
            self._become(State.FAILED, State.LOADING)
            self.reserved = 0
            self.error, self.error_code = message, code
            self.failed_at = time.monotonic()
            self.failed_scan = scan
            return self.take_queued()

    def retry(self) -> None:
        """FAILED -> UNLOADED: the next request or load tries again."""
        with self.lock:
            self._become(State.UNLOADED, State.FAILED)

    def drain(self, reason: str = "model unloaded") -> tuple[ModelThreads, LoadedModel]:
        """READY -> DRAINING: returns the workers to stop and the model to unload.
        Requests that arrive meanwhile wait in the queue; chunks that its streams hold
        are answered with their loss (``reason``)."""
        with self.lock:
            self._become(State.DRAINING, State.READY)
            self.streams.closing = reason
            assert self.threads is not None and self.model is not None
            return self.threads, self.model

    def unloaded(self, reason: str = "model unloaded") -> None:
        """DRAINING -> UNLOADED: the model and its workers are gone, and with them the
        state of its open streams (each answered ``reason`` at its next request)."""
        with self.lock:
            self._become(State.UNLOADED, State.DRAINING)
            self.model = self.threads = self.placement = None
            self.streams.bound = None
            self.streams.lose_all(reason)

    def reserve(self, need: int) -> None:
        """Count ``need`` bytes against the budget while the load runs (LOADING): its
        figure from its last load or a guess first, then what it measured."""
        with self.lock:
            if self._state is State.LOADING:
                self.reserved = need

    @contextmanager
    def keep(self) -> Iterator[None]:
        """Keep this entry from eviction while the block runs (the old version during a
        swap: loading the new one must not push out the one still serving)."""
        with self.lock:
            self.kept += 1
        try:
            yield
        finally:
            with self.lock:
                self.kept -= 1

    def evictable(self) -> bool:
        """Ready, idle and not kept (pinning is the catalog's: the manager asks it)."""
        return self._state is State.READY and not self.in_flight and not self.kept

    # ----------------------------------------------------------------- requests

    def enqueue(self, item: Queued, keep_alive: float | None) -> None:
        """Count ``item`` in flight and queue it (the caller checked the bound)."""
        with self.lock:
            self.in_flight += 1
            self.touch(keep_alive)
            # Last: the put wakes a worker, which then waits for this thread's GIL.
            self.queue.put(item)

    def hold(self, keep_alive: float | None) -> None:
        """Count a request in flight that its stream holds until an earlier chunk of the
        stream is answered (then it is queued: daemon/streams.py)."""
        with self.lock:
            self.in_flight += 1
            self.touch(keep_alive)

    def begin_io_run(self, workers: ModelThreads, keep_alive: float | None) -> bool:
        """Count a request in flight that the calling thread runs itself on
        ``workers`` (:meth:`ModelThreads.run_on_io_thread`), if they serve this entry now and
        nothing else of it is queued or running (so it takes no turn from another
        request); False: queue it instead."""
        with self.lock:
            if (self._state is not State.READY or self.threads is not workers
                    or self.in_flight):
                return False
            self.in_flight += 1
            self.touch(keep_alive)
            return True

    def done(self, ok: bool) -> None:
        """A request left the model, answered (the workers call it)."""
        with self.lock:
            self.in_flight -= 1
            if ok:
                self.served += 1
            else:
                self.failed_requests += 1
            self.touch()

    def dropped(self, items: list[Queued]) -> None:
        """``items`` were taken out of the queue unanswered by the model."""
        with self.lock:
            self.in_flight -= len(items)

    def touch(self, keep_alive: float | None = None, request: bool = True) -> None:
        """Restart the idle clock; ``request``: a request used it (shown as last used);
        a request's keep-alive extends how long it stays."""
        with self.lock:
            now = time.monotonic()
            self.used_at = now
            if request:
                self.last_used = time.time()
            if keep_alive is not None:
                self.keep_until = max(self.keep_until, now + keep_alive)

    def refresh_keep_alive(self, keep_alive: float) -> None:
        """A loaded model takes the keep-alive now in force (after a reload)."""
        with self.lock:
            if self._state is State.READY:
                self.keep_alive = keep_alive

    def take_queued(self) -> list[Queued]:
        """Empty the queue: the requests in it, which the caller must answer or pass
        on; sentinels are dropped."""
        with self.lock:
            items = []
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Queued):
                    items.append(item)
            self.in_flight -= len(items)
            return items

    # ----------------------------------------------------------------- placement

    def open_contest(self, contest: Any) -> None:
        """Its current load has rivals, measured (or to be) by ``contest`` (the
        placer's: daemon/placer.py)."""
        with self.lock:
            self.contest = contest

    def close_contest(self, model: Any) -> Any:
        """The placed model ``model`` was unloaded: its contest (returned, None if it
        had none) is closed. A newer load's contest stays."""
        with self.lock:
            contest = self.contest
            if contest is None or contest.model is not model:
                return None
            self.contest = None
            return contest

    def _placed(self) -> dict[str, Any]:
        """Backend, device and why, as the placement says now (measuring may move it)."""
        p = self.placement.to_json() if self.placement else {}
        return {"backend": p.get("backend"), "device": p.get("device"),
                "device_kind": p.get("kind"), "chosen": p.get("why"),
                "engine_threads": p.get("threads"), "placement_status": p.get("status")}

    def describe(self) -> dict[str, Any]:
        m = self.model
        about = m.describe() if m else {}
        return {
            "name": self.name, "state": str(self.state), "version": self.version,
            "error": self.error, **self._placed(),
            "inputs": [s.to_json() for s in m.inputs] if m else [],
            "outputs": [s.to_json() for s in m.outputs] if m else [],
            "requests": self.served, "failed_requests": self.failed_requests,
            "loads": self.loads, "in_flight": self.in_flight,
            "queued": self.queue.qsize(), "last_used": self.last_used,
            "idle_s": (round(time.monotonic() - self.used_at, 3)
                       if self.state is State.READY and not self.in_flight else None),
            "keep_alive_s": None if math.isinf(self.keep_alive) else self.keep_alive,
            "threads": [t.name for t in self.threads.threads] if self.threads else [],
            # each thread's backend as it runs now (measuring may have moved the model)
            "placement": [{**p, "backend": self.backend if p.get("backend") else None}
                          for p in self.threads.pinning()] if self.threads else [],
            "batching": self.threads.batching() if self.threads else None,
            "io_thread_runs": self.threads.io_thread_runs if self.threads else 0,
            "plan": about.get("plan"),
            # the worker process it runs in (None: in the daemon's own process)
            "worker": about.get("worker"),
            # open streams; those freed for idleness, and lost, since the daemon started
            "streams": self.streams.open(), "streams_bytes": self.streams.nbytes(),
            "streams_expired": self.streams.expired, "streams_lost": self.streams.lost_count,
        }
