"""Who keeps killing a worker (daemon/workers/quarantine.py): a client charged with N
deaths of a model's workers within a minute is refused for that model only; a model that
killed its worker for M clients is set aside until lifted; the window forgets."""

from __future__ import annotations

import pytest

from inferd.daemon.workers import quarantine as q
from inferd.daemon.workers.quarantine import Quarantine
from inferd.ipc.errors import ErrorCode, InferdError


def test_a_client_is_refused_after_n_deaths_for_that_model_only():
    qu = Quarantine(refuse_after=3, refuse_s=60, set_aside_after=5)
    for _ in range(2):
        qu.death("vad", [1000], "engine onnxruntime (worker 1) died of SIGABRT")
        qu.check("vad", 1000)  # not yet
    qu.death("vad", [1000, None], "...")  # None: a graph's own call, never charged
    with pytest.raises(InferdError) as e:
        qu.check("vad", 1000)
    assert e.value.code is ErrorCode.UNAVAILABLE
    assert e.value.message.startswith("model vad: uid 1000 is refused for 60 s more: its "
                                      "requests were running at 3 deaths")
    qu.check("vad", 1001)  # a neighbour is served
    qu.check("ocr-cls", 1000)  # and the same client on another model
    assert "vad" not in qu.set_aside


def test_a_refusal_ends(monkeypatch):
    qu = Quarantine(refuse_after=1, refuse_s=5, set_aside_after=9)
    now = [100.0]
    monkeypatch.setattr(q.time, "monotonic", lambda: now[0])  # the clock, not a sleep
    qu.death("vad", [7], "x")
    with pytest.raises(InferdError):
        qu.check("vad", 7)
    now[0] += 6
    qu.check("vad", 7)


def test_a_model_that_kills_its_worker_for_m_clients_is_set_aside_until_lifted(monkeypatch):
    qu = Quarantine(refuse_after=10, refuse_s=60, set_aside_after=3)
    now = [0.0]
    monkeypatch.setattr(q.time, "monotonic", lambda: now[0])
    qu.death("vad", [1], "a")
    now[0] += 61  # out of the window: forgotten
    qu.death("vad", [2], "b")
    qu.death("vad", [3], "c")
    assert "vad" not in qu.set_aside
    qu.death("vad", [4], "engine onnxruntime (worker 9) died of SIGSEGV while running vad")
    assert qu.set_aside["vad"].startswith("set aside: its runs killed its worker for 3 "
                                          "clients within 60 s (uids 2, 3, 4; last: engine")
    with pytest.raises(InferdError) as e:
        qu.check("vad", 99)  # everyone
    assert e.value.message.startswith("model vad is set aside")
    qu.check("ocr-cls", 99)
    qu.lift("vad")
    qu.check("vad", 99)
    qu.death("ocr-cls", [1, 2, 3], "x")
    assert "ocr-cls" in qu.set_aside
    qu.lift()
    assert qu.set_aside == {}
