"""The server loop on real ZeroMQ sockets, without a daemon: each request's ticket is its
one in-flight record, and every wire reply (inline, later from another thread, a
refusal before or after decoding, the UNAVAILABLE of a stop) passes the one place that
counts it, exactly once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.ipc.errors import ErrorCode, Failure, ModelError
from inferd.ipc.protocol import (
    TAG,
    Op,
    Reply,
    Request,
    decode_reply,
    encode_request,
)
from inferd.ipc.replies import LocalTicket, ReplySink, Ticket
from inferd.ipc.server import Server
from tests.e2e.test_cache_reload import poll


class Harness:
    """A server on its own thread; ``handler`` answers at once, later or raises."""

    def __init__(self, tmp: Path, **kwargs: Any) -> None:
        self.observed: list[Ticket] = []
        self.kept: list[Ticket] = []
        self.server = Server(f"ipc://{tmp}/s.sock", self.handle, max_message_bytes=4096,
                             grace_s=0.2, observe=self.observed.append, **kwargs)
        self.server.bind()
        self.thread = threading.Thread(target=self.server.run, name="test-io")
        self.thread.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.server.endpoint)

    def handle(self, ticket: Ticket) -> Reply | None:
        request = ticket.request
        if request.model == "bad":
            raise ModelError("model 'bad' cannot run this")
        if request.model == "later":  # answered from another thread
            threading.Thread(target=self.server.send_reply, args=(
                ticket, Reply(request.id, outputs=dict(request.inputs)))).start()
            return None
        if request.model == "never":  # left for the stop to answer
            self.kept.append(ticket)
            return None
        return Reply(request.id, result={"pong": True})

    def call(self, frames: list[Any]) -> Reply:
        self.sock.send_multipart(frames)
        return decode_reply(self.sock.recv_multipart())

    def close(self) -> None:
        self.server.stop()
        self.thread.join(30)
        self.sock.close(0)
        self.ctx.term()
        self.server.close()


@pytest.fixture
def harness(short_tmp: Path):
    h = Harness(short_tmp)
    yield h
    if h.thread.is_alive():
        h.close()


def test_every_wire_reply_is_observed_once_with_its_record(harness: Harness) -> None:
    h = harness
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ping = encode_request(Request("p1", Op.PING))
    assert h.call(ping).result == {"pong": True}
    later = encode_request(Request("r2", Op.INFER, model="later", inputs={"x": x},
                                   timeout_ms=5000))
    np.testing.assert_array_equal(h.call(later).outputs["x"], x)
    bad = h.call(encode_request(Request("r3", Op.INFER, model="bad")))
    assert bad.error is not None and bad.error.code is ErrorCode.INVALID_ARGUMENT
    garbled = h.call([TAG, b'{"id":"r4","op":'])  # refused before it is decoded
    assert garbled.id == "r4" and garbled.error is not None
    big = h.call([TAG, b'{"id":"r5","op":"ping"}', b"\0" * 5000])
    assert big.error is not None and big.error.code is ErrorCode.RESOURCE_EXHAUSTED
    h.close()

    # one record per request, each observed once, with what every layer needs
    assert len({id(t) for t in h.observed}) == 5
    assert [t.seq for t in h.observed] == [1, 2, 3, 4, 5]
    peer = h.observed[0].peer
    assert peer and all(t.peer == peer for t in h.observed)
    assert [t.code for t in h.observed] == ["OK", "OK", "INVALID_ARGUMENT",
                                            "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]
    assert [t.model for t in h.observed] == [None, "later", "bad", None, None]
    # the id its reply carries (read without decoding for the refused ones)
    assert [t.request_id for t in h.observed] == ["p1", "r2", "r3", "r4", "r5"]
    r2 = h.observed[1]
    assert r2.size == sum(len(bytes(f)) for f in later)
    assert r2.deadline is not None and r2.deadline == pytest.approx(r2.received + 5.0)
    assert all(t.answered is not None and t.answered >= t.received for t in h.observed)
    assert h.server.clients.clients() == 0  # the limits were given every ticket back


def test_the_stop_answers_what_is_open_and_counts_it(harness: Harness) -> None:
    h = harness
    h.sock.send_multipart(encode_request(Request("n1", Op.INFER, model="never")))
    assert h.call(encode_request(Request("p1", Op.PING))).ok  # n1 has been received
    h.server.stop()
    reply = decode_reply(h.sock.recv_multipart())
    assert reply.id == "n1" and reply.error is not None
    assert reply.error.code is ErrorCode.UNAVAILABLE
    h.close()
    assert [(t.request_id, t.code) for t in h.observed] == [("p1", "OK"),
                                                            ("n1", "UNAVAILABLE")]
    assert h.observed[1] is h.kept[0]
    h.server.send_reply(h.kept[0], Reply("n1"))  # a late reply is dropped, not counted
    assert len(h.observed) == 2 and h.kept[0].code == "UNAVAILABLE"


def test_only_the_first_answer_of_a_ticket_is_sent(harness: Harness) -> None:
    """A stage that answers after a deadline watch (or anyone) answered first: its
    reply is dropped quietly, the client sees one reply, the record keeps the first."""
    h = harness
    h.sock.send_multipart(encode_request(Request("n1", Op.INFER, model="never")))
    assert h.call(encode_request(Request("p1", Op.PING))).ok  # n1 is kept by now
    ticket = h.kept[0]
    first = Reply("n1", error=Failure(ErrorCode.DEADLINE_EXCEEDED, "too late"))
    h.server.send_reply(ticket, first)  # from this thread: through the reply socket
    h.server.send_reply(ticket, Reply("n1", result="the stage's late answer"))
    reply = decode_reply(h.sock.recv_multipart())
    assert reply.error is not None and reply.error.code is ErrorCode.DEADLINE_EXCEEDED
    assert h.call(encode_request(Request("p2", Op.PING))).id == "p2"  # nothing between
    h.close()
    assert [(t.request_id, t.code) for t in h.observed] == [
        ("p1", "OK"), ("n1", "DEADLINE_EXCEEDED"), ("p2", "OK")]


def test_a_local_ticket_is_answered_once() -> None:
    got: list[Reply] = []
    observed: list[LocalTicket] = []
    sink = ReplySink(observe=observed.append)
    ticket = LocalTicket(Request("g1", Op.INFER, model="ocr-det"), got.append)
    sink.send(ticket, Reply("g1", error=Failure(ErrorCode.CANCELLED, "gone")))
    sink.send(ticket, Reply("g1"))
    assert [r.error.code for r in got if r.error] == [ErrorCode.CANCELLED] and len(got) == 1
    assert observed == [ticket] and ticket.code == "CANCELLED"


def test_the_request_paths_sockets_copy_frames_below_the_threshold(harness: Harness) -> None:
    """Frames under transport.COPY_THRESHOLD (256 KiB, over pyzmq's 64 KiB) are copied
    when sent, by the daemon's ROUTER and by both clients: a zero-copy send of a 110 KB
    ocr-cls input cost more CPU than its copy."""
    import asyncio

    from inferd.ipc import AsyncClient, Client
    from inferd.ipc.transport import COPY_THRESHOLD

    assert COPY_THRESHOLD == 256 * 2**10 > zmq.COPY_THRESHOLD
    assert harness.server._router is not None
    assert harness.server._router.copy_threshold == COPY_THRESHOLD
    with Client(harness.server.endpoint) as c:
        assert c._sock.copy_threshold == COPY_THRESHOLD

    async def asynchronous() -> int:
        ac = AsyncClient(harness.server.endpoint)
        try:
            return int(ac._sock.copy_threshold)
        finally:
            await ac.close()
    assert asyncio.run(asynchronous()) == COPY_THRESHOLD


def test_accepting_pauses_when_the_descriptors_near_the_limit_before_they_are_counted(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 18, defect 1, under load: libzmq accepts on its own thread and the monitor's
    events are handled later, so a burst of connections holds descriptors before it is
    counted (seen: 788 descriptors open, 193 counted, with a bound of 512 under a limit
    of 1024; an accept at the limit aborts the process). The server also looks at the
    descriptors themselves: past ``fd_brake`` it stops accepting, and once they are back
    below it, it accepts again."""
    from inferd.ipc.server import _open_fds

    h = harness
    listener = h.server._listener
    assert listener is not None and _open_fds() > 0
    h.server.connections.fd_brake = _open_fds() + 60  # here: 2-3 descriptors a connection
    ctx = zmq.Context()
    socks = []
    try:
        with caplog.at_level("INFO", logger="inferd.ipc.server"):
            for _ in range(60):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(h.server.endpoint)
                socks.append(s)
            poll(lambda: "descriptors are open" in caplog.text)
            assert listener.paused
            assert h.server.connections.count() < h.server.connections.max  # not the count
            for s in socks:
                s.close(0)
            socks.clear()
            # the paused listener's connections were refused without a monitor event:
            # the next one to come (ZeroMQ reconnects by itself) finds the brake off
            probe = ctx.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(h.server.endpoint)
            socks.append(probe)
            poll(lambda: not listener.paused)
        assert "accepting new connections again" in caplog.text
        assert h.call([TAG, b'{"op":"ping","id":"p"}']).result == {"pong": True}
    finally:
        for s in socks:
            s.close(0)
        ctx.term()



def test_a_watched_descriptor_calls_ready_once_and_late_once_on_the_io_thread(
        harness: Harness) -> None:
    """Server.watch (a run sent to a worker from the I/O thread): ``late`` once when the
    deadline passes with nothing to read, ``ready`` once when the descriptor is readable,
    both on the I/O thread; then the descriptor is watched no more. A ``ready`` that
    raises is logged and the loop goes on serving."""
    import socket
    import time

    calls: list[tuple[str, str]] = []
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        def arm() -> None:
            harness.server.watch(a.fileno(), time.monotonic() + 0.2,
                                 lambda: calls.append(("ready", threading.current_thread().name)),
                                 lambda: calls.append(("late", threading.current_thread().name)))

            def boom() -> None:
                calls.append(("boom", threading.current_thread().name))
                raise RuntimeError("a ready that fails")
            harness.server.watch(c.fileno(), time.monotonic() + 60, boom, lambda: None)
        harness.server.call_soon(arm)
        poll(lambda: ("late", "test-io") in calls, 10)
        assert calls == [("late", "test-io")]  # nothing readable yet: late, once
        b.send(b"x")
        d.send(b"x")
        poll(lambda: len(calls) == 3, 10)
        assert sorted(calls) == [("boom", "test-io"), ("late", "test-io"), ("ready", "test-io")]
        b.send(b"y")  # readable again: no longer watched, no second call
        reply = harness.call(encode_request(Request("p", Op.PING)))  # still serving
        assert reply.ok
        assert len(calls) == 3
    finally:
        for s in (a, b, c, d):
            s.close()
