"""The memory budget of the model cache (``[cache] max_memory``): what each loaded model
costs (measured), what a model not yet loaded will need (estimated, then measured at its
first load), which idle models to evict to make room, and which must not be (pinned,
busy, held during a swap).

A model's cost is measured, not guessed: the daemon's resident-memory delta across the
load and its warm-up (freed heap is handed back to the system first, so a delta is not
hidden by memory an earlier model left in malloc's free lists), plus what a GPU or NPU
backend reports (device memory that RSS does not show). A CPU backend's report counts
the same bytes as the RSS delta, so for it the larger of the two is taken instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

from inferd.daemon.model_entry import ModelEntry, ModelKey, State
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.ipc.libc import malloc_trim

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


class MemoryMeter:
    """Resident memory of this process, with freed heap handed back first."""

    def __init__(self) -> None:
        self._proc = psutil.Process()

    def trim(self) -> None:
        """Return free heap pages to the system (glibc ``malloc_trim``), so that the next
        RSS delta counts new memory rather than reused free lists."""
        malloc_trim()

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)


def model_cost(rss_delta: int, reported: int | None, device_memory: bool) -> int:
    """What a loaded model counts against the budget (see the module docstring).

    Args:
        rss_delta: resident-memory growth of the daemon across load and warm-up.
        reported: what the backend says the model uses, if it can tell.
        device_memory: True when the backend's report is memory outside the process
            (a GPU or NPU backend), False when it is host memory (a CPU backend).
    """
    rss_delta = max(rss_delta, 0)
    if device_memory:
        return rss_delta + (reported or 0)
    return max(rss_delta, reported or 0)


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


NOBODY = ModelEntry("-", 0, 1)
"""Stands for "no model" when only the budget itself is checked."""


class MemoryBudget:
    """Keeps the loaded models inside ``[cache] max_memory``.

    Args:
        limit: the budget in bytes now, or None for none (the config may change).
        entries: every model entry of the cache.
        pinned: whether an entry is pinned (never evicted).
        evict: unloads an entry if it is still idle; False if it was not.
    """

    def __init__(self, limit: Callable[[], int | None],
                 entries: Callable[[], list[ModelEntry]],
                 pinned: Callable[[ModelEntry], bool],
                 evict: Callable[[ModelEntry, str], bool]) -> None:
        self._limit = limit
        self._entries = entries
        self._pinned = pinned
        self._evict = evict
        self.meter = MemoryMeter()
        self._measured: dict[ModelKey, int] = {}
        self._held: set[ModelKey] = set()
        self._lock = threading.Lock()

    def measured(self, key: ModelKey) -> int | None:
        """The cost measured at ``key``'s last load, if any."""
        return self._measured.get(key)

    def record(self, key: ModelKey, cost: int) -> None:
        self._measured[key] = cost

    def evictable(self, entry: ModelEntry) -> bool:
        """Ready, idle, unpinned and not held (caller may hold ``entry.lock``)."""
        return (entry.state is State.READY and not entry.in_flight
                and not self._pinned(entry) and (entry.name, entry.version) not in self._held)

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

    def make_room(self, entry: ModelEntry, need: int, how: str,
                  floor: int | None = None) -> int:
        """Evict idle unpinned models, least recently used first, until ``need`` more
        bytes fit in the budget beside every other entry (or, failing that, ``floor``).

        Returns:
            The bytes made room for: ``need``, or ``floor``.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): nothing evictable makes enough room.
        """
        wanted = need
        while True:
            budget = self._limit()
            if budget is None:
                return need
            others = [e for e in self._entries() if e is not entry]
            used = sum(e.cost() for e in others)
            if used + need <= budget:
                return need
            candidates = [Evictable(e, e.cost(), e.used_at) for e in others
                          if self.evictable(e)]
            victims = choose_victims(candidates, used + need - budget)
            if victims is None and floor is not None and floor < need:
                need = floor
                continue
            if victims is None:
                raise InferdError(self._no_room(entry, wanted, how, budget, used, others),
                                  ErrorCode.RESOURCE_EXHAUSTED)
            for v in victims:
                self._evict(v.key, f"evicted to make room for {entry.label} within the "
                                   f"cache budget ({format_bytes(budget)})")

    def enforce(self) -> None:
        """Evict idle unpinned models until the loaded ones fit (after the budget
        shrank); raises RESOURCE_EXHAUSTED naming what does not fit."""
        self.make_room(NOBODY, 0, "")

    def _no_room(self, entry: ModelEntry, need: int, how: str, budget: int, used: int,
                 others: list[ModelEntry]) -> str:
        def names(entries: list[ModelEntry]) -> str:
            return ", ".join(f"{e.label} ({format_bytes(e.cost())})" for e in entries) \
                or "none"
        holding = [e for e in others if e.cost()]
        pinned = [e for e in holding if self._pinned(e)]
        busy = [e for e in holding if e not in pinned and not self.evictable(e)]
        return (f"model {entry.label} needs {format_bytes(need)} ({how}) but the cache "
                f"budget is {format_bytes(budget)} with {format_bytes(used)} in use; "
                f"pinned: {names(pinned)}; busy, loading or being replaced: "
                f"{names(busy)}")
