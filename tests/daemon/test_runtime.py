"""A Runtime in this process: starts, serves, stops, and leaks no thread or socket."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from inferd.daemon.config import load_config
from inferd.daemon.runtime import Runtime


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_two_runtimes_in_one_process_start_serve_stop_without_leaks(models_dir, short_tmp):
    import onnxruntime  # noqa: F401  (imported once per process; not a leak)
    try:  # its import starts openvino_telemetry's thread pool, once per process
        import openvino  # noqa: F401
    except ImportError:
        pass
    from zmq.utils.garbage import gc as zmq_gc

    if not zmq_gc.is_alive():
        zmq_gc.start()  # pyzmq's process-wide thread for zero-copy frames, started lazily
    threads_before = set(threading.enumerate())
    fds_before = _fds()
    runtimes = []
    for i in range(2):
        cfg = load_config(None, {"server.socket": f"ipc://{short_tmp}/r{i}.sock",
                                 "models.repository": str(models_dir),
                                 "models.preload": ["ocr-cls"]})
        rt = Runtime(cfg)
        rt.start()
        t = threading.Thread(target=rt.serve, name=f"test-serve-{i}")
        t.start()
        runtimes.append((rt, t))
    np.save(short_tmp / "x.npy", np.zeros((1, 3, 48, 192), np.float32))
    for rt, _ in runtimes:
        assert rt.ready.wait(30)
        # The client runs in another process so that only the runtimes' own fds and
        # threads are counted here.
        r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                            rt.config.server.socket, "infer", "ocr-cls", "-i",
                            f"x={short_tmp / 'x.npy'}"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and "float32[1, 2]" in r.stdout, r.stderr
    for rt, t in runtimes:
        rt.stop()
        t.join(30)
        assert not t.is_alive()
    # daemon threads end asynchronously after join returns from their targets
    leftover = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    for t in leftover:
        t.join(5)
    leftover = [t.name for t in leftover if t.is_alive()]
    assert leftover == []
    assert not list(short_tmp.glob("*.sock"))
    # libzmq's reaper thread releases closed sockets' fds asynchronously: poll.
    deadline = time.monotonic() + 10
    while (leaked := _fds() - fds_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leaked == set(), {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in leaked
                             if os.path.exists(f"/proc/self/fd/{fd}")}
