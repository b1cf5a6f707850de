"""What every stage thread (a model's pre, infer and post threads, a graph's node and
task threads) shares: the :data:`STOP` sentinel that ends a stage, the :class:`Busy`
record of the call each thread is in (so a stuck one can be named and given up),
:func:`join_stages`, which waits for stage threads without waiting on a stuck one, and
:class:`Sleeper`, the one thread of a service that sleeps on a condition until woken or
stopped (the watch, the inline ops)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any


class Sleeper:
    """One named daemon thread running ``target``, which sleeps on :attr:`_wake` (a
    condition over :attr:`_lock`) and ends once :attr:`_stopping` is set."""

    def __init__(self, name: str, target: Any) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=target, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it is given 5 s)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(5)


class _Stop:
    def __repr__(self) -> str:
        return "STOP"


STOP = _Stop()
"""The one queue sentinel of model stages and graph nodes: it ends a stage after
everything queued before it. A thread that takes it puts it back for the next thread of
its stage; the last thread of a stage to end passes it to the next stage instead."""


class Busy:
    """What each thread of a group is doing now: the call it began, when, and the
    requests inside it; the one record that :meth:`ModelThreads.stuck` and the graph
    executors read to name a stuck stage, and that ``abandon`` answers."""

    def __init__(self) -> None:
        # thread name -> (stage, since, what, the requests inside the call, what's
        # arguments)
        self._calls: dict[str, tuple[str, float, str, tuple[Any, ...], tuple[Any, ...]]] = {}

    def begin(self, stage: str, what: str, held: tuple[Any, ...] = (),
              *args: Any) -> None:
        """The calling thread begins a call of ``stage``, described by ``what % args``
        (formatted only when read: a model's every run passes here), with the requests
        ``held`` inside it."""
        self._calls[threading.current_thread().name] = (stage, time.monotonic(), what, held,
                                                        args)

    def begin_as(self, name: str, stage: str, what: str, held: tuple[Any, ...] = (),
                 *args: Any) -> None:
        """:meth:`begin` for a call that no thread waits in (a run sent to a worker
        from the I/O thread), named ``name`` where a thread's name would be."""
        self._calls[name] = (stage, time.monotonic(), what, held, args)

    def end(self, name: str | None = None) -> None:
        """The calling thread's call ended (or the one begun as ``name``)."""
        self._calls.pop(threading.current_thread().name if name is None else name, None)

    def oldest(self) -> float | None:
        """When the longest call still running began (monotonic), or None."""
        calls = list(self._calls.values())
        return min((c[1] for c in calls), default=None)

    def held(self) -> list[Any]:
        """The requests inside the calls running now."""
        return [x for c in list(self._calls.values()) for x in c[3]]

    def calls(self, after_s: float = 0.0) -> list[tuple[str, str, float, str]]:
        """(thread, stage, since, what) of each call running for longer than
        ``after_s`` seconds, longest first."""
        now = time.monotonic()
        return sorted(((name, c[0], c[1], c[2] % c[4] if c[4] else c[2])
                       for name, c in list(self._calls.items())
                       if now - c[1] > after_s), key=lambda c: c[2])

    def stuck(self, after_s: float = 0.0) -> list[str]:
        """Each thread inside one call for longer than ``after_s`` seconds, longest first:
        ``"inferd-m-infer-0 (infer: running request r7 for 12.3 s)"``."""
        return [describe_call(*c) for c in self.calls(after_s)]


def describe_call(thread: str, stage: str, since: float, what: str) -> str:
    """One stuck call in words: ``"inferd-m-infer-0 (infer: running request r7 for
    12.3 s)"``."""
    return f"{thread} ({stage}: {what} for {time.monotonic() - since:.1f} s)"


def join_stages(threads: list[threading.Thread], busy: Busy, timeout: float | None,
                stuck_after: float | None) -> bool:
    """Wait for ``threads`` to end: at most ``timeout`` seconds (None: no limit), and no
    longer than it takes one of them to be inside one call (``busy``) for
    ``stuck_after`` seconds. True if every thread ended."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    for t in threads:
        while t.is_alive():
            now = time.monotonic()
            if now >= deadline:
                return False
            until = deadline
            if stuck_after is not None:
                oldest = busy.oldest()
                if oldest is not None and now - oldest > stuck_after:
                    return False
                until = min(until, (now if oldest is None else oldest) + stuck_after)
            t.join(None if math.isinf(until) else max(0.0, until - now) + 0.01)
    return True
