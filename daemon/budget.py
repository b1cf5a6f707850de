"""The memory budget of the model cache (``[cache] max_memory``): what each model counts
against it, and what it would take to fit more. Pure decisions: it changes no entry and
evicts nothing; the cache (:class:`~inferd.daemon.models.ModelManager`, the one owner of
the entries) asks it and performs every eviction itself.

Accounting: a loading model counts what its load reserved (``ModelEntry.reserved``: its
figure from its last load, else a guess from its file size, then its measured cost); a
ready or draining one its measured load cost plus the largest working memory it has
needed (:class:`~inferd.daemon.memory.ModelMemory`) plus its streams' state; beside the
entries, the engines imported into the daemon and the reservations of rivals on trial
(:meth:`MemoryBudget.reserve`), the only bytes the budget keeps itself. Verdicts: room for
a load or a run (:meth:`MemoryBudget.room`) names the idle unpinned models to evict,
least recently used first, or refuses with RESOURCE_EXHAUSTED and the figures; what a run
needs beyond what its model counts (:meth:`MemoryBudget.run_need`). Pinned models, busy
ones and the old version during a swap are never victims.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from inferd.daemon.memory import METER, Estimate
from inferd.daemon.model_entry import ModelEntry, State
from inferd.ipc.errors import ErrorCode, InferdError

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


@dataclass(frozen=True)
class Verdict:
    """What it takes to fit: ``need`` bytes (what was asked, or the floor that will do)
    once ``victims`` are evicted (none: it fits now)."""

    need: int
    victims: tuple[ModelEntry, ...] = ()


class MemoryBudget:
    """The budget's figures and verdicts for one cache. It holds no entry: each call is
    given the entries to judge, the budget in force and which entries may be evicted."""

    def __init__(self) -> None:
        self._holding: dict[int, int] = {}  # reservations (reserve) by token
        self._tokens = itertools.count()
        self._engines: dict[str, int] = {}  # engines imported: what each added
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- accounting

    @staticmethod
    def cost(entry: ModelEntry) -> int:
        """Bytes ``entry`` counts against the budget now."""
        state = entry.state
        if state is State.LOADING:
            return entry.reserved
        if state in (State.READY, State.DRAINING):  # and its streams' state
            return (entry.memory.total() or 0) + entry.streams.nbytes()
        return 0

    def used(self, entries: Sequence[ModelEntry]) -> int:
        """What ``entries``, the engines they brought in and the reservations count."""
        return self.fixed() + sum(self.cost(e) for e in entries)

    def fixed(self) -> int:
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

    def worker_holds(self, name: str, held: int) -> None:
        """A worker that holds no model (the processors worker) holds ``held`` bytes,
        counted as an engine is; 0: it ended, nothing of it is counted."""
        with self._lock:
            if held > 0:
                self._engines[name] = held
            else:
                self._engines.pop(name, None)

    def engines(self) -> dict[str, int]:
        """Every engine imported, and what it added (``inferctl status``)."""
        with self._lock:
            return dict(self._engines)

    @contextmanager
    def reserve(self, label: str, need: int, used: int, budget: int | None,
                runs_here: bool = True) -> Iterator[None]:
        """Count ``need`` bytes as used while the block runs (a candidate engine being
        measured beside the model it may replace), beside ``used`` bytes in use now;
        ``runs_here``: the candidate loads and runs in the daemon's own process, so a
        model's run measured meanwhile is not measured alone (a candidate in a worker of
        its own touches no other process's memory).

        Raises:
            InferdError (RESOURCE_EXHAUSTED): ``need`` does not fit.
        """
        if budget is not None and used + need > budget:
            raise InferdError(f"{label} needs {format_bytes(need)} but the cache budget is "
                              f"{format_bytes(budget)} with {format_bytes(used)} in use",
                              ErrorCode.RESOURCE_EXHAUSTED)
        token = next(self._tokens)
        with self._lock:
            self._holding[token] = need
        try:
            # what runs meanwhile in this process (loads and runs of engines on trial)
            # is no model's working memory: a measurement taken then is dropped
            with METER.running() if runs_here else nullcontext():
                yield
        finally:
            with self._lock:
                del self._holding[token]

    # ----------------------------------------------------------------- verdicts

    def room(self, entry: ModelEntry | None, need: int, how: str,
             entries: Sequence[ModelEntry], budget: int | None,
             pinned: Callable[[ModelEntry], bool], floor: int | None = None) -> Verdict:
        """What it takes for ``need`` bytes (what ``entry`` counts now included) to fit
        beside every other entry: nothing, or the least recently used evictable entries
        to evict first; failing that, the same for ``floor``.

        Args:
            entry: the model the room is for (None: only the budget itself is checked).
            need: bytes it needs in all.
            how: how ``need`` was found, for the message.
            entries: every entry of the cache.
            budget: ``[cache] max_memory`` now, or None for none.
            pinned: whether an entry is pinned (never evicted; nor is a busy or kept
                one: ``ModelEntry.evictable``).
            floor: bytes that would do if ``need`` cannot be had.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): nothing evictable makes enough room.
        """
        if budget is None:
            return Verdict(need)
        others = [e for e in entries if e is not entry]
        used = self.used(others)
        candidates = [Evictable(e, self.cost(e), e.used_at) for e in others
                      if e.evictable() and not pinned(e)]
        wants = [need] if floor is None or floor >= need else [need, floor]
        for want in wants:
            if used + want <= budget:
                return Verdict(want)
            victims = choose_victims(candidates, used + want - budget)
            if victims is not None:
                return Verdict(want, tuple(v.key for v in victims))
        raise InferdError(self._no_room(entry, need, how, budget, used, others, pinned),
                          ErrorCode.RESOURCE_EXHAUSTED)

    def _no_room(self, entry: ModelEntry | None, need: int, how: str, budget: int,
                 used: int, others: list[ModelEntry],
                 is_pinned: Callable[[ModelEntry], bool]) -> str:
        def names(entries: list[ModelEntry]) -> str:
            return ", ".join(f"{e.label} ({format_bytes(self.cost(e))})"
                             for e in entries) or "none"
        holding = [e for e in others if self.cost(e)]
        pinned = [e for e in holding if is_pinned(e)]
        busy = [e for e in holding if e not in pinned and not e.evictable()]
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

    @staticmethod
    def run_need(entry: ModelEntry, estimate: Estimate, budget: int | None) -> int:
        """Before a run of ``entry`` expected to need ``estimate`` bytes of working
        memory: the bytes (load cost plus working memory) to make room for first, or 0
        when what the model counts covers it (or nothing is known to count).

        Raises:
            InferdError (RESOURCE_EXHAUSTED): a reliable estimate that cannot fit beside
                the model's load cost, with the figures.
        """
        working, load = entry.memory.working, entry.memory.load
        need = estimate.bytes
        if estimate.settled and (budget is None or load is None
                                 or load.cost + need <= budget):
            return 0  # measured and admitted at this figure: it counts already
        if budget is None or load is None or need <= 0:
            return 0
        if estimate.reliable and load.cost + need > budget:
            raise InferdError(f"model {entry.label}: inputs of this size need "
                              f"{format_bytes(need)} of working memory ({estimate.how}) "
                              f"beside its {format_bytes(load.cost)}, over the cache "
                              f"budget of {format_bytes(budget)}",
                              ErrorCode.RESOURCE_EXHAUSTED)
        return load.cost + need if need > working.peak else 0

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        """The memory fields of ``entry``'s ``models`` row."""
        load, working = entry.memory.load, entry.memory.working
        loaded = entry.state in (State.READY, State.DRAINING) and load is not None
        return {"memory_bytes": self.cost(entry) if loaded else None,
                "memory_rss_bytes": load.rss if loaded and load else None,
                "memory_reported_bytes": load.reported if loaded and load else None,
                "memory_working_bytes": working.peak if working.classes else None,
                "working_memory": working.describe()}
