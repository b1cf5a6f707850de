"""Measuring memory: the daemon's resident size and its peak, what a model version costs
once loaded, and what it needs while it runs (its working memory, per input-shape
class). What these figures count against the budget, and what is admitted, is
:mod:`inferd.daemon.budget`'s.

**Load.** A model's cost at load is the daemon's resident-memory growth across the load
and its warm-up (freed heap is handed back to the system first, so a delta is not hidden
by memory an earlier model left in malloc's free lists), plus what a GPU or NPU backend
reports (device memory that RSS does not show). A CPU backend's report counts the same
bytes as the RSS delta, so for it the larger of the two is taken (:func:`model_cost`).

**Working memory.** While it runs a model needs more: onnxruntime's intermediate
tensors, which for the OCR detector on a 736x2048 input are several times the model
itself. The first run of each *shape class* (every input dimension rounded up to a power
of two) is measured: the process's peak resident memory is reset
(``/proc/self/clear_refs``, value 5), the model runs, and the peak above the memory
before the run is that class's working memory. A run of a known class that is more than
``GROWTH`` larger than the largest one measured in it is measured again. Measuring runs
take one process-wide lock, so two of them never mix; other models' runs meanwhile can
only make a figure larger, never smaller.

Where the peak cannot be reset (a kernel without ``clear_refs``), the growth that stays
after the run is taken instead, and that is logged once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from numpy.typing import NDArray

from inferd.ipc.libc import malloc_trim

log = logging.getLogger(__name__)

GROWTH = 1.1
"""A run this much larger (in elements) than the largest measured in its class is
measured again."""

RELIABLE_SCALE = 4
"""An estimate scaled from a measured class at most this many times smaller is trusted
enough to refuse a run that cannot fit (a warm-up's tiny class is not)."""

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class MemoryMeter:
    """This process's resident memory and its peak (one per process: the peak is the
    process's). ``lock`` is held by a measured run, so that two never mix."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.lock = threading.Lock()
        self.resettable = True

    @staticmethod
    def trim() -> None:
        """Return free heap pages to the system (glibc ``malloc_trim``), so that the next
        RSS delta counts new memory rather than reused free lists."""
        malloc_trim()

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def reset_peak(self) -> int:
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


METER = MemoryMeter()
"""The process's meter."""


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
class LoadFigures:
    """A load, measured: what it counts (``cost``), the RSS delta it came from, and
    what the backend reported."""

    cost: int
    rss: int
    reported: int | None


def shape_class(inputs: dict[str, NDArray[Any]]) -> tuple[Any, ...]:
    """Every input's dimensions rounded up to a power of two."""
    return tuple(sorted((name, tuple(1 << max(0, int(d) - 1).bit_length() for d in a.shape))
                        for name, a in inputs.items()))


def _elements(inputs: dict[str, NDArray[Any]]) -> int:
    return sum(int(math.prod(a.shape)) for a in inputs.values())


class WorkingMemory:
    """The working memory of one model version, per shape class, kept across its loads.

    Args:
        label: the model's label, for logs.
        meter: the process's meter.
    """

    def __init__(self, label: str, meter: MemoryMeter = METER) -> None:
        self.label = label
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

    def measure(self, key: tuple[Any, ...], inputs: dict[str, NDArray[Any]],
                run: Callable[[], Any]) -> tuple[Any, bool]:
        """Call ``run()`` and measure its working memory as class ``key``'s; returns its
        result and whether the measurement raised this model's largest figure."""
        with self._meter.lock:
            before = self._meter.reset_peak()
            result = run()
            used = max(0, self._meter.peak_since_reset() - before)
        return result, self.record(key, _elements(inputs), used)

    def record(self, key: tuple[Any, ...], elements: int, used: int) -> bool:
        """Note ``used`` bytes for class ``key``; True if that raised the peak."""
        with self._lock:
            old = self.classes.get(key, (0, 0))
            self.classes[key] = (max(old[0], elements), max(old[1], used))
            grew = used > self.peak
            if grew:
                self.peak = used
        log.debug("model %s: working memory %d bytes for shape class %s", self.label,
                  used, key)
        return grew

    def describe(self) -> list[dict[str, Any]]:
        """One row per shape class measured: its dimensions and its working bytes."""
        with self._lock:
            return [{"shapes": {n: list(s) for n, s in key}, "bytes": b}
                    for key, (_, b) in sorted(self.classes.items())]


class ModelMemory:
    """What one model version was measured to need: its last load, and its working
    memory (kept across loads: the next load reserves both)."""

    def __init__(self, label: str, meter: MemoryMeter = METER) -> None:
        self.load: LoadFigures | None = None
        self.working = WorkingMemory(label, meter)

    def loaded(self, figures: LoadFigures) -> None:
        """A load was measured (or, after the engine changed, measured again)."""
        self.load = figures

    def total(self) -> int | None:
        """Load cost plus the largest working memory; None before the first load."""
        return None if self.load is None else self.load.cost + self.working.peak
