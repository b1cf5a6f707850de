"""Backpressure a client can live with (issue 12, items 5 and 5b): what one client may
hold is bounded and given back, model queues take turns between clients, and the
Python clients wait (or retry) instead of failing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from inferd.ipc import AsyncClient, Client, RequestError
from inferd.ipc.clients import ClientLimits
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import Op, Request, encode_request
from inferd.ipc.replies import Ticket
from tests.ipc.libinferd_kit import identity_model
from tests.links import link_tree

X = np.zeros((1, 3, 48, 192), np.float32)  # one ocr-cls request: 110,592 bytes of tensor
VAD = {"input": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32),
       "sr": np.array(16000, np.int64)}
RSS_RETURNED_BOUND = 96 * 2**20
"""How far above its RSS before the burst the daemon may stay once the burst is over."""


def test_client_limits_count_and_forget():
    limits = ClientLimits(max_requests=2, max_bytes=1000)
    a = [Ticket(i, 0.0, peer=b"a", size=size) for i, size in enumerate((600, 600, 1))]
    b = Ticket(3, 0.0, peer=b"b", size=5000)
    assert limits.admit(a[0]) is None
    assert "max_bytes_per_client" in (limits.admit(a[1]) or "")
    assert "max_requests_per_client" in (limits.admit(a[2]) or "")
    assert limits.admit(b) is None  # a lone request is always admitted
    for t in a:
        assert limits.holds(b"a")
        limits.done(t)
    assert not limits.holds(b"a") and limits.holds(b"b")
    limits.done(b)
    assert limits.clients() == 0 and limits.refused == 2


class _Tracker:
    """Stands in for pyzmq's MessageTracker of a reply libzmq still holds (done: let go)."""

    def __init__(self) -> None:
        self.done = False


def test_unread_big_replies_count_against_their_client_until_libzmq_lets_go():
    limits = ClientLimits(max_requests=8, max_bytes=1000)
    first, second = _Tracker(), _Tracker()
    for i, tracker in enumerate((first, second)):
        t = Ticket(i, 0.0, peer=b"a", size=10)
        assert limits.admit(t) is None
        limits.done(t, (400, tracker))  # replies of 400 bytes wait in libzmq
    assert limits.held == 800 and not limits.holds(b"a") and limits.unread() == 2
    refused = Ticket(2, 0.0, peer=b"a", size=300)
    why = limits.admit(refused)  # even a lone request
    assert why is not None and "2 replies it has not read" in why, why
    limits.done(refused)  # gives back what admit counted on that ticket
    second.done = True  # out of order: the oldest still holds the count back
    limits.settle_if_due()
    assert limits.held == 800
    first.done = True
    t = Ticket(3, 0.0, peer=b"a", size=300)
    assert limits.admit(t) is None  # both looked at, in order, before counting
    assert limits.held == 300 and limits.unread() == 0
    limits.done(t)
    assert limits.held == 0 and limits.clients() == 0


def test_a_client_gone_with_unread_replies_is_counted_out_by_the_settling():
    limits = ClientLimits(max_requests=8, max_bytes=1000)
    tracker = _Tracker()
    t = Ticket(0, 0.0, peer=b"gone", size=10)
    assert limits.admit(t) is None
    limits.done(t, (500, tracker))
    assert limits.settle_in() is not None and limits.held == 500
    tracker.done = True  # its connection closed: libzmq dropped what it held
    time.sleep(0.11)  # SETTLE_S
    limits.settle_if_due()
    assert limits.held == 0 and limits.settle_in() is None


