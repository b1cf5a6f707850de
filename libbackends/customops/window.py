"""ACL's window split: one window [start, end) along an op's split dimension, cut into
sub-windows for the model's threads.

The rules (Arm Compute Library's ``IScheduler`` / ``Window::split_window``): at most one
sub-window per thread, none empty, every boundary but the window's own end on a multiple
of the op's step from ``start``, sizes differing by at most one step, in order, covering
the window exactly once. A window smaller than the thread count uses fewer threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def split(start: int, end: int, step: int, threads: int) -> list[tuple[int, int]]:
    """Sub-windows of [start, end) for ``threads`` threads, boundaries on ``step``."""
    if end <= start:
        return []
    step = max(1, step)
    steps = -(-(end - start) // step)  # iterations of one step (the last may be short)
    parts = max(1, min(threads, steps))
    base, extra = divmod(steps, parts)
    out = []
    at = start
    for k in range(parts):
        n = base + (1 if k < extra else 0)
        stop = min(end, at + n * step)
        out.append((at, stop))
        at = stop
    return out


class Scheduler:
    """Runs one call per sub-window on the model's threads: the caller's thread takes
    the first sub-window, a pool of ``threads - 1`` named threads the others.

    Args:
        threads: the model's threads.
        name: thread name prefix (``inferd-<model>-cst``).
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=name) \
            if self.threads > 1 else None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[int, int], None], start: int, end: int, step: int) -> int:
        """Call ``fn(sub_start, sub_end)`` for each sub-window; re-raises the first
        failure after all finished. Returns the number of sub-windows."""
        parts = split(start, end, step, self.threads)
        if len(parts) <= 1 or self._pool is None:
            for s, e in parts:
                fn(s, e)
            return len(parts)
        futures = [self._pool.submit(fn, s, e) for s, e in parts[1:]]
        error: BaseException | None = None
        try:
            fn(*parts[0])
        except BaseException as e:  # noqa: BLE001  re-raised once the others are done
            error = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001  the first failure wins
                error = error or e
        if error is not None:
            raise error
        return len(parts)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
