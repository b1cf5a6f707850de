"""The C allocator's knobs the daemon uses, in one place (glibc only; elsewhere
they do nothing and say so).

- :func:`malloc_trim`: give the free pages of the heap back to the system. Freed
  buffers otherwise stay in malloc's free lists, so the resident size keeps its peak
  after a burst of requests, and a resident-memory delta across a model's load would
  count memory that an earlier model left behind.
- :func:`set_mmap_threshold` (``mallopt(M_MMAP_THRESHOLD)``): blocks at least this big
  are mapped on their own and unmapped when freed, instead of staying in the heap.
- :func:`set_arena_max` (``mallopt(M_ARENA_MAX)``): how many heaps (arenas) threads
  share. glibc gives threads that allocate at once heaps of their own, up to eight per
  core, and what one thread frees stays in its heap for that thread: the daemon's model
  workers and graph threads would each keep the high-water mark of their own runs.

It sits on the ground floor (beside the errors and dtypes) because the wire (the
per-client limits), the backends (the custom-op planner) and the daemon (the cache's
memory meter) all use it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
"""glibc's mallopt parameter number for the trim threshold."""
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number for the mmap threshold."""
M_ARENA_MAX = -8
"""glibc's mallopt parameter number for the most arenas."""


def _function(name: str, argtypes: list[type], restype: type) -> Callable[..., int] | None:
    try:
        fn = getattr(ctypes.CDLL(None), name)  # the C library the process already uses
    except (OSError, AttributeError):  # not glibc (musl has neither)
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn  # type: ignore[no-any-return]


_TRIM = _function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
_MALLOPT = _function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)


def malloc_trim() -> bool:
    """Return the heap's free pages to the system; False where there is no malloc_trim
    (not glibc)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def _mallopt(param: int, value: int, key: str) -> bool:
    """mallopt(``param``, ``value``) for config key ``key``; logs why it did not take."""
    if _MALLOPT is None:
        log.warning("%s ignored: this C library has no mallopt", key)
        return False
    if not _MALLOPT(param, int(value)):
        log.warning("%s = %d refused by mallopt", key, value)
        return False
    return True


def set_mmap_threshold(size: int) -> bool:
    """Fix glibc's mmap threshold at ``size`` bytes (0 or less: leave glibc's sliding
    default), so that blocks this big go back to the system when freed.

    Returns:
        True if the threshold was set; False if ``size`` asks for the default, the C
        library has no mallopt (logged), or mallopt refused the value (logged).
    """
    if size <= 0 or not _mallopt(M_MMAP_THRESHOLD, size, "cache.malloc_mmap_threshold"):
        return False
    _MALLOPT(M_TRIM_THRESHOLD, 2 * int(size))  # type: ignore[misc]
    log.debug("glibc mmap threshold fixed at %d bytes", size)
    return True


def set_arena_max(arenas: int) -> bool:
    """Let glibc make at most ``arenas`` heaps for all threads (0: leave its default of
    eight per core). Threads already given a heap keep it, so call it early.

    Returns:
        True if the limit was set; False if ``arenas`` asks for the default, the C
        library has no mallopt (logged), or mallopt refused the value (logged).
    """
    if arenas <= 0 or not _mallopt(M_ARENA_MAX, arenas, "cache.malloc_arenas"):
        return False
    log.debug("glibc arenas limited to %d", arenas)
    return True