@pytest.mark.slow
def test_a_client_that_never_reads_big_replies_holds_no_more_than_its_bytes(start_daemon,
                                                                           short_tmp):
    """A reply over 64 KiB waits in libzmq until its client reads it: a client that never
    does (receive high-water mark 1) once had them kept for it (600 replies of 1.2 MB:
    +279 MiB here, +850 MiB in a longer run). Their bytes count against the client now."""
    repo = short_tmp / "repo"
    identity_model(repo / "identity" / "1" / "model.onnx", "float32")
    config = short_tmp / "inferd.toml"
    config.write_text('[server]\nmax_bytes_per_client = "16MiB"\n')
    d = start_daemon("--config", str(config), "--models", str(repo), "--preload", "identity")
    x = np.ones((1, 300_000), np.float32)  # 1.2 MB in, 1.2 MB out
    proc = psutil.Process(d.proc.pid)
    with d.client() as c:
        for _ in range(5):  # a reading client: its replies come, nothing is refused
            assert np.array_equal(c.infer("identity", {"x": x})["y"], x)
        rss_before = proc.memory_info().rss
        ctx = zmq.Context()
        rude = ctx.socket(zmq.DEALER)
        rude.setsockopt(zmq.LINGER, 0)
        rude.setsockopt(zmq.RCVHWM, 1)
        rude.setsockopt(zmq.RCVBUF, 4096)
        rude.setsockopt(zmq.SNDTIMEO, 30_000)
        rude.connect(d.endpoint)
        try:
            held = []
            received = c.status()["requests"]
            for i in range(600):
                rude.send_multipart(encode_request(Request(
                    f"r{i}", Op.INFER, "identity", inputs={"x": x})), copy=False)
                if i % 40 == 39:
                    held.append(c.status()["requests_held_bytes"])
            deadline = time.monotonic() + 60  # until the daemon has taken all 200
            while (status := c.status())["requests"] < received + 600 + 16:
                assert time.monotonic() < deadline, status["requests"] - received
                time.sleep(0.05)
            held.append(status["requests_held_bytes"])
            grew = proc.memory_info().rss - rss_before
            # the polite client is served meanwhile
            assert np.array_equal(c.infer("identity", {"x": x})["y"], x)
        finally:
            rude.close(0)
            ctx.term()
        # gone: libzmq drops what it held, and the count follows (ipc/clients.py SETTLE_S)
        deadline = time.monotonic() + 30
        while c.status()["requests_held_bytes"] > 4096:  # beyond the status request's
            assert time.monotonic() < deadline, c.status()["requests_held_bytes"]
            time.sleep(0.05)
    print(f"held {[h // 2**20 for h in held]} MiB; RSS +{grew / 2**20:.0f} MiB")
    # 16 MiB of unread replies, one request over it, the status request's own bytes
    assert max(held) <= 16 * 2**20 + x.nbytes + 4096, held
    assert grew < 160 * 2**20, grew  # before: +279 MiB (600 x 1.2 MB, some dropped)


