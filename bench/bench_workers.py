"""Engines in worker processes (issue 30): what the hop to a worker costs, against the
same daemon with its engines in-process and a raw pyzmq echo, in one run.

Figures (each daemon arm is the same build, only ``[workers] isolation`` differs):

1. 16-byte infer on an Identity model, p50, as a ratio to the raw echo (goal: the worker
   arm within +0.3 of the in-process one).
1b. the same under docs/configuration.md's latency tuning (``[server] cpu_affinity =
   [0]`` and the model's ``cpu_affinity = [0]``; the echo on core 0 too): the worker's
   thread that runs the model then shares the I/O thread's core, so the hop wakes no
   other core (a cross-core wake-up each way is most of a bare hop on a virtual
   machine).
2. 4.9 MB infer round trip (Identity), p50, ratio to the raw echo of the same frames
   (target <= 1.4 for the worker arm).
2b. the same 4.9 MB in and out through shared memory (a registered region: the input
   named by reference, the output written into the region with ``outputs_into``), p50,
   ratio to the raw echo of the 4.9 MB frame (target <= 0.5 for the worker arm: no copy
   between the daemon and the worker).
3. ocr-cls batch 1 and 8, one client: requests/s of each arm and of in-process
   onnxruntime (the worker arm must not fall below the in-process one).
4. Crash to served again: the ocr-cls worker SIGKILLed, the time until its next request
   is answered (p50 of 5; target <= 2 s).
5. Start of a worker: the fork alone (from the daemon's log line).

Run: ``.venv/bin/python bench/bench_workers.py`` (about 2 minutes;
``BENCH_WORKERS_SHM_ONLY=1``: figures 1, 2 and 2b only, about 30 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spine import Echo, cls_session, interleaved  # noqa: E402
from common import (  # noqa: E402
    MODELS, DaemonProcess, cpu_note, make_identity_model, median, pct, verdict,
)

from inferd.ipc import Client, Region  # noqa: E402
from inferd.ipc.protocol import Request, encode_request, Op  # noqa: E402


def repo_with_identity() -> Path:
    repo = Path(tempfile.mkdtemp(prefix="inferd-bw", dir="/tmp"))
    make_identity_model(repo, "identity", rank=1)
    for name in ("ocr-cls",):
        shutil.copytree(MODELS / name, repo / name)
    return repo


def daemon(repo: Path, isolation: str, server: str = "",
           preload: str = "identity,ocr-cls") -> DaemonProcess:
    conf = Path(tempfile.mkdtemp(prefix="inferd-bc", dir="/tmp")) / "inferd.toml"
    conf.write_text(f'[workers]\nisolation = "{isolation}"\n[metrics]\ntextfile = ""\n'
                    '[placement]\nmode = "first"\n[logging]\nlevel = "info"\n'
                    f'[server]\n{server}')
    d = DaemonProcess("--models", str(repo), "--preload", preload, config=conf)
    return d


def print_hop(title: str, t: dict[str, list[float]]) -> tuple[float, float]:
    """Print figure 1's rows (each arm's p50 and p99, ratio to the echo) and the hop;
    returns the echo's p50 and the hop (seconds)."""
    e = median(t["echo"])
    print(f"\n{title}")
    for k in t:
        print(f"   {k:11s} {median(t[k]) * 1e6:8.1f} µs  p99 {pct(t[k], .99) * 1e6:8.1f}"
              f" µs  {median(t[k]) / e:5.2f}")
    hop = median(t["worker"]) - median(t["in-process"])
    print(f"   worker - in-process: {hop / e:+.2f} (goal <= +0.3): the hop "
          f"{hop * 1e6:+.1f} µs")
    return e, hop


def tuned_figure(small: np.ndarray) -> None:
    """Figure 1b: both arms with the I/O thread and the model on core 0."""
    repo = Path(tempfile.mkdtemp(prefix="inferd-bw", dir="/tmp"))
    make_identity_model(repo, "identity", rank=1)
    pinned = "cpu_affinity = [0]\n"  # the [server] key and the model's alike
    (repo / "identity" / "model.toml").write_text(pinned)
    echo = Echo(core=0)
    arms = [daemon(repo, "in-process", pinned, "identity"),
            daemon(repo, "backend", pinned, "identity")]
    try:
        with Client(arms[0].endpoint, timeout=60) as a, Client(arms[1].endpoint,
                                                               timeout=60) as b:
            frames = encode_request(Request("b1", Op.INFER, "identity", inputs={"x": small}))
            t = interleaved({"echo": echo.round_trip(frames),
                             "in-process": call(a, "identity", {"x": small}),
                             "worker": call(b, "identity", {"x": small})}, 10, 200)
        print_hop("1b. the same, the I/O thread and the model on core 0 "
                  "(docs/configuration.md, Latency; the echo on core 0)", t)
    finally:
        echo.close()
        for d in arms:
            d.stop()
        shutil.rmtree(repo, ignore_errors=True)


def call(c: Client, model: str, inputs: dict[str, np.ndarray]):
    def run() -> None:
        c.infer(model, inputs)
    return run


def worker_pid(d: DaemonProcess) -> int:
    """The daemon's one worker: a grandchild (the zygote's child)."""
    import psutil

    (zygote,) = psutil.Process(d.proc.pid).children()
    (worker,) = zygote.children()
    return int(worker.pid)


