"""The systemd protocol: notify messages and the watchdog, with a datagram socket bound
by the test standing in for systemd's notify socket."""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.daemon.config import load_config
from inferd.daemon.runtime import Runtime
from inferd.daemon.systemd import Notifier, Watchdog, monotonic_usec, watchdog_interval
from inferd.daemon.model_threads import STOP



class NotifySocket:
    """An AF_UNIX datagram socket that collects what a notifier sends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)

    def messages(self) -> Iterator[dict[str, str]]:
        """Each datagram as a dict of its KEY=VALUE lines, as long as the socket is open."""
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                yield {}
                continue
            yield dict(line.split("=", 1) for line in data.decode().splitlines())

    def wait_for(self, key: str, timeout: float = 60.0, seen: list | None = None
                 ) -> dict[str, str]:
        """The first message that has ``key``; every message read goes to ``seen``."""
        deadline = time.monotonic() + timeout
        for msg in self.messages():
            if msg and seen is not None:
                seen.append(msg)
            if key in msg:
                return msg
            if time.monotonic() > deadline:
                raise AssertionError(f"no {key} within {timeout} s; got {seen}")
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(short_tmp: Path) -> Iterator[NotifySocket]:
    s = NotifySocket(short_tmp / "notify")
    yield s
    s.close()


def test_without_notify_socket_every_call_is_a_silent_noop(monkeypatch, caplog):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier.from_env()
    assert not n.enabled
    assert n.ready("x") is False
    assert n.reloading() is False and n.stopping() is False and n.watchdog() is False
    assert caplog.records == []


def test_datagram_messages_reach_the_socket(notify_socket):
    n = Notifier(str(notify_socket.path))
    msgs = notify_socket.messages()
    assert n.ready("ready; models warm: 1 (ocr-cls)")
    assert next(msgs) == {"READY": "1", "STATUS": "ready; models warm: 1 (ocr-cls)"}
    assert n.extend_timeout(1.5, "preloading model a (1/2)")
    assert next(msgs) == {"EXTEND_TIMEOUT_USEC": "1500000",
                          "STATUS": "preloading model a (1/2)"}
    assert n.stopping()
    assert next(msgs)["STOPPING"] == "1"
    assert n.watchdog()
    assert next(msgs) == {"WATCHDOG": "1"}
    assert n.status("two\nlines")
    assert next(msgs) == {"STATUS": "two lines"}  # the protocol is line based
    n.close()


def test_reloading_carries_the_monotonic_clock(notify_socket):
    n = Notifier(str(notify_socket.path))
    before = monotonic_usec()
    n.reloading()
    after = monotonic_usec()
    msg = next(notify_socket.messages())
    assert msg["RELOADING"] == "1"
    assert before <= int(msg["MONOTONIC_USEC"]) <= after
    n.close()


def test_abstract_socket_address():
    name = f"inferd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        n = Notifier("@" + name)
        assert n.ready("ok")
        assert sock.recv(100) == b"READY=1\nSTATUS=ok"
        n.close()
    finally:
        sock.close()


def test_a_dead_notify_socket_is_reported_once_and_never_raises(short_tmp, caplog):
    n = Notifier(str(short_tmp / "nobody-listens"))
    assert n.ready("x") is False
    assert n.watchdog() is False
    warnings = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(warnings) == 1
    n.close()


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"WATCHDOG_USEC": "3000000"}, 3.0),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "self"}, 3.0),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
])
def test_watchdog_interval(monkeypatch, env, expected):
    for key in ("WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, str(os.getpid()) if value == "self" else value)
    assert watchdog_interval() == expected


def test_watchdog_pings_only_while_the_probe_says_healthy(notify_socket):
    n = Notifier(str(notify_socket.path))
    healthy = threading.Event()
    healthy.set()
    checked: queue.Queue[bool] = queue.Queue()

    def probe(limit: float) -> str | None:
        ok = healthy.is_set()
        checked.put(ok)
        return None if ok else "the I/O loop is stuck"

    dog = Watchdog(n, 0.2, probe)
    dog.start()
    try:
        notify_socket.wait_for("WATCHDOG", timeout=10)
        healthy.clear()
        while checked.get(timeout=10):  # wait for a failed check...
            pass
        while True:  # ...and drain pings sent before it
            try:
                notify_socket.sock.recv(100)
            except TimeoutError:
                break
        for _ in range(3):  # several failed checks in a row send nothing
            assert checked.get(timeout=10) is False
        with pytest.raises(TimeoutError):
            notify_socket.sock.recv(100)
        healthy.set()
        notify_socket.wait_for("WATCHDOG", timeout=10)
    finally:
        dog.stop(wait=True)
        n.close()


@pytest.mark.slow
def test_a_full_notify_queue_never_freezes_the_daemon(short_tmp, caplog):
    """Nobody reads the notify socket and its queue is full: a message waits at most
    SEND_TIMEOUT_S, without the GIL (other threads keep running meanwhile), is dropped
    and reported once. (systemd-python's sd_notify held the GIL in a blocking sendmsg
    here and froze every thread of the daemon.)"""
    path = short_tmp / "full.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    try:
        sent = 0
        with pytest.raises(BlockingIOError):
            while sent < 100_000:
                filler.sendto(b"WATCHDOG=1", str(path))
                sent += 1
        n = Notifier(str(path))
        ticks = 0
        done = threading.Event()
        result: list[bool] = []
        t = threading.Thread(target=lambda: (result.append(n.watchdog()), done.set()))
        t.start()
        while not done.is_set():  # this thread gets the GIL while the send waits
            ticks += 1
            done.wait(0.001)
        t.join()
        assert result == [False]
        assert ticks > 3
        assert n.watchdog() is False  # again dropped, not reported again
        warnings = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
        assert len(warnings) == 1
        n.close()
    finally:
        filler.close()
        server.close()


# ------------------------------------------------------------------ the real daemon


@pytest.mark.slow
def test_daemon_lifecycle_over_notify(start_daemon, notify_socket, models_dir):
    """READY only after the preload, a readable STATUS, EXTEND_TIMEOUT_USEC while
    preloading, watchdog pings, SIGHUP -> RELOADING=1 then READY=1, STOPPING=1."""
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "400000"}
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls", "--preload",
                     "vad", env=env, ready=False)
    seen: list[dict[str, str]] = []
    extend = notify_socket.wait_for("EXTEND_TIMEOUT_USEC", seen=seen)
    assert extend["STATUS"] == "preloading model ocr-cls (1/2)"
    ready = notify_socket.wait_for("READY", seen=seen)
    assert "READY" not in [k for m in seen[:-1] for k in m]
    status = ready["STATUS"]
    assert "backends: 2 loaded (onnxruntime, openvino), 0 failed" in status, status
    assert "models warm: 2 (ocr-cls, vad)" in status, status
    with d.client() as c:  # READY=1 came only when the models really were warm
        assert {m["name"] for m in c.models() if m["state"] == "ready"} == {"ocr-cls", "vad"}
    for _ in range(2):
        notify_socket.wait_for("WATCHDOG", timeout=30)

    d.proc.send_signal(signal.SIGHUP)
    seen.clear()
    reloading = notify_socket.wait_for("RELOADING", seen=seen)
    assert int(reloading["MONOTONIC_USEC"]) > 0
    notify_socket.wait_for("READY", seen=seen)

    d.proc.send_signal(signal.SIGTERM)
    notify_socket.wait_for("STOPPING")
    assert d.stop() == 0, d.log_path.read_text()


@pytest.mark.slow
def test_daemon_without_notify_socket_logs_no_systemd_errors(start_daemon, models_dir,
                                                             monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while "configuration reloaded" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    with d.client() as c:
        assert c.ping()["ready"]
    assert d.stop() == 0
    log = d.log_path.read_text()
    assert "configuration reloaded" in log
    assert "notify" not in log.lower() and "Traceback" not in log


# ------------------------------------------------------------------ the health probe


@pytest.fixture
def runtime(short_tmp: Path, models_dir: Path) -> Iterator[Runtime]:
    config = load_config(None, {"server.socket": f"ipc://{short_tmp}/rt.sock",
                                "models.repository": str(models_dir),
                                "models.preload": ["ocr-cls"]})
    rt = Runtime(config)
    rt.start()
    io = threading.Thread(target=rt.serve, name="test-io")
    io.start()
    assert rt.ready.wait(60)
    yield rt
    rt.stop()
    io.join(60)


@pytest.mark.slow
def test_health_probe_sees_a_stuck_io_loop_and_a_dead_worker(runtime):
    assert runtime._health(5.0) is None
    release = threading.Event()
    runtime.server.call_soon(lambda: release.wait(30))  # the I/O loop hangs
    try:
        reason = runtime._health(0.3)
    finally:
        release.set()
    assert reason is not None and "I/O loop did not answer" in reason
    assert runtime._health(5.0) is None

    entry = runtime.models.entry("ocr-cls")
    worker = entry.threads.threads[0]
    entry.queue.put(STOP)  # the stop sentinel: the worker ends behind the model's back
    worker.join(10)
    reason = runtime._health(5.0)
    assert reason is not None and worker.name in reason


@pytest.mark.slow
def test_signals_during_shutdown_do_not_crash_the_daemon(start_daemon, models_dir):
    """systemd may send SIGTERM more than once, and a SIGHUP can race a stop: no signal
    until the process is gone makes it fail. Once Python is finalizing, a signal's
    default action ends it (-SIGTERM/-SIGHUP), which systemd counts as a clean exit."""
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls")
    sent = 0
    while d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM if sent % 2 == 0 else signal.SIGHUP)
        sent += 1
        time.sleep(0.001)  # pacing only: the loop ends on the exit, whenever it comes
    code = d.stop()
    log = d.log_path.read_text()
    assert code in (0, -signal.SIGTERM, -signal.SIGHUP), log
    assert "Traceback" not in log and "inferd exited cleanly" in log