def _wait_idle(c: Client, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while c.status()["clients_in_flight"] > 1:  # the status request itself
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_client_that_never_reads_is_bounded_and_its_memory_returned(start_daemon,
                                                                      models_dir,
                                                                      short_tmp):
    """Item 5: 10,000 ocr-cls requests sent and never read."""
    # placement "first": measured placement brings a second engine in (OpenVINO, measured
    # after the first requests and kept if faster: its import and libraries, tens of MiB,
    # stay resident and count in the budget as the engine's), which is not what this
    # test bounds: the memory of replies a client never reads
    config = short_tmp / "inferd.toml"
    config.write_text('[placement]\nmode = "first"\n')
    d = start_daemon("--config", str(config), "--models", str(models_dir),
                     "--preload", "ocr-cls")
    proc = psutil.Process(d.proc.pid)
    with d.client() as c:
        for _ in range(20):
            c.infer("ocr-cls", {"x": X})
        rss_before = proc.memory_info().rss
        ctx = zmq.Context()
        rude = ctx.socket(zmq.DEALER)
        rude.setsockopt(zmq.LINGER, 0)
        rude.setsockopt(zmq.SNDTIMEO, 30_000)
        rude.connect(d.endpoint)
        polite_errors: list[str] = []
        polite_done = threading.Event()

        def polite() -> None:
            with d.client(timeout=60) as p:
                while not polite_done.is_set():
                    try:
                        p.infer("ocr-cls", {"x": X})
                    except RequestError as e:
                        polite_errors.append(f"{e.code}: {e.message}")
        t = threading.Thread(target=polite)
        t.start()
        try:
            for i in range(10_000):
                rude.send_multipart(encode_request(Request(f"r{i}", Op.INFER, "ocr-cls",
                                                           inputs={"x": X})), copy=False)
            peak = proc.memory_info().rss
            rude.close(0)  # never read a reply: gone
            ctx.term()
            _wait_idle(c)
        finally:
            polite_done.set()
            t.join(60)
        status = c.status()
    # The free pages go back once the daemon has been quiet for a while
    # (ipc/clients.py, IDLE_TRIM_S): read the RSS without a request until then.
    deadline = time.monotonic() + 60
    while (rss_after := proc.memory_info().rss) - rss_before >= RSS_RETURNED_BOUND:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert polite_errors == []
    assert status["clients_in_flight"] <= 1
    print(f"RSS before {rss_before / 2**20:.0f} MiB, during {peak / 2**20:.0f} MiB, "
          f"after {rss_after / 2**20:.0f} MiB")
    assert rss_after - rss_before < RSS_RETURNED_BOUND, (rss_before, peak, rss_after)
    assert d.proc.poll() is None


@pytest.mark.slow
def test_async_gather_of_200_waits_instead_of_failing(start_daemon, models_dir):
    """Item 5b: with the shipped defaults, asyncio.gather of 200 infers all succeed."""
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls")

    async def run() -> list[object]:
        async with AsyncClient(d.endpoint, timeout=120) as c:
            return await asyncio.gather(*(c.infer("ocr-cls", {"x": X}) for _ in range(200)),
                                        return_exceptions=True)
    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors == []


@pytest.mark.slow
def test_retry_exhausted_turns_a_full_queue_into_a_wait(start_daemon, models_dir, short_tmp):
    config = short_tmp / "inferd.toml"
    config.write_text("[models]\nqueue_size = 2\n")
    d = start_daemon("--config", str(config), "--models", str(models_dir), "--preload",
                     "ocr-rec")
    x = np.zeros((1, 3, 48, 320), np.float32)

    async def burst(retry: bool) -> list[object]:
        async with AsyncClient(d.endpoint, timeout=120, retry_exhausted=retry) as c:
            return await asyncio.gather(*(c.infer("ocr-rec", {"x": x}) for _ in range(40)),
                                        return_exceptions=True)
    codes = [r.code for r in asyncio.run(burst(False)) if isinstance(r, RequestError)]
    assert ErrorCode.RESOURCE_EXHAUSTED in codes
    assert [r for r in asyncio.run(burst(True)) if isinstance(r, Exception)] == []


@pytest.mark.slow
def test_eight_clients_with_32_in_flight_get_no_refusal(start_daemon, models_dir):
    """Item 5b: 8 clients with 32 requests in flight each, shipped defaults."""
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls")
    errors: list[str] = []
    done = [0]

    def client() -> None:
        with Client(d.endpoint, timeout=120) as c:
            for _ in range(8):
                pending = [c.submit("infer", "ocr-cls", {"x": X}) for _ in range(32)]
                for p in pending:
                    r = p.reply()
                    if r.error is not None:
                        errors.append(str(r.error))
                    done[0] += 1
    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and done[0] == 8 * 8 * 32


class _Greedy:
    """The greedy client in its own process (tests.e2e.soak_kit greedy), so that it does
    not slow the polite one's process down; counts the requests it was served."""

    def __init__(self, endpoint: str, model: str) -> None:
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.soak_kit", "greedy", endpoint, model],
            cwd=root, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(root), os.environ.get("PYTHONPATH", "")])})
        self.served = 0
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read, name="test-greedy-reader")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(4096):  # type: ignore[attr-defined]
            if b"S" in chunk:
                self.started.set()
            self.served += chunk.count(b".")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(60)
        self._reader.join(60)


