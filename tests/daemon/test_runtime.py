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
from inferd.daemon.runtime import MESSAGE_FLOOR, Runtime, message_bound
from inferd.ipc.staging import INLINE_BYTES


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.parametrize("text, held, want", [
    ("", 256 * 2**20, 32 * 2**10),  # a 2 GB board's "auto": 256 MiB / (4 x 2048)
    ("", 3 * 2**30, 384 * 2**10),  # about a 24 GiB machine's "auto" (2.9 GiB)
    ("", 64 * 2**20, 32 * 2**10),  # the floor
    ("max_connections = 16\n", 2**40, 256 * 2**20),  # the ceiling
    ("", 0, 256 * 2**20),  # max_bytes_in_flight "unlimited": nothing to derive from
    ('max_message_bytes = "8MiB"\n', 256 * 2**20, 8 * 2**20),  # set: as set
])
def test_the_inline_limit_is_derived_from_the_bytes_and_connections_bounds(
        tmp_path, text, held, want):
    """"auto": libzmq may hold two messages per connection, each frame up to twice the
    limit, so 4 x the limit x max_connections stays within max_bytes_in_flight (down to
    the floor, which is what the clients send inline anyway)."""
    path = tmp_path / "inferd.toml"
    path.write_text("[server]\n" + text)
    config = load_config(path)
    got = message_bound(config, held)
    assert got == want
    if not text and held and got > MESSAGE_FLOOR:
        assert 4 * got * config.server.max_connections <= held
    assert MESSAGE_FLOOR == INLINE_BYTES  # no daemon refuses what a client sends inline


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
