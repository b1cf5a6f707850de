"""The ops off the I/O thread (issue 18, defect 7): each client's inline ops take their
turn (a burst, then inline.RATE a second), so one that floods status, models, metrics
or unknown names waits behind its own requests, not the others'; too many waiting are
refused at once; every request gets one reply."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from inferd.daemon import inline
from inferd.daemon.inline import InlineOps
from inferd.ipc import Client
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import Ticket


def test_a_flooding_client_waits_behind_its_own_requests_not_the_others() -> None:
    ran: list[str] = []
    done = threading.Event()
    replies: list[Reply] = []

    def reply(ticket: Ticket, r: Reply) -> None:
        replies.append(r)
        if len(replies) == 31:
            done.set()

    ops = InlineOps(reply, dict)
    ops.start()
    try:
        for i in range(30):
            req = Request(f"a{i}", Op.STATUS)
            ops.submit(Ticket(i, 0.0, req, peer=b"A"),
                       lambda i=i: (ran.append(f"a{i}"), Reply(f"a{i}", result={}))[1])
        req = Request("b", Op.STATUS)
        ops.submit(Ticket(99, 0.0, req, peer=b"B"),
                   lambda: (ran.append("b"), Reply("b", result={}))[1])
        assert done.wait(30)
    finally:
        ops.stop()
    # A's burst first (it came first), then B, then the rest of A at A's rate.
    assert ran.index("b") <= inline.BURST + 1
    assert sorted(ran) == sorted([f"a{i}" for i in range(30)] + ["b"])


@pytest.mark.slow
def test_too_many_waiting_are_refused_and_every_request_is_answered(
        start_daemon: Any, short_tmp: Path) -> None:
    d = start_daemon()
    n = inline.MAX_WAITING + 40
    with Client(d.endpoint, timeout=60, max_in_flight=n) as c, d.client() as other:
        pending = [c.submit(Op.STATUS) for _ in range(n)]
        assert other.status()["ready"]  # another client: its own turn, at once
        replies = [p.reply(60) for p in pending]
    refused = [r for r in replies if r.error is not None]
    assert refused, "none refused"
    assert all(r.error.code is ErrorCode.RESOURCE_EXHAUSTED for r in refused)
    assert "status, models, metrics or backends requests waiting" in refused[0].error.message
    assert len(replies) - len(refused) >= inline.MAX_WAITING
