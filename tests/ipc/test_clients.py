"""ClientLimits' idle trim: free heap pages go back once no inference has finished for
IDLE_TRIM_S, never between two requests of a steady client (that made each request
fault its buffers in again, also one whose tensors are in shared memory); a status poll
does not put it off."""

from __future__ import annotations

import pytest

from inferd.ipc import clients
from inferd.ipc.clients import TRIM_AFTER_BYTES, ClientLimits, Connections
from inferd.ipc.libc import malloc_trim
from inferd.ipc.protocol import Op, Request
from inferd.ipc.replies import Ticket

pytestmark = pytest.mark.skipif(not malloc_trim(), reason="malloc_trim is glibc's")

_INFER = Request("", Op.INFER, model="m")  # an inference's ticket: counted as one


def _ticket(i: int) -> Ticket:
    return Ticket(i, 0.0, peer=b"a", size=TRIM_AFTER_BYTES, request=_INFER)


def test_no_trim_between_requests_of_a_steady_client() -> None:
    limits = ClientLimits(8, 2**40)
    for i in range(5):
        t = _ticket(i)
        assert limits.admit(t) is None
        assert limits.trim_in() is None  # a request in flight: nothing waits
        limits.done(t)
        wait = limits.trim_in()
        assert wait is not None and wait > 0  # due only after IDLE_TRIM_S of quiet
        limits.trim_if_due()
    assert limits.trims == 0


def test_trim_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clients, "IDLE_TRIM_S", 0.0)
    limits = ClientLimits(8, 2**40)
    small = Ticket(0, 0.0, peer=b"a", size=10, request=_INFER)
    limits.admit(small)
    limits.done(small)
    assert limits.trim_in() is None  # too little received to be worth a trim
    t = _ticket(1)
    limits.admit(t)
    limits.done(t)
    assert limits.trim_in() == 0.0
    limits.trim_if_due()
    assert limits.trims == 1 and limits.trim_in() is None


def test_only_inferences_put_the_trim_off() -> None:
    limits = ClientLimits(8, 2**40)
    t = _ticket(0)
    limits.admit(t)
    limits.done(t)
    first = limits.trim_in()
    for i in range(1, 20):  # a status poll while the daemon is otherwise quiet
        ping = Ticket(i, 0.0, peer=b"b", size=200)  # model None: not an inference
        limits.admit(ping)
        assert limits.trim_in() is None  # in flight: not now
        limits.done(ping)
    wait = limits.trim_in()
    assert first is not None and wait is not None and wait <= first
    shm = Ticket(99, 0.0, peer=b"a", size=300, request=_INFER)  # tensors in a region
    limits.admit(shm)
    limits.done(shm)  # an inference finished: the quiet starts again
    again = limits.trim_in()
    assert again is not None and again >= wait


def test_connections_are_bounded_below_the_open_files_limit() -> None:
    """Issue 18, defect 1: the bound leaves FD_RESERVE descriptors, and half the limit."""
    assert Connections(2048, 65536).max == 2048
    assert Connections(2048, 1024).max == 512
    assert Connections(2048, 4096).max == 2048
    assert Connections(10, 100).max == 1  # no room at all: one, never none
    c = Connections(2, 65536)
    assert c.accepted(7) and c.accepted(8)
    assert not c.accepted(9)  # the third: over the bound, counted until it closes
    assert (c.count(), c.refused, c.peak) == (3, 1, 3)
    c.closed(9)
    c.closed(7)
    assert c.accepted(10) and c.count() == 2


def test_the_daemon_wide_bound_keeps_a_polite_users_turn() -> None:
    """Issue 18, defect 2: one request each from many connections was always admitted."""
    mib = 2**20
    limits = ClientLimits(512, 2**40, max_held=100 * mib)
    size = int(19.7 * mib)
    seq = iter(range(1000))

    def send(conn: bytes, uid: int) -> str | None:
        t = Ticket(next(seq), 0.0, peer=conn, size=size)
        over = limits.admit(t, uid)
        if over is not None:
            limits.done(t)  # answered at once
        return over

    # One user, a connection per request: three fit under three quarters of the bound.
    assert [send(b"h%d" % i, 1000) for i in range(3)] == [None] * 3
    over = send(b"h3", 1000)
    assert over is not None and "three quarters of the limit" in over
    assert "59.1 MiB of requests not yet answered" in over and "(19.7 MiB)" in over
    assert "server.max_bytes_in_flight" in over
    assert send(b"p0", 2000) is None  # a polite user: its turn in the last quarter
    assert send(b"p1", 2000) is not None  # but no more than a quarter
    assert send(b"q0", 3000) is None  # a third user: room up to the bound
    over = send(b"r0", 4000)
    assert over is not None and "would pass the limit of 100.0 MiB" in over
    assert limits.held == 5 * size


def test_a_lone_request_on_an_idle_daemon_is_taken_whatever_its_size() -> None:
    limits = ClientLimits(512, 2**40, max_held=2**20)
    big = Ticket(1, 0.0, peer=b"a", size=64 * 2**20)  # bounded by max_message_bytes
    assert limits.admit(big, 1) is None
    assert limits.admit(Ticket(2, 0.0, peer=b"b", size=10), 2) is not None


def test_what_decoding_makes_is_counted_and_given_back_and_no_request_is_exempt() -> None:
    """Issue 31, items 7-8: a lone request's frames are always taken, but what decoding
    them would make (unpacked int4, string objects) is counted before it is made and
    refused past a bound, and done() gives back exactly what was counted."""
    limits = ClientLimits(max_requests=8, max_bytes=100 * 2**20, max_held=64 * 2**20)
    lone = Ticket(1, 0.0, peer=b"a", size=200)
    assert limits.admit(lone) is None
    over = limits.decoding(lone, 80 * 2**20)  # 80 MiB once decoded, alone
    assert over is not None and "would take 80.0 MiB once decoded" in over
    assert "server.max_bytes_in_flight" in over and limits.held == lone.held
    limits.done(lone)
    assert limits.held == 0 and not limits.holds(b"a")
    ok = Ticket(2, 0.0, peer=b"a", size=200)
    assert limits.admit(ok) is None and limits.decoding(ok, 10 * 2**20) is None
    assert limits.held == ok.held == 200 + 10 * 2**20
    other = Ticket(3, 0.0, peer=b"b", size=100)
    assert limits.admit(other, owner=7) is None
    big = limits.decoding(other, 60 * 2**20)
    assert big is not None and "with the 10.0 MiB of requests the daemon holds already" in big
    limits.done(other)
    limits.done(ok)
    assert limits.held == 0
    per_client = ClientLimits(max_requests=8, max_bytes=2**20, max_held=0)
    t = Ticket(4, 0.0, peer=b"c", size=10)
    assert per_client.admit(t) is None
    assert "server.max_bytes_per_client" in (per_client.decoding(t, 2**20) or "")
