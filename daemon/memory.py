"""Working memory: what a model uses while it runs, measured per input-shape class and
counted in the cache budget; and the process-wide allocator settings that let memory
freed after a run really leave the process.

A model's cost at load (``daemon/cache.py``) is its resident-memory growth across load
and warm-up. While it runs it needs more: onnxruntime's intermediate tensors, which for
the OCR detector on a 736x2048 input are several times the model itself. The first run
of each *shape class* (every input dimension rounded up to a power of two) is measured:
the process's peak resident memory is reset (``/proc/self/clear_refs``, value 5), the
model runs, and the peak above the memory before the run is that class's working
memory. A run of a known class that is more than ``GROWTH`` larger than the largest one
measured in it is measured again. Measuring runs take one process-wide lock, so two of
them never mix; other models' runs meanwhile can only make a figure larger, never
smaller. The model's cost becomes its load cost plus its largest working memory, and
the cache evicts idle models if that no longer fits.

Before a run is measured, the cache is asked to make room for an estimate (the bytes per
element of the largest class measured, times this run's elements), so that a first run
of a large class does not land on top of idle models; a run of a class whose measured
working memory cannot fit the budget beside the model is refused (RESOURCE_EXHAUSTED)
instead of run.

Where the peak cannot be reset (a kernel without ``clear_refs``), the growth that stays
after the run is taken instead, and that is logged once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from inferd.daemon.budget import MemoryBudget, format_bytes
from inferd.daemon.model_entry import ModelEntry, ModelKey, State
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import LoadedModel

log = logging.getLogger(__name__)

GROWTH = 1.1
"""A run this much larger (in elements) than the largest measured in its class is
measured again."""

RELIABLE_SCALE = 4
"""An estimate scaled from a measured class at most this many times smaller is trusted
enough to refuse a run that cannot fit (a warm-up's tiny class is not)."""

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class PeakMeter:
    """The process's peak resident memory, resettable (Linux ``clear_refs``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.resettable = True

    def reset(self) -> int:
        """Reset the peak to the current resident size; returns that size."""
        if self.resettable:
            try:
                _CLEAR_REFS.write_text("5")
            except OSError as e:
                self.resettable = False
                log.warning("cannot reset the peak resident memory (%s): working memory "
                            "is measured as the growth that stays after a run", e)
        return self.read()[0]

    @staticmethod
    def read() -> tuple[int, int]:
        """(current, peak) resident bytes of this process."""
        rss = hwm = 0
        with open(_STATUS, "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        return rss, hwm

    def peak_since_reset(self) -> int:
        rss, hwm = self.read()
        return hwm if self.resettable else rss


PEAKS = PeakMeter()
"""One per process: the peak is process-wide."""


def shape_class(inputs: dict[str, NDArray[Any]]) -> tuple[Any, ...]:
    """Every input's dimensions rounded up to a power of two."""
    return tuple(sorted((name, tuple(1 << max(0, int(d) - 1).bit_length() for d in a.shape))
                        for name, a in inputs.items()))


def _elements(inputs: dict[str, NDArray[Any]]) -> int:
    return sum(int(math.prod(a.shape)) for a in inputs.values())


class WorkingMemory:
    """The working memory of one loaded model, per shape class.

    Args:
        label: the model's label, for logs.
        on_grow: called (from the running thread) with the new largest working memory
            when a measurement raises it.
    """

    def __init__(self, label: str, on_grow: Callable[[int], None] | None = None,
                 meter: PeakMeter = PEAKS,
                 admit: Callable[[int, bool, bool], None] | None = None) -> None:
        self.label = label
        self._on_grow = on_grow
        self._admit = admit
        self._meter = meter
        self._lock = threading.Lock()
        self.classes: dict[tuple[Any, ...], tuple[int, int]] = {}  # class -> (elements, bytes)
        self.peak = 0

    def needs_measuring(self, inputs: dict[str, NDArray[Any]]) -> tuple[Any, ...] | None:
        """The class of ``inputs`` if this run should be measured, else None."""
        key = shape_class(inputs)
        known = self.classes.get(key)
        if known is None or _elements(inputs) > known[0] * GROWTH:
            return key
        return None

    def estimate(self, inputs: dict[str, NDArray[Any]]) -> tuple[int, bool]:
        """Working memory expected for ``inputs``, and whether that is reliable: its
        class's measured figure (reliable), else the bytes per element of the largest
        class measured times its elements (reliable if that class is at most
        ``RELIABLE_SCALE`` times smaller); (0, False) if nothing is known."""
        known = self.classes.get(shape_class(inputs))
        elements = _elements(inputs)
        if known is not None and elements <= known[0] * GROWTH:
            return known[1], True
        if not self.classes:
            return 0, False
        most, used = max(self.classes.values())
        scaled = max(known[1] if known else 0, int(used / max(1, most) * elements))
        return scaled, most * RELIABLE_SCALE >= elements

    def run(self, inputs: dict[str, NDArray[Any]], run: Callable[[], Any]) -> Any:
        """Call ``run()``, measuring it if its shape class asks for that.

        Raises:
            InferdError (RESOURCE_EXHAUSTED): from ``admit``, the run cannot fit.
        """
        key = self.needs_measuring(inputs)
        known = self.classes.get(shape_class(inputs))
        if self._admit is not None and (known is not None or key is not None):
            need, reliable = self.estimate(inputs)
            self._admit(need, key is not None, reliable)
        if key is None:
            return run()
        with self._meter.lock:
            before = self._meter.reset()
            result = run()
            used = max(0, self._meter.peak_since_reset() - before)
        self.record(key, _elements(inputs), used)
        return result

    def record(self, key: tuple[Any, ...], elements: int, used: int) -> None:
        with self._lock:
            old = self.classes.get(key, (0, 0))
            self.classes[key] = (max(old[0], elements), max(old[1], used))
            grew = used > self.peak
            if grew:
                self.peak = used
        log.debug("model %s: working memory %d bytes for shape class %s", self.label,
                  used, key)
        if grew and self._on_grow is not None:
            self._on_grow(used)

    def describe(self) -> list[dict[str, Any]]:
        """One row per shape class measured: its dimensions and its working bytes."""
        with self._lock:
            return [{"shapes": {n: list(s) for n, s in key}, "bytes": b}
                    for key, (_, b) in sorted(self.classes.items())]


class MeasuredModel(LoadedModel):
    """A loaded model whose runs go through its :class:`WorkingMemory`."""

    def __init__(self, model: LoadedModel, working: WorkingMemory) -> None:
        self.inner = model
        self.working = working
        self.inputs = model.inputs
        self.outputs = model.outputs

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        return self.working.run(inputs, lambda: self.inner.run(inputs, outputs))

    def unload(self) -> None:
        self.inner.unload()

    def memory_bytes(self) -> int | None:
        return self.inner.memory_bytes()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def __getattr__(self, name: str) -> Any:  # backend extras (metadata...) pass through
        return getattr(self.inner, name)


class WorkingLedger:
    """The working memory of every model version the cache has loaded, and what it does
    to the budget: a model's figure is its load cost plus its largest working memory.

    Args:
        budget: the cache's memory budget (its recorded costs are kept in step).
        limit: the budget in bytes now, or None.
        entry_of: the cache entry of a model version, if any.
        used: what the loaded models count against the budget now.
        enforce: called (from a worker thread) when the loaded models no longer fit;
            should evict idle ones elsewhere.
    """

    def __init__(self, budget: MemoryBudget, limit: Callable[[], int | None],
                 entry_of: Callable[[ModelKey], ModelEntry | None],
                 used: Callable[[], int], enforce: Callable[[], None]) -> None:
        self.budget = budget
        self._limit = limit
        self._entry_of = entry_of
        self._used = used
        self._enforce = enforce
        self._static: dict[ModelKey, int] = {}
        self._working: dict[ModelKey, WorkingMemory] = {}
        self._lock = threading.Lock()

    def loaded(self, entry: ModelEntry, static: int,
               model: LoadedModel) -> tuple[int, LoadedModel]:
        """A version was loaded at ``static`` bytes: its cost now (load cost plus the
        working memory measured at earlier loads) and the model its workers run."""
        key = (entry.name, entry.version)
        with self._lock:
            self._static[key] = static
            working = self._working.get(key)
            if working is None:
                working = self._working[key] = WorkingMemory(
                    entry.label, lambda peak: self._grew(key, peak),
                    admit=lambda need, new, sure: self._admit(key, need, new, sure))
        return static + working.peak, MeasuredModel(model, working)

    def working(self, key: ModelKey) -> WorkingMemory | None:
        return self._working.get(key)

    def _admit(self, key: ModelKey, need: int, new: bool, reliable: bool) -> None:
        """Before a run (worker thread): a need that cannot fit beside the model's load
        cost is refused if it is measured, or estimated reliably; before a class's first
        run, room is made for the estimate (every idle model if it does not fit)."""
        budget = self._limit()
        entry = self._entry_of(key)
        if budget is None or entry is None or need <= 0:
            return
        static = self._static.get(key, 0)
        if reliable and static + need > budget:
            how = "measured" if not new else "estimated from a measured run"
            raise InferdError(f"model {entry.label}: inputs of this size need "
                              f"{format_bytes(need)} of working memory ({how}) beside its "
                              f"{format_bytes(static)}, over the cache budget of "
                              f"{format_bytes(budget)}", ErrorCode.RESOURCE_EXHAUSTED)
        if not new:
            return  # a measured need is in the model's cost already
        for wanted in (static + need, budget):  # the estimate, else all the room there is
            try:
                self.budget.make_room(entry, min(wanted, budget), "working memory")
                return
            except InferdError as e:  # busy or pinned models: run anyway, measured after
                log.debug("model %s: no room made for its working memory: %s",
                          entry.label, e.message, extra={"MODEL": entry.name})

    def _grew(self, key: ModelKey, peak: int) -> None:
        """A run needed more working memory than any before: count it (worker thread)."""
        total = self._static.get(key, 0) + peak
        self.budget.record(key, total)
        entry = self._entry_of(key)
        if entry is None:
            return
        with entry.lock:
            if entry.state in (State.READY, State.DRAINING):
                entry.memory_bytes = total
        log.info("model %s: working memory %s; counts %s against the budget", entry.label,
                 format_bytes(peak), format_bytes(total), extra={"MODEL": entry.name})
        budget = self._limit()
        if budget is not None and self._used() > budget:
            self._enforce()

    def describe(self, info: dict[str, Any]) -> None:
        """Add ``memory_working_bytes`` and ``working_memory`` to a ``models`` row."""
        working = self._working.get((info["name"], info.get("version")))
        info["memory_working_bytes"] = working.peak if working else None
        info["working_memory"] = working.describe() if working else []
