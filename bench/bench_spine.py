"""Spine benchmarks (issue 2): the daemon's round trip against raw pyzmq, and its model
throughput against in-process onnxruntime, all measured in this run.

1. small request: a one-element identity model through the daemon vs a raw pyzmq
   DEALER/ROUTER echo over ipc:// (p50 latency; target ratio <= 1.5);
2. a 4.9 MB float32 tensor (1x3x640x640) identity round trip vs raw echo of the same
   bytes (p50; target <= 1.3);
3. ocr-cls batch 1, 4 concurrent clients vs in-process onnxruntime with the same thread
   budget (1 intra-op thread; throughput; target >= 0.9);
4. the daemon's resident memory with no model loaded.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODELS, DaemonProcess, cpu_note, fmt_us, make_identity_model, pct, run_client_processes,
    verdict,
)

from inferd.ipc import Client  # noqa: E402


def echo_server(endpoint: str, ready: mp.Event) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    ready.set()
    while True:
        frames = s.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"quit":
            break
        s.send_multipart(frames, copy=False)
    s.close(0)
    ctx.term()


def raw_echo_latency(payload: bytes, n: int) -> list[float]:
    d = Path(tempfile.mkdtemp(prefix="inferd-e", dir="/tmp"))
    endpoint = f"ipc://{d}/echo.sock"
    ready = mp.Event()
    p = mp.Process(target=echo_server, args=(endpoint, ready))
    p.start()
    ready.wait(10)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    times = []
    for i in range(n + n // 10):
        t0 = time.perf_counter()
        s.send(payload, copy=False)
        s.recv(copy=False)
        if i >= n // 10:
            times.append(time.perf_counter() - t0)
    s.send(b"quit")
    p.join(10)
    s.close(0)
    ctx.term()
    shutil.rmtree(d, ignore_errors=True)
    return times


def daemon_latency(endpoint: str, model: str, x: np.ndarray, n: int) -> list[float]:
    times = []
    with Client(endpoint, timeout=30) as c:
        for i in range(n + n // 10):
            t0 = time.perf_counter()
            c.infer(model, {"x": x})
            if i >= n // 10:
                times.append(time.perf_counter() - t0)
    return times


def _cls_client(endpoint: str, images: list[np.ndarray], barrier: Any) -> None:
    with Client(endpoint, timeout=60) as c:
        c.infer("ocr-cls", {"x": images[0]})
        barrier.wait()
        for x in images:
            c.infer("ocr-cls", {"x": x})


def cls_throughput_daemon(endpoint: str, images: list[np.ndarray], clients: int) -> float:
    """Requests per second from ``clients`` client processes."""
    per = len(images) // clients
    elapsed = run_client_processes(
        _cls_client, [(endpoint, images[k * per:(k + 1) * per]) for k in range(clients)])
    return per * clients / elapsed


def cls_throughput_inprocess(images: list[np.ndarray]) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(str(MODELS / "ocr-cls" / "1" / "model.onnx"), so,
                             providers=["CPUExecutionProvider"])
    s.run(None, {"x": images[0]})
    t0 = time.perf_counter()
    for x in images:
        s.run(None, {"x": x})
    return len(images) / (time.perf_counter() - t0)


def main() -> None:
    print(f"machine: {cpu_note()}")
    repo = Path(tempfile.mkdtemp(prefix="inferd-r", dir="/tmp"))
    make_identity_model(repo, "identity", rank=1)
    make_identity_model(repo, "identity4", rank=4)
    # Only the model file: batch 1, no pipeline settings from the demo's model.toml.
    shutil.copytree(MODELS / "ocr-cls" / "1", repo / "ocr-cls" / "1")

    daemon = DaemonProcess("--models", str(repo))
    rss_idle = daemon.rss()
    with Client(daemon.endpoint) as c:
        c.load("identity")
        c.load("identity4")
        c.load("ocr-cls")

    n = 3000
    small = np.ones(1, dtype=np.float32)
    raw = raw_echo_latency(small.tobytes(), n)
    ours = daemon_latency(daemon.endpoint, "identity", small, n)
    r = pct(ours, 0.5) / pct(raw, 0.5)
    print(f"\n1. small request, p50 over {n}: raw pyzmq echo {fmt_us(pct(raw, .5))}, "
          f"inferd {fmt_us(pct(ours, .5))}  (p99 raw {fmt_us(pct(raw, .99))}, "
          f"inferd {fmt_us(pct(ours, .99))})")
    print(f"   {verdict(r, 1.5, higher_is_better=False)}")

    big = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
    n = 300
    raw = raw_echo_latency(big.tobytes(), n)
    ours = daemon_latency(daemon.endpoint, "identity4", big, n)
    r = pct(ours, 0.5) / pct(raw, 0.5)
    print(f"\n2. {big.nbytes / 1e6:.1f} MB tensor, p50 over {n}: raw pyzmq echo "
          f"{pct(raw, .5) * 1e3:.2f} ms, inferd {pct(ours, .5) * 1e3:.2f} ms")
    print(f"   {verdict(r, 1.3, higher_is_better=False)}")

    rng = np.random.default_rng(1)
    images = [rng.random((1, 3, 48, 192), dtype=np.float32) for _ in range(800)]
    # Best of three, alternating the arms: this 2-vCPU machine is noisy.
    base = ours_tp = 0.0
    for _ in range(3):
        base = max(base, cls_throughput_inprocess(images))
        ours_tp = max(ours_tp, cls_throughput_daemon(daemon.endpoint, images, clients=4))
    print(f"\n3. ocr-cls batch 1, best of 3: in-process onnxruntime (1 thread) {base:.0f} req/s, "
          f"inferd with 4 client processes {ours_tp:.0f} req/s")
    print(f"   {verdict(ours_tp / base, 0.9, higher_is_better=True)}")

    print(f"\n4. daemon resident memory with no model loaded: {rss_idle / 2**20:.1f} MiB")
    daemon.stop()
    shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
