"""The watch (daemon/watch.py, issue 20 item 4): requests with a deadline are answered
when it passes whatever a stage does, and a stage stuck inside one call is reported once
(and again when it returns). The stuck stage is a real model's worker thread inside a
run that waits on a gate (tests/daemon/test_pipeline.py's Gated)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from inferd.daemon.config import load_config
from inferd.daemon.fairqueue import FairQueue
from inferd.daemon.watch import Watch
from inferd.daemon.model_threads import Queued, ModelThreads
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import LocalTicket, ReplySink
from tests.daemon.test_pipeline import Gated, cls_input, cls_model  # noqa: F401  (fixture)


class _Running:
    """The one thing the watch asks of the model manager: its running workers."""

    def __init__(self, workers: list[ModelThreads]) -> None:
        self.workers = workers

    def running_threads(self) -> list[ModelThreads]:
        return self.workers


class _Open:
    """The one thing the watch asks of the server: its open requests (here, tickets
    that drop out once answered, as the server's do)."""

    def __init__(self) -> None:
        self.tickets: list[LocalTicket] = []

    def open_tickets(self) -> list[LocalTicket]:
        return [t for t in self.tickets if t.code is None]


class _NoGraphs:
    def executors(self) -> list[tuple[str, Any]]:
        return []


class _Replies:
    def __init__(self) -> None:
        self.got: dict[str, list[Reply]] = {}
        self.cond = threading.Condition()

    def ticket(self, rid: str, timeout_ms: int | None) -> LocalTicket:
        def deliver(reply: Reply) -> None:
            with self.cond:
                self.got.setdefault(rid, []).append(reply)
                self.cond.notify_all()
        return LocalTicket(Request(rid, Op.INFER, model="m", timeout_ms=timeout_ms), deliver)

    def wait(self, rid: str, timeout: float = 30) -> Reply:
        with self.cond:
            assert self.cond.wait_for(lambda: rid in self.got, timeout), rid
            return self.got[rid][0]


def _watch(workers: list[ModelThreads] | None = None, stuck_after: float = 10.0,
           requests: _Open | None = None) -> Watch:
    config = load_config(None, {"models.stuck_after_s": stuck_after})
    return Watch(ReplySink(), requests or _Open(), _Running(workers or []), _NoGraphs(),
                 lambda: config)


def test_a_deadline_is_answered_when_it_passes_and_only_if_nothing_answered_first() -> None:
    requests = _Open()
    watch = _watch(requests=requests)
    watch.start()
    replies = _Replies()

    def arrive(rid: str, timeout_ms: int | None) -> LocalTicket:
        t = replies.ticket(rid, timeout_ms)
        requests.tickets.append(t)
        watch.track(t)
        return t
    try:
        arrive("later", 3600_000)
        t0 = time.monotonic()
        arrive("soon", 50)
        answered = arrive("answered", 50)
        ReplySink().send(answered, Reply("answered", outputs={}))
        arrive("none", None)  # no deadline: never expires
        reply = replies.wait("soon")
        assert reply.error.code is ErrorCode.DEADLINE_EXCEEDED
        assert "deadline of 50 ms passed" in reply.error.message
        assert time.monotonic() - t0 < 30
        arrive("end", 100)
        replies.wait("end")
        assert len(replies.got["answered"]) == 1 and replies.got["answered"][0].ok
        assert "later" not in replies.got and "none" not in replies.got
        # idle now (only "later" and "none" open, far or never): a new arrival wakes it
        requests.tickets = []
        while not watch._idle:  # the case under test: the thread sleeping, woken
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        arrive("woken", 50)
        assert replies.wait("woken").error.code is ErrorCode.DEADLINE_EXCEEDED
    finally:
        watch.stop()


def test_a_stuck_stage_is_reported_once_and_again_when_it_returns(
        cls_model: Any, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    gated = Gated(cls_model)
    work = FairQueue()
    workers = ModelThreads("m", gated, work, ReplySink())
    workers.start()
    watch = _watch([workers], stuck_after=0.1)
    got: list[Reply] = []
    work.put(Queued(LocalTicket(Request("r1", Op.INFER, model="m",
                                        inputs={"x": cls_input(0)}), got.append)))
    try:
        assert gated.entered.wait(30)
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.INFO, logger="inferd.daemon.watch"):
            while not watch.stuck():
                assert time.monotonic() < deadline
                watch.scan()
                time.sleep(0.02)
            watch.scan()
            watch.scan()
            assert list(watch.stuck()) == ["m"]
            assert watch.stuck()["m"][0].startswith("inferd-m-infer-0 (infer: running "
                                                     "request r1 for ")
            assert list(watch.all_stuck()) == ["m"]
            gated.gate.set()
            while not got:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            watch.scan()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and warnings[0].startswith("stage stuck: m inferd-m-infer-0")
        assert "(models.stuck_after_s = 0.1)" in warnings[0]
        assert any("stage no longer stuck: m inferd-m-infer-0 returned after" in
                   r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        assert watch.stuck() == {} and watch.all_stuck() == {}
    finally:
        gated.gate.set()
        assert workers.stop(30)
    assert got[0].ok
