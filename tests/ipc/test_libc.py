"""ipc/libc.py: the C library's knobs, on this machine's glibc."""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

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


def _handles_a_signal_here_and_in_a_fork(setup: str, *args: str) -> tuple[str, str]:
    """Run ``setup`` in a fresh interpreter (a thread's signal stack is the process's
    own business), then handle SIGUSR1 on its main thread and in a child forked from
    it; (what it printed: the child's wait status and the signals handled here, its
    stderr)."""
    code = setup + """
import os, signal
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
pid = os.fork()
if pid == 0:
    os.kill(os.getpid(), signal.SIGUSR1)
    os._exit(0 if got else 3)
status = os.waitpid(pid, 0)[1]
os.kill(os.getpid(), signal.SIGUSR1)
print(status, len(got))
"""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=120)
    return done.stdout.strip(), done.stderr


@pytest.mark.skipif(not GLIBC, reason="sigaltstack through glibc")
def test_a_signal_stack_changed_in_the_block_is_given_back_and_one_of_our_own_stays():
    out, err = _handles_a_signal_here_and_in_a_fork("""
import ctypes, mmap
from inferd.ipc import libc
before = libc.signal_stack()
with libc.kept_signal_stack():
    region = mmap.mmap(-1, 65536)
    view = ctypes.c_char.from_buffer(region)
    assert libc._set_signal_stack(ctypes.addressof(view), 65536, 0)
    assert libc.signal_stack() != before
    del view
assert libc.signal_stack() == before, (libc.signal_stack(), before)
region.close()  # unmapped: it is no thread's stack any more
assert libc.own_signal_stack()
address, size, flags = libc.signal_stack()
assert address and size == libc.SIGNAL_STACK_SIZE and flags == 0
""")
    assert out == "0 1", err


@pytest.mark.skipif(not GLIBC, reason="sigaltstack through glibc")
@pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                    reason="the openvino wheel is not installed")
def test_a_model_loaded_on_openvino_and_dropped_on_another_thread_leaves_no_stack_gone(
        models_dir: Path) -> None:
    """OpenVINO's CPU plugin maps an alternate signal stack for the thread on which its
    Core compiles a first model, and unmaps it when the Core is destroyed, putting the
    old stack back only if that happens on the same thread. A model loaded as the daemon
    and its workers load one (load_planned) on the main thread, its backend dropped on
    another thread: the main thread's stack must still be mapped, there and in a process
    forked from it. Before kept_signal_stack both died of SIGSEGV on their first signal
    with a handler (the worker zygote of a test process on its first SIGCHLD: the CI
    failures of stop 39)."""
    out, err = _handles_a_signal_here_and_in_a_fork("""
import faulthandler, gc, sys, threading
from pathlib import Path
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.customops.plan import load_planned
from inferd.libbackends.openvino_backend import OpenVinoBackend
faulthandler.enable()  # as pytest and the daemon have it: a stack of its own
path = Path(sys.argv[1])
held = [OpenVinoBackend()]
held.append(load_planned(held[0], path, LoadOptions(), model="cls", model_dir=path.parent,
                         ops=None, fallbacks=[]))
assert type(held[1]).__name__ == "OvModel" and held[1].device == "CPU", held[1]
dropper = threading.Thread(target=lambda: (held.clear(), gc.collect()))
dropper.start()
dropper.join()
""", str(models_dir / "ocr-cls" / "1" / "model.onnx"))
    assert out == "0 1", err
