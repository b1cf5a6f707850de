"""ipc/libc.py: the C allocator's knobs, on this machine's glibc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from inferd.ipc import libc

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim and mallopt are glibc's")
def test_trim_and_threshold_are_found_on_glibc():
    assert libc.malloc_trim() is True
    assert libc.set_mmap_threshold(0) is False  # 0: glibc's sliding default stays


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_blocks_over_the_threshold_leave_the_process_when_freed():
    # Process-wide: in a fresh interpreter. Freeing an 8 MiB block raises glibc's
    # sliding threshold to 8 MiB, so 1 MiB blocks would then come from the heap, and
    # freeing every other one would give nothing back (measured: 128 MiB held, 128
    # left). Over a fixed 512 KiB threshold each is mapped on its own and leaves at once.
    code = """if True:
        import psutil
        from inferd.ipc.libc import set_mmap_threshold
        assert set_mmap_threshold(512 * 1024)
        block = bytearray(8 * 2**20)
        del block
        proc = psutil.Process()
        before = proc.memory_info().rss
        blocks = [bytearray(b"x") * 2**20 for _ in range(128)]
        held = proc.memory_info().rss - before
        del blocks[::2]
        left = proc.memory_info().rss - before
        print(held, left)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    held, left = int(out[0]), int(out[1])
    assert held >= 100 * 2**20, held
    assert left < held // 2 + 16 * 2**20, (held, left)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
@pytest.mark.parametrize("limit", [0, 2])
def test_the_arena_limit_bounds_the_heaps_threads_get(limit: int) -> None:
    # Process-wide: in a fresh interpreter. Each new thread that allocates gets a heap
    # (arena) of its own, up to eight per core; with the limit they share at most
    # ``limit``. glibc's malloc_stats() prints one "Arena N:" block per heap to stderr.
    code = f"""if True:
        import ctypes, threading
        from inferd.ipc.libc import set_arena_max
        assert set_arena_max({limit}) is {limit > 0}
        start, done = threading.Barrier(7), threading.Event()
        def work():
            block = bytearray(1 << 20)  # a malloc on this thread
            start.wait()
            done.wait()
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        start.wait()
        ctypes.CDLL(None).malloc_stats()
        done.set()
        for t in threads:
            t.join()
    """
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stderr
    arenas = err.count("Arena ")
    if limit:
        assert 1 <= arenas <= limit, err
    else:
        assert arenas >= 3, err  # the main heap and the threads' own (2 cores: up to 16)
