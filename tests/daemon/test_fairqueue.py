"""The model queue that takes turns between clients (issue 12, item 5b)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import pytest

from inferd.daemon.fairqueue import FairQueue, QueueClosed
from inferd.daemon.stages import STOP


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


# --------------------------------------------------------------------------- batches


def _rows(item: _Item) -> int:
    return getattr(item, "rows", 1)


def _peers_of(batch: list[_Item]) -> list[tuple[bytes, int]]:
    return [(i.ticket.peer, i.n) for i in batch]


def test_a_batch_takes_turns_and_caps_each_clients_rows_at_its_share():
    """Issue 20 item 1, on turns: a polite request queued behind a greedy client's 500
    rides in the next batch, beside at most the greedy client's share of it (half of
    the limit with two clients), not beside 31 of its rows."""
    q = FairQueue()
    for n in range(500):
        q.put(_item(b"greedy", n))
    q.put(_item(b"polite", 0))
    batch = q.get_batch(32, _rows)
    assert (b"polite", 0) in _peers_of(batch)
    assert sum(1 for i in batch if i.ticket.peer == b"greedy") == 16
    assert _peers_of(batch)[:3] == [(b"greedy", 0), (b"polite", 0), (b"greedy", 1)]
    # alone, a client gets the whole batch, in order
    batch = q.get_batch(32, _rows)
    assert _peers_of(batch) == [(b"greedy", n) for n in range(16, 48)]
    # four clients waiting: each at most a quarter
    for peer in (b"a", b"b", b"c"):
        for n in range(20):
            q.put(_item(peer, n))
    batch = q.get_batch(32, _rows)
    counts = {p: sum(1 for i in batch if i.ticket.peer == p) for p in (b"greedy", b"a", b"b",
                                                                      b"c")}
    assert counts == {b"greedy": 8, b"a": 8, b"b": 8, b"c": 8}
    assert q.qsize() == 500 - 48 - 8 + 3 * 12


def test_a_batch_counts_rows_and_a_big_request_waits_for_the_next_batch():
    q = FairQueue()
    for n, rows in enumerate((3, 3, 6, 1)):
        item = _item(b"a", n)
        item.rows = rows  # type: ignore[attr-defined]
        q.put(item)
    assert [i.n for i in q.get_batch(8, _rows)] == [0, 1]  # 6 more rows would pass 8
    assert [i.n for i in q.get_batch(8, _rows)] == [2, 3]
    big = _item(b"a", 9)
    big.rows = 20  # type: ignore[attr-defined]
    q.put(big)
    assert [i.n for i in q.get_batch(8, _rows)] == [9]  # first: runs alone


def test_a_batch_ends_at_a_stop_that_comes_due_and_leaves_it_for_the_next_call():
    q = FairQueue()
    q.put(_item(b"a", 0))
    q.put(STOP)
    q.put(_item(b"a", 1))
    assert _peers_of(q.get_batch(8, _rows)) == [(b"a", 0)]
    assert q.get_batch(8, _rows) == [STOP]
    assert _peers_of(q.get_batch(8, _rows)) == [(b"a", 1)]


def test_a_batch_is_cut_to_an_allowed_size_and_the_rest_keeps_its_turn():
    q = FairQueue()
    for n in range(6):
        q.put(_item(b"a", n))
    q.put(_item(b"b", 0))
    batch = q.get_batch(8, _rows, allowed=lambda rows: rows in (1, 2, 4))
    assert len(batch) == 4 and q.qsize() == 3
    rest = q.get_batch(8, _rows)
    assert sorted(_peers_of(batch) + _peers_of(rest)) == sorted(
        [(b"a", n) for n in range(6)] + [(b"b", 0)])
    assert q.empty()


def test_a_batch_waits_for_company_until_it_is_full():
    q = FairQueue()
    q.put(_item(b"a", 0))
    late = threading.Timer(0.05, lambda: q.put(_item(b"b", 0)))
    late.start()
    batch = q.get_batch(2, _rows, delay=60.0)  # returns once full, not after 60 s
    late.join()
    assert _peers_of(batch) == [(b"a", 0), (b"b", 0)]
    # with no delay it takes what is there and returns
    q.put(_item(b"a", 1))
    assert len(q.get_batch(8, _rows)) == 1


def test_a_batch_waiting_for_company_returns_when_its_delay_passes_though_another_took_the_item():
    """A batch waits max_delay_ms for company; a request put near the end of that wait
    and taken at once by another thread must not keep it waiting (CPython 3.11's
    SimpleQueue.get with a timeout then waits forever: a stream's chunks stalled behind
    such a batch until the daemon stopped)."""
    import time

    q = FairQueue()
    slow = []
    for i in range(40):
        q.put(_item(b"a", i))
        done = threading.Event()
        took: list[float] = []

        def batch() -> None:
            t0 = time.monotonic()
            q.get_batch(4, _rows, delay=0.002)
            took.append(time.monotonic() - t0)
            done.set()
        t = threading.Thread(target=batch)
        t.start()
        time.sleep(0.0015)  # near the end of its delay: a put wakes it...
        q.put(_item(b"b", i))
        try:
            q.get_nowait()  # ...and another consumer takes the item first
        except queue.Empty:
            pass  # the batch took it after all
        if not done.wait(2):
            slow.append(i)
            q.put(_item(b"c", i))  # let it go
            done.wait(5)
        t.join(5)
        while not q.empty():
            q.get_nowait()
    assert slow == []


def test_a_bounded_queue_blocks_a_put_until_room_and_close_answers_the_waiting():
    q = FairQueue(maxsize=2)
    q.put(_item(b"a", 0))
    q.put(_item(b"a", 1))
    with pytest.raises(queue.Full):
        q.put(_item(b"a", 2), timeout=0.01)
    q.put(STOP)  # a sentinel never waits for room
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            q.put(_item(b"a", 3))
        except BaseException as e:  # noqa: BLE001  the test reads what it raised
            errors.append(e)
    t = threading.Thread(target=blocked)
    t.start()
    assert [i.n for i in q.close()] == [0, 1]
    t.join(10)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], QueueClosed)
    assert q.get(timeout=1) is STOP
    assert q.withdraw() == 0


def test_withdraw_takes_out_the_sentinels_and_leaves_the_requests():
    q = FairQueue()
    q.put(_item(b"a", 0))
    q.put(STOP)
    assert q.withdraw() == 1
    assert q.get(timeout=1).n == 0
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