@pytest.mark.slow
def test_a_greedy_client_does_not_starve_a_polite_one(start_daemon, models_dir, short_tmp):
    """Item 5b: a greedy client keeps 500 requests in flight, a polite one sends one at
    a time. The polite one gets no error, and while one of its requests is in flight
    the greedy one is served a few times (taking turns), not 500 times (a FIFO).

    ocr-cls with its shipped model.toml (max_batch 32, adaptive batching): the polite
    request rides in the next batch beside a share of the greedy one's rows (issue 20)."""
    repo = short_tmp / "repo"
    link_tree(models_dir / "ocr-cls" / "1", repo / "cls" / "1")
    (repo / "cls" / "model.toml").write_text((models_dir / "ocr-cls" / "model.toml").read_text())
    d = start_daemon("--models", str(repo), "--preload", "cls")
    with d.client(timeout=120) as polite:
        alone = []
        for _ in range(30):
            t0 = time.perf_counter()
            polite.infer("cls", {"x": X})
            alone.append(time.perf_counter() - t0)
        greedy = _Greedy(d.endpoint, "cls")
        try:
            assert greedy.started.wait(120)
            loaded, overtaken = [], []
            for _ in range(40):
                before = greedy.served
                t0 = time.perf_counter()
                polite.infer("cls", {"x": X})  # raises on any error
                loaded.append(time.perf_counter() - t0)
                overtaken.append(greedy.served - before)
        finally:
            greedy.stop()

    def p99(xs: list[float]) -> float:
        return sorted(xs)[int(0.99 * (len(xs) - 1))]
    print(f"polite p99 alone {p99(alone) * 1000:.1f} ms, beside a greedy client with 500 "
          f"in flight {p99(loaded) * 1000:.1f} ms ({p99(loaded) / p99(alone):.1f}x); greedy "
          f"requests served during each polite one: median "
          f"{sorted(overtaken)[len(overtaken) // 2]}, max {max(overtaken)}")
    assert greedy.served > 0
    # A FIFO serves ~500 greedy requests (all it has queued) before each polite one (500
    # measured); taking turns, 1 on a quiet machine. The bound leaves room for a busy
    # one, where the greedy client is also served while the polite request is still on
    # its way to the queue.
    assert sorted(overtaken)[len(overtaken) // 2] <= 50, overtaken


@pytest.mark.slow
def test_the_queued_requests_of_a_client_that_disconnects_are_dropped_not_run(
        start_daemon, models_dir, short_tmp):
    """Item 5: what a gone client held is dropped. 300 ocr-rec requests (about 6 s of
    work) sent, 150 or more of them queued, then the client disconnects: those still
    queued are answered CANCELLED (to nobody) instead of run, and another client is
    served at once."""
    config = short_tmp / "inferd.toml"
    config.write_text("[models]\nqueue_size = 1000\n")
    d = start_daemon("--config", str(config), "--models", str(models_dir), "--preload",
                     "ocr-rec")
    x = np.zeros((1, 3, 48, 320), np.float32)
    sent = 300
    with d.client(timeout=60) as c:
        ctx = zmq.Context()
        rude = ctx.socket(zmq.DEALER)
        rude.setsockopt(zmq.LINGER, 0)
        rude.connect(d.endpoint)
        for i in range(sent):
            rude.send_multipart(encode_request(Request(f"r{i}", Op.INFER, "ocr-rec",
                                                       inputs={"x": x})), copy=False)

        def row() -> dict:
            return next(m for m in c.models() if m["name"] == "ocr-rec")
        deadline = time.monotonic() + 60
        while row()["queued"] < 150:  # received and waiting (ocr-rec: ~20 ms each)
            assert time.monotonic() < deadline, row()
            time.sleep(0.01)
        rude.close(0)
        ctx.term()
        t0 = time.perf_counter()
        _wait_idle(c, timeout=60)
        drained = time.perf_counter() - t0
        c.infer("ocr-rec", {"x": x})  # served: the model is free again
        served = row()["requests"] - 1
        text = c.call("metrics")["text"]
    cancelled = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("inferd_requests_total{")
                      and 'code="CANCELLED"' in line and 'model="ocr-rec"' in line), 0.0)
    print(f"{sent} sent: {served} run, {cancelled:.0f} dropped; idle again {drained:.2f} s "
          f"after the disconnection")
    assert cancelled >= 100 and served + cancelled <= sent  # 50 runs of margin: ~1 s
    assert "requests were still queued and are dropped" in d.log()
    assert d.proc.poll() is None
