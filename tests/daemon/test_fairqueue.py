"""The model queue that takes turns between clients (issue 12, item 5b)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import pytest

from inferd.daemon.fairqueue import FairQueue
from inferd.daemon.worker import STOP


@dataclass
class _Ticket:
    peer: bytes


@dataclass
class _Item:
    ticket: _Ticket
    n: int


def _item(peer: bytes, n: int) -> _Item:
    return _Item(_Ticket(peer), n)


def test_round_robin_between_clients_and_fifo_within_one():
    q = FairQueue()
    for n in range(500):
        q.put(_item(b"greedy", n))
    q.put(_item(b"polite", 0))
    q.put(_item(b"polite", 1))
    got = [q.get() for _ in range(6)]
    assert [(i.ticket.peer, i.n) for i in got] == [
        (b"greedy", 0), (b"polite", 0), (b"greedy", 1), (b"polite", 1), (b"greedy", 2),
        (b"greedy", 3)]
    assert q.qsize() == 496 and q.peers() == 1


def test_stop_comes_after_what_was_queued_before_it_and_leaves_later_requests():
    q = FairQueue()
    q.put(_item(b"a", 0))
    q.put(_item(b"a", 1))
    q.put(STOP)
    q.put(_item(b"b", 0))  # arrives during a drain: stays for the next load
    order = []
    while True:
        item = q.get(timeout=1)
        if item is STOP:
            break
        order.append((item.ticket.peer, item.n))
    assert (b"a", 0) in order and (b"a", 1) in order
    assert order.index((b"a", 1)) == len(order) - 1 or (b"b", 0) in order
    rest = []
    while not q.empty():
        rest.append(q.get_nowait())
    assert all(i is not STOP for i in rest)
    assert {(i.ticket.peer, i.n) for i in rest} | set(order) == {(b"a", 0), (b"a", 1),
                                                                 (b"b", 0)}


def test_get_times_out_and_get_nowait_raises_empty():
    q = FairQueue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_items_without_a_peer_and_many_threads_lose_nothing():
    q = FairQueue()
    got: list[object] = []
    lock = threading.Lock()

    def consume() -> None:
        while (item := q.get()) is not STOP:
            with lock:
                got.append(item)

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    local = _Item(_Ticket(b""), -1)  # a LocalTicket has no peer attribute: b"" too
    local.ticket = object()  # type: ignore[assignment]
    items = [_item(bytes([n % 7]), n) for n in range(2000)] + [local] * 100
    for item in items:
        q.put(item)
    for _ in threads:
        q.put(STOP)
    for t in threads:
        t.join(10)
    assert len(got) == len(items) and q.empty()


def test_drop_takes_out_one_clients_requests_and_the_others_keep_their_turns():
    q = FairQueue()
    for n in range(3):
        q.put(_item(b"gone", n))
        q.put(_item(b"stays", n))
    q.put(STOP)
    dropped = q.drop(b"gone")
    assert [(i.ticket.peer, i.n) for i in dropped] == [(b"gone", 0), (b"gone", 1),
                                                       (b"gone", 2)]
    assert q.drop(b"gone") == [] and q.drop(b"never") == []
    assert q.qsize() == 4 and q.peers() == 1
    # the dropped requests' tokens are skipped, not served as items
    got = [q.get(timeout=1) for _ in range(4)]
    assert [(i.ticket.peer, i.n) for i in got[:3]] == [(b"stays", 0), (b"stays", 1),
                                                       (b"stays", 2)]
    assert got[3] is STOP
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert q.qsize() == 0 and q.empty()


def test_a_get_waiting_through_dropped_tokens_still_gets_the_next_item():
    q = FairQueue()
    q.put(_item(b"gone", 0))
    q.drop(b"gone")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=5)))
    t.start()
    q.put(_item(b"next", 1))
    t.join(5)
    assert [(i.ticket.peer, i.n) for i in got] == [(b"next", 1)]  # type: ignore[attr-defined]
