"""ACL's window split rules, checked for every thread count 1-8 and small windows."""

from __future__ import annotations

import threading

import pytest

from inferd.libbackends.customops.window import Scheduler, split


@pytest.mark.parametrize("threads", range(1, 9))
def test_split_covers_the_window_once_with_acls_rules(threads):
    for start in (0, 5):
        for size in range(0, 41):
            for step in (1, 2, 3, 4, 16):
                end = start + size
                parts = split(start, end, step, threads)
                what = (start, end, step, threads, parts)
                if size == 0:
                    assert parts == [], what
                    continue
                assert 1 <= len(parts) <= threads, what  # at most one per thread
                assert len(parts) == min(threads, -(-size // step)), what  # all it can use
                assert all(s < e for s, e in parts), what  # none empty
                assert parts[0][0] == start and parts[-1][1] == end, what
                assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), what  # exact cover
                assert all((s - start) % step == 0 for s, _ in parts), what  # on the step
                sizes = [-(-(e - s) // step) for s, e in parts]
                assert max(sizes) - min(sizes) <= 1, what  # balanced


def test_scheduler_uses_one_thread_per_sub_window_and_reraises():
    sched = Scheduler(4, "inferd-test-cst")
    seen: list[tuple[int, int, str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(3, timeout=10)

    def fn(s: int, e: int) -> None:
        with lock:
            seen.append((s, e, threading.current_thread().name))
        barrier.wait()  # three sub-windows run at the same time, on three threads

    try:
        assert sched.run(fn, 0, 3, 1) == 3
        assert sorted((s, e) for s, e, _ in seen) == [(0, 1), (1, 2), (2, 3)]
        assert len({n for _, _, n in seen}) == 3

        def boom(s: int, e: int) -> None:
            if s == 2:
                raise ValueError("window 2")

        with pytest.raises(ValueError, match="window 2"):
            sched.run(boom, 0, 4, 1)
    finally:
        sched.close()
