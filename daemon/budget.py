"""The memory budget of the model cache (``[cache] max_memory``): what each model counts
against it, what is admitted, and which idle models are evicted to make room.

Accounting: a loading model counts what its load reserved (its figure from its last
load, else a guess from its file size, then its measured cost); a ready or draining one
its measured load cost plus the largest working memory it has needed
(:class:`~inferd.daemon.memory.ModelMemory`, measured by :mod:`inferd.daemon.memory`);
a reservation (:meth:`MemoryBudget.reserve`) what it holds. Admission: before a load
(:meth:`MemoryBudget.make_room`) and before a run that may need more working memory than
its model counts (:class:`AdmittedModel`), idle unpinned models are evicted, least
recently used first; what cannot fit is refused with RESOURCE_EXHAUSTED and the
figures. Pinned models, busy ones and the old version during a swap are never evicted.

The budget evicts through the cache (:class:`Cache`), which drains the victims on its
own thread: never on the thread of a model's worker that asked for room.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from numpy.typing import NDArray

from inferd.daemon.memory import METER, Estimate, LoadFigures, WorkingMemory
from inferd.daemon.model_entry import ModelEntry, ModelKey, State
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import BatchSizes, LoadedModel

log = logging.getLogger(__name__)

# Before a model's first load its cost is unknown; the demo models cost 2-5x their file
# size in onnxruntime (measured, see bench/bench_cache.py). The estimate only decides
# how much to evict up front; the measured cost is checked against the budget after.
ESTIMATE_FACTOR = 2
ESTIMATE_OVERHEAD = 4 * 2**20


def format_bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    return f"{n / 2**20:.1f} MiB"


def estimate_cost(file_bytes: int) -> int:
    """A first guess of what a model file costs once loaded."""
    return ESTIMATE_FACTOR * file_bytes + ESTIMATE_OVERHEAD


@dataclass(frozen=True)
class Evictable:
    """A loaded model that could be evicted: idle, unpinned, ready."""

    key: Any
    cost: int
    last_used: float


def choose_victims(candidates: Sequence[Evictable], need: int) -> list[Evictable] | None:
    """The least recently used candidates whose costs free at least ``need`` bytes, or
    None if all of them together do not."""
    if need <= 0:
        return []
    chosen, freed = [], 0
    for c in sorted(candidates, key=lambda c: c.last_used):
        chosen.append(c)
        freed += c.cost
        if freed >= need:
            return chosen
    return None


class Cache(Protocol):
    """What the budget needs of the model cache
    (:class:`~inferd.daemon.models.ModelManager`)."""

    @property
    def max_memory(self) -> int | None:
        """The budget in bytes now, or None for none (a reload may change it)."""

    def entries(self) -> list[ModelEntry]:
        """Every entry of the cache."""

    def pinned(self, entry: ModelEntry) -> bool:
        """Whether ``entry`` is pinned (never evicted)."""

    def evict(self, entry: ModelEntry, reason: str) -> bool:
        """Drain and unload ``entry`` if it is still evictable, on the cache's own
        thread; returns once done. False if it no longer was."""

    def enforce_soon(self) -> None:
        """Have :meth:`MemoryBudget.enforce` run on the cache's own thread; returns at
        once."""


class MemoryBudget:
    """Keeps the models of one cache inside ``[cache] max_memory``.

    Args:
        cache: the model cache it accounts for.
    """

    def __init__(self, cache: Cache) -> None:
        self._cache = cache
        self._reserved: dict[ModelKey, int] = {}  # loads in progress
        self._holding: dict[int, int] = {}  # reservations (reserve) by token
        self._tokens = itertools.count()
        self._held: set[ModelKey] = set()
        self._engines: dict[str, int] = {}  # engines imported: what each added
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- accounting

    def cost(self, entry: ModelEntry) -> int:
        """Bytes ``entry`` counts against the budget now."""
        state = entry.state
        if state is State.LOADING:
            return self._reserved.get((entry.name, entry.version), 0)
        if state in (State.READY, State.DRAINING):  # and its streams' state
            return (entry.memory.total() or 0) + entry.streams.nbytes()
        return 0

    def used(self) -> int:
        """What the cache's models, the engines they brought in and the reservations
        count now."""
        return self._fixed() + sum(self.cost(e) for e in self._cache.entries())

    def _fixed(self) -> int:
        """What counts whatever is loaded: reservations, and the engines imported (they
        stay in the process once a model brought them in)."""
        with self._lock:
            return sum(self._holding.values()) + sum(self._engines.values())

    def engine(self, name: str) -> int | None:
        """What importing engine ``name`` added, or None if no load imported it yet."""
        return self._engines.get(name)

    def engine_imported(self, name: str, added: int) -> None:
        """Engine ``name`` was imported for a load and added ``added`` bytes."""
        with self._lock:
            self._engines[name] = added

    def engines(self) -> dict[str, int]:
        """Every engine imported, and what it added (``inferctl status``)."""
        with self._lock:
            return dict(self._engines)

    def measured(self, key: ModelKey) -> int | None:
        """What the model version ``key`` cost at its last load (its working memory
        included), if it was loaded before."""
        entry = next((e for e in self._cache.entries() if (e.name, e.version) == key), None)
        return entry.memory.total() if entry is not None else None

    def reserve_load(self, entry: ModelEntry, need: int) -> None:
        """Count ``need`` bytes for ``entry`` while it loads (it is LOADING)."""
        self._reserved[(entry.name, entry.version)] = need

    def evictable(self, entry: ModelEntry) -> bool:
        """Ready, idle, unpinned and not held (caller may hold ``entry.lock``)."""
        return (entry.state is State.READY and not entry.in_flight
                and not self._cache.pinned(entry)
                and (entry.name, entry.version) not in self._held)

    @contextmanager
    def hold(self, name: str, version: int) -> Iterator[None]:
        """Keep ``version`` from eviction while the block runs (the old version during
        a swap: loading the new one must not push out the one still serving)."""
        with self._lock:
            self._held.add((name, version))
        try:
            yield
        finally:
            with self._lock:
                self._held.discard((name, version))

    @contextmanager
    def reserve(self, label: str, need: int) -> Iterator[None]:
        """Count ``need`` bytes as used while the block runs (a candidate engine being
        measured beside the model it may replace). Evicts nothing.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): ``need`` does not fit beside what is in
                use now.
        """
        budget = self._cache.max_memory
        used = self.used()
        if budget is not None and used + need > budget:
            raise InferdError(f"{label} needs {format_bytes(need)} but the cache budget is "
                              f"{format_bytes(budget)} with {format_bytes(used)} in use",
                              ErrorCode.RESOURCE_EXHAUSTED)
        token = next(self._tokens)
        with self._lock:
            self._holding[token] = need
        try:
            # what runs meanwhile (loads and runs of engines on trial) is no model's
            # working memory: a measurement taken then is dropped
            with METER.running():
                yield
        finally:
            with self._lock:
                del self._holding[token]

    # ----------------------------------------------------------------- admission

    def make_room(self, entry: ModelEntry | None, need: int, how: str,
                  floor: int | None = None) -> int:
        """Evict idle unpinned models, least recently used first, until ``need`` more
        bytes fit in the budget beside every other entry (or, failing that, ``floor``).

        Args:
            entry: the model the room is for (None: only the budget itself is checked).
            need: bytes it needs in all (what it counts now included).
            how: how ``need`` was found, for the message.
            floor: bytes that would do if ``need`` cannot be had.

        Returns:
            The bytes made room for: ``need``, or ``floor``.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): nothing evictable makes enough room.
        """
        wanted = need
        while True:
            budget = self._cache.max_memory
            if budget is None:
                return need
            others = [e for e in self._cache.entries() if e is not entry]
            used = self._fixed() + sum(self.cost(e) for e in others)
            if used + need <= budget:
                return need
            candidates = [Evictable(e, self.cost(e), e.used_at) for e in others
                          if self.evictable(e)]
            victims = choose_victims(candidates, used + need - budget)
            if victims is None and floor is not None and floor < need:
                need = floor
                continue
            if victims is None:
                raise InferdError(self._no_room(entry, wanted, how, budget, used, others),
                                  ErrorCode.RESOURCE_EXHAUSTED)
            label = entry.label if entry is not None else "the models loaded"
            for v in victims:
                self._cache.evict(v.key, f"evicted to make room for {label} within the "
                                         f"cache budget ({format_bytes(budget)})")

    def enforce(self) -> None:
        """Evict idle unpinned models until the loaded ones fit (after the budget shrank,
        or a model's working memory grew); raises RESOURCE_EXHAUSTED naming what does
        not fit."""
        self.make_room(None, 0, "")

    def _no_room(self, entry: ModelEntry | None, need: int, how: str, budget: int,
                 used: int, others: list[ModelEntry]) -> str:
        def names(entries: list[ModelEntry]) -> str:
            return ", ".join(f"{e.label} ({format_bytes(self.cost(e))})"
                             for e in entries) or "none"
        holding = [e for e in others if self.cost(e)]
        pinned = [e for e in holding if self._cache.pinned(e)]
        busy = [e for e in holding if e not in pinned and not self.evictable(e)]
        what = f"model {entry.label}" if entry is not None else "the models loaded"
        with self._lock:
            fixed = [f"engine {n} ({format_bytes(b)})" for n, b in sorted(self._engines.items())]
            held = sum(self._holding.values())
        if held:
            fixed.append(f"engines on trial ({format_bytes(held)})")
        return (f"{what} needs {format_bytes(need)} ({how}) but the cache "
                f"budget is {format_bytes(budget)} with {format_bytes(used)} in use; "
                f"pinned: {names(pinned)}; busy, loading or being replaced: "
                f"{names(busy)}; always counted: {', '.join(fixed) or 'none'}")

    def admit_run(self, entry: ModelEntry, estimate: Estimate) -> None:
        """Before a run of ``entry`` expected to need ``estimate`` bytes of working
        memory: a need beyond what the model counts already has room made for it (idle
        models evicted, on the cache's thread) and counts from now on; one that cannot
        fit beside the model's load cost, or for which no room can be made, is refused
        when the estimate is reliable (unreliable: the run goes ahead and is measured).

        Raises:
            InferdError (RESOURCE_EXHAUSTED): the run cannot fit, with the figures.
        """
        working = entry.memory.working
        load = entry.memory.load
        budget = self._cache.max_memory
        need = estimate.bytes
        if estimate.settled and (budget is None or load is None
                                 or load.cost + need <= budget):
            return  # measured and admitted at this figure: it counts already
        if budget is None or load is None or need <= 0:
            if need > 0:
                working.admit(estimate)
            return
        if estimate.reliable and load.cost + need > budget:
            raise InferdError(f"model {entry.label}: inputs of this size need "
                              f"{format_bytes(need)} of working memory ({estimate.how}) "
                              f"beside its {format_bytes(load.cost)}, over the cache "
                              f"budget of {format_bytes(budget)}",
                              ErrorCode.RESOURCE_EXHAUSTED)
        if need > working.peak:  # more than the model counts: make room first
            try:
                self.make_room(entry, load.cost + need,
                               f"{format_bytes(need)} of it working memory, "
                               f"{estimate.how}")
            except InferdError as e:
                if estimate.reliable:
                    raise
                log.debug("model %s: no room made for its working memory: %s",
                          entry.label, e.message, extra={"MODEL": entry.name})
        working.admit(estimate)

    def grew(self, entry: ModelEntry) -> None:
        """A run of ``entry`` needed more working memory than any before: it counts now;
        evict idle models if the loaded ones no longer fit (logged if they cannot)."""
        memory = entry.memory
        log.info("model %s: working memory %s; counts %s against the budget", entry.label,
                 format_bytes(memory.working.peak), format_bytes(memory.total()),
                 extra={"MODEL": entry.name})
        self._evict_if_over()

    def _evict_if_over(self) -> None:
        budget = self._cache.max_memory
        if budget is not None and self.used() > budget:
            self._cache.enforce_soon()

    def recost(self, entry: ModelEntry, figures: LoadFigures) -> None:
        """``entry``'s load was measured again (its engine changed under it): it counts
        ``figures.cost`` plus its working memory from now on; idle models are evicted
        (on the cache's thread) if the loaded ones no longer fit."""
        entry.memory.loaded(figures)
        self._evict_if_over()

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        """The memory fields of ``entry``'s ``models`` row."""
        load, working = entry.memory.load, entry.memory.working
        loaded = entry.state in (State.READY, State.DRAINING) and load is not None
        return {"memory_bytes": self.cost(entry) if loaded else None,
                "memory_rss_bytes": load.rss if loaded and load else None,
                "memory_reported_bytes": load.reported if loaded and load else None,
                "memory_working_bytes": working.peak if working.classes else None,
                "working_memory": working.describe()}


class AdmittedModel(LoadedModel):
    """A loaded model whose runs are admitted by the budget first (their working memory
    estimated, room made or the run refused) and measured when their shape class asks
    for it (:class:`~inferd.daemon.memory.WorkingMemory`)."""

    def __init__(self, model: LoadedModel, entry: ModelEntry, budget: MemoryBudget) -> None:
        self.inner = model
        self._entry = entry
        self._working: WorkingMemory = entry.memory.working
        self._budget = budget
        self.inputs = model.inputs
        self.outputs = model.outputs

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        working = self._working
        estimate = working.estimate(inputs)
        self._budget.admit_run(self._entry, estimate)  # may refuse it, before it runs
        if not estimate.measure:
            return working.run(self.inner.run, inputs, outputs)  # type: ignore[no-any-return]

        def run() -> dict[str, NDArray[Any]]:
            return self.inner.run(inputs, outputs)
        result, changed = working.measure(estimate.key, inputs, run)
        if changed:
            self._budget.grew(self._entry)
        return result  # type: ignore[no-any-return]

    def unload(self) -> None:
        self.inner.unload()

    def memory_bytes(self) -> int | None:
        return self.inner.memory_bytes()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def batch_sizes(self) -> BatchSizes | None:
        return self.inner.batch_sizes()  # adaptive batching asks the engine

    def __getattr__(self, name: str) -> Any:  # backend extras (metadata...) pass through
        return getattr(self.inner, name)
