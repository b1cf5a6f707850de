"""The C library's knobs the daemon uses, in one place (glibc only; elsewhere
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
- :func:`kept_signal_stack` and :func:`own_signal_stack`: a thread's alternate signal
  stack (``sigaltstack``), where the kernel writes the frame of a signal handler. An
  engine may leave one of its own on the thread that loaded it and unmap it later (see
  :func:`kept_signal_stack`): the next signal handled on that thread, or in a process
  forked from it, then dies of SIGSEGV.

It sits on the ground floor (beside the errors and dtypes) because the wire (the
per-client limits), the backends (the custom-op planner) and the daemon (the cache's
memory meter) all use it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


class _Stack(ctypes.Structure):
    """``stack_t``."""

    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int),
                ("ss_size", ctypes.c_size_t)]


_SIGALTSTACK = _function("sigaltstack", [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)
SS_DISABLE = 2
SS_AUTODISARM = 1 << 31
_SETTABLE = SS_DISABLE | SS_AUTODISARM
SIGNAL_STACK_SIZE = 64 * 1024
"""The size of :func:`own_signal_stack`'s stack: the kernel's frame for a handler is a few
KiB (the CPU's vector registers: about 3.5 KiB with AVX-512, 11 KiB with AMX), and
faulthandler's handler runs on it too."""
_owned: list[mmap.mmap] = []  # the stacks own_signal_stack installed: never unmapped


def signal_stack() -> tuple[int, int, int] | None:
    """This thread's alternate signal stack: (address, size, flags), address 0 and
    flags with SS_DISABLE when there is none; None where there is no sigaltstack."""
    if _SIGALTSTACK is None:
        return None
    now = _Stack()
    if _SIGALTSTACK(None, ctypes.byref(now)) != 0:
        return None
    return (now.ss_sp or 0, now.ss_size, now.ss_flags)


def _set_signal_stack(address: int, size: int, flags: int) -> bool:
    stack = _Stack(address or None, flags & _SETTABLE, size)
    return _SIGALTSTACK is not None and _SIGALTSTACK(ctypes.byref(stack), None) == 0


@contextmanager
def kept_signal_stack() -> Iterator[None]:
    """Run the block, then give this thread back the alternate signal stack it had
    before, if the block changed it.

    For a model's load: an engine may install a stack of its own on the thread that
    loads it and unmap it when it is destroyed, putting the old one back only if that
    happens on the same thread. OpenVINO's CPU plugin does (2026.4 here: 11.3 KiB,
    mapped when a Core compiles its first model): destroyed on another thread (the
    last reference to a Core dropped or collected there), it leaves the loading thread's
    alternate stack pointing at unmapped memory, and the next signal with a handler on
    that thread, or in a process forked from it (the worker zygote's SIGCHLD), dies of
    SIGSEGV: the kernel cannot write the handler's frame (tests/ipc/test_libc.py). Put
    back at once, the engine's stack is never any thread's, and its unmapping harms
    none; the engine loses only a stack for its own handlers on a stack overflow.
    """
    before = signal_stack()
    try:
        yield
    finally:
        if before is not None and signal_stack() != before:
            _set_signal_stack(*before)


def own_signal_stack() -> bool:
    """Give this thread an alternate signal stack of its own, mapped for good, in place
    of whatever it had (which may be gone: :func:`kept_signal_stack`). For a process
    forked from a thread that ran engines: the worker zygote, whose workers inherit it.

    Returns:
        False where the C library has no sigaltstack or it refused (the old one stays).
    """
    if _SIGALTSTACK is None:
        return False
    stack = mmap.mmap(-1, SIGNAL_STACK_SIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(stack))
    if not _set_signal_stack(address, SIGNAL_STACK_SIZE, 0):
        return False
    _owned.append(stack)
    return True
