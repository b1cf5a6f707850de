"""The memory side of the model cache: budget and keep-alive parsing, measuring what a
model costs, estimating it before the first load, and choosing what to evict.

A model's cost is measured, not guessed: the daemon's resident-memory delta across the
load and its warm-up (freed heap is handed back to the system first, so a delta is not
hidden by memory an earlier model left in malloc's free lists), plus what a GPU or NPU
backend reports (device memory that RSS does not show). A CPU backend's report counts
the same bytes as the RSS delta, so for it the larger of the two is taken instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from inferd.daemon.units import parse_duration
from inferd.ipc.errors import ErrorCode, ModelError

# Before a model's first load its cost is unknown; the demo models cost 2-5x their file
# size in onnxruntime (measured, see bench/bench_cache.py). The estimate only decides
# how much to evict up front; the measured cost is checked against the budget after.
ESTIMATE_FACTOR = 2
ESTIMATE_OVERHEAD = 4 * 2**20


def request_keep_alive(params: dict[str, Any]) -> float | None:
    """The ``keep_alive`` a request's header asks for, in seconds, or None.

    Raises:
        ModelError (INVALID_ARGUMENT): not a duration.
    """
    value = params.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError:
        raise ModelError(f"keep_alive = {value!r}: expected seconds or a duration such "
                         f"as '5m', or 'forever'", ErrorCode.INVALID_ARGUMENT) from None


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
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self._trim = getattr(libc, "malloc_trim", None)  # glibc only

    def trim(self) -> None:
        """Return free heap pages to the system (glibc ``malloc_trim``), so that the next
        RSS delta counts new memory rather than reused free lists."""
        if self._trim is not None:
            self._trim(0)

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