def crash_to_served(repo: Path, x: np.ndarray, n: int = 5) -> list[float]:
    """One kill per fresh daemon: consecutive deaths within a minute are restarted with
    a doubling backoff, and a client whose requests were running at 5 of them is
    refused for a minute (both by design, [workers])."""
    times = []
    for _ in range(n):
        d = daemon(repo, "backend")
        try:
            with Client(d.endpoint, timeout=60) as c:
                c.infer("ocr-cls", {"x": x})
                os.kill(worker_pid(d), signal.SIGKILL)
                t0 = time.perf_counter()
                while True:  # the first request after the kill: answered, or UNAVAILABLE
                    try:
                        c.infer("ocr-cls", {"x": x})
                        break
                    except Exception:  # noqa: BLE001  the kill's own request: again
                        pass
                times.append(time.perf_counter() - t0)
        finally:
            d.stop()
    return times


class PacketEcho:
    """The hop's floor: a forked process that echoes each datagram of an ``AF_UNIX``
    ``SOCK_SEQPACKET`` socketpair (the worker's control channel's kind), 100 bytes, the
    size of a small run's header: a round trip between two Python processes with no
    work done on either side."""

    def __init__(self) -> None:
        import socket

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:  # the echo: nothing of the bench from here on
            self.sock.close()
            while data := theirs.recv(4096):
                theirs.send(data)
            os._exit(0)
        theirs.close()
        self.message = b"x" * 100

    def round_trip(self) -> None:
        self.sock.send(self.message)
        self.sock.recv(4096)

    def close(self) -> None:
        self.sock.close()
        os.waitpid(self.pid, 0)


def main() -> None:
    print(f"bench_workers: {cpu_note()}, load {os.getloadavg()[0]:.1f}")
    repo = repo_with_identity()
    small = np.arange(4, dtype=np.float32)  # 16 bytes
    big = np.random.default_rng(0).random(1_225_000, dtype=np.float32)  # 4.9 MB
    cls1 = np.random.default_rng(1).random((1, 3, 48, 192), dtype=np.float32)
    cls8 = np.random.default_rng(2).random((8, 3, 48, 192), dtype=np.float32)
    echo = Echo()
    packet = PacketEcho()
    inproc = daemon(repo, "in-process")
    worker = daemon(repo, "backend")
    try:
        with Client(inproc.endpoint, timeout=60) as a, Client(worker.endpoint,
                                                               timeout=60) as b:
            frames_small = encode_request(Request("b1", Op.INFER, "identity",
                                                  inputs={"x": small}))
            frames_big = encode_request(Request("b2", Op.INFER, "identity", inputs={"x": big}))
            t = interleaved({"echo": echo.round_trip(frames_small),
                             "in-process": call(a, "identity", {"x": small}),
                             "worker": call(b, "identity", {"x": small}),
                             "seqpacket": packet.round_trip}, 10, 200)
            e, hop = print_hop("1. 16-byte infer, p50 (ratio to raw echo)", t)
            floor = median(t["seqpacket"])
            print(f"   the hop's floor, a bare SOCK_SEQPACKET round trip between two Python "
                  f"processes (the seqpacket row): {floor / e:+.2f} of the echo; the hop is "
                  f"{hop / floor:.1f}x it")
            tuned_figure(small)
            t = interleaved({"echo": echo.round_trip(frames_big),
                             "in-process": call(a, "identity", {"x": big}),
                             "worker": call(b, "identity", {"x": big})}, 6, 20)
            e = median(t["echo"])
            print("\n2. 4.9 MB infer round trip, p50 (ratio to raw echo)")
            for k in t:
                print(f"   {k:11s} {median(t[k]) * 1e3:8.2f} ms  {median(t[k]) / e:5.2f}")
            print(f"   worker: {verdict(median(t['worker']) / e, 1.4, False)}")
            shm = {}
            for label, c in (("in-process", a), ("worker", b)):
                region = c.register(Region(3 * big.nbytes))
                shared = region.ndarray(big.shape, np.float32)
                shared[...] = big
                shm[label] = (lambda c=c, shared=shared, region=region: c.infer(
                    "identity", {"x": shared}, outputs_into=region))
            t = interleaved({"echo": echo.round_trip(frames_big), **shm}, 6, 20)
            e = median(t["echo"])
            print("\n2b. 4.9 MB in and out through shared memory, p50 (ratio to the raw "
                  "echo of the frame)")
            for k in t:
                print(f"   {k:11s} {median(t[k]) * 1e3:8.2f} ms  {median(t[k]) / e:5.2f}")
            print(f"   worker: {verdict(median(t['worker']) / e, 0.5, False)}")
            if os.environ.get("BENCH_WORKERS_SHM_ONLY"):
                return
            print("\n3. ocr-cls, one client, requests/s")
            session = cls_session()
            for label, x in (("b1", cls1), ("b8", cls8)):
                t = interleaved({"in-process": call(a, "ocr-cls", {"x": x}),
                                 "worker": call(b, "ocr-cls", {"x": x}),
                                 "onnxruntime": lambda x=x: session.run(None, {"x": x})},
                                5, 20)
                rates = {k: 1 / median(v) for k, v in t.items()}
                print(f"   {label}: " + ", ".join(f"{k} {r:7.1f}" for k, r in rates.items())
                      + f"; worker / in-process {rates['worker'] / rates['in-process']:.2f},"
                      f" worker / onnxruntime {rates['worker'] / rates['onnxruntime']:.2f}")
        print("\n4. crash to served again (ocr-cls worker SIGKILLed)")
        times = crash_to_served(repo, cls1)
        print("   " + ", ".join(f"{x * 1e3:.0f}" for x in times) + " ms; p50 "
              f"{median(times) * 1e3:.0f} ms: {verdict(median(times), 2.0, False)}")
        print("\n5. a worker's start, fork to its first answer: see the daemon's log line "
              "'worker NAME started: pid N in T ms' (INFO)")
    finally:
        echo.close()
        packet.close()
        inproc.stop()
        worker.stop()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
