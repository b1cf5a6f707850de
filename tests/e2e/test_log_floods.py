"""A client sending the same bad request at full speed must not flood the journal
(issue 18, defect 6): repeated lines are rate-limited per cause, a client's bad input
never logs a traceback, an explicit load of a model whose files do not load is
remembered until its files change or a reload."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.ipc import Client, RequestError
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import Op
from tests.daemon.test_repository import add_model
from tests.links import link_tree

FLOOD_S = 5.0
LINES_PER_S = 20

CYCLE = """
inputs = ["x"]
[outputs]
y = "a.y"
[[nodes]]
name = "a"
processor = "softmax"
inputs = { x = "b.y" }
[[nodes]]
name = "b"
processor = "softmax"
inputs = { x = "a.y" }
"""


def _repo(root: Path, models_dir: Path) -> Path:
    repo = root / "repo"
    for name in ("ocr", "ocr-det", "ocr-cls", "ocr-rec"):
        link_tree(models_dir / name, repo / name)
    (repo / "garbage" / "1").mkdir(parents=True)
    (repo / "garbage" / "1" / "model.onnx").write_bytes(b"not a model" * 100)
    (repo / "cycle").mkdir()
    (repo / "cycle" / "graph.toml").write_text(CYCLE)
    return repo


def _lines(d: Any) -> int:
    return len(d.log().splitlines())


@pytest.mark.slow
def test_an_explicit_load_of_a_broken_model_is_remembered_until_its_files_change(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    d = start_daemon("--models", str(_repo(short_tmp, models_dir)))
    with d.client(timeout=120) as c:
        for _ in range(50):
            with pytest.raises(RequestError) as e:
                c.load("garbage")
            assert e.value.code is ErrorCode.INTERNAL  # the model's fault (protocol.md)
            assert "INVALID_PROTOBUF" in e.value.message or "cannot" in e.value.message
        assert "have not changed since" in e.value.message
        assert d.log().count("model garbage version 1 failed to load") == 1
        (short_tmp / "repo" / "garbage" / "1" / "model.onnx").write_bytes(add_model(1.0))
        assert c.load("garbage")["state"] == "ready"  # new files: tried again
        (short_tmp / "repo" / "garbage" / "1" / "model.onnx").write_bytes(b"broken")
        c.call(Op.RELOAD)  # the reload loads the changed file again: it fails
        with pytest.raises(RequestError):
            c.load("garbage")
        failures = d.log().count("model garbage version 1 failed to load")
        c.call(Op.RELOAD)  # a reload: tried again (and fails again)
        with pytest.raises(RequestError):
            c.load("garbage")
        assert d.log().count("model garbage version 1 failed to load") == failures + 1


def _flood(endpoint: str, kind: str, until: float, counts: dict[str, int],
           codes: dict[str, set[str]]) -> None:
    x = np.zeros((1, 4), np.float32)
    calls = {
        "empty image": lambda c: c.infer("ocr", {"image": np.zeros((0, 0, 3), np.uint8)}),
        "broken model": lambda c: c.load("garbage"),
        "graph cycle": lambda c: c.infer("cycle", {"x": x}),
        "unknown model": lambda c: c.infer("ocr-dte", {"x": x}),
    }
    with Client(endpoint, timeout=60) as c:
        while time.monotonic() < until:
            try:
                calls[kind](c)
            except RequestError as e:
                codes[kind].add(str(e.code))
            counts[kind] += 1


@pytest.mark.slow
def test_five_seconds_of_bad_requests_at_full_speed_write_a_few_lines(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    d = start_daemon("--models", str(_repo(short_tmp, models_dir)))
    kinds = ("empty image", "broken model", "graph cycle", "unknown model")
    with d.client(timeout=120) as c:  # the OCR graph's models, loaded before the clock
        assert c.call(Op.LOAD, "ocr")
        with pytest.raises(RequestError):  # and the broken model's one real try (a worker
            c.load("garbage")               # started, an engine imported: seconds at load)
    counts = dict.fromkeys(kinds, 0)
    codes: dict[str, set[str]] = {k: set() for k in kinds}
    before = _lines(d)
    until = time.monotonic() + FLOOD_S
    threads = [threading.Thread(target=_flood, args=(d.endpoint, k, until, counts, codes))
               for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(n >= 50 for n in counts.values()), counts
    assert codes == {"empty image": {"INVALID_ARGUMENT"}, "broken model": {"INTERNAL"},
                     "graph cycle": {"INVALID_ARGUMENT"}, "unknown model": {"NOT_FOUND"}}
    written = _lines(d) - before
    assert written <= LINES_PER_S * FLOOD_S, f"{written} lines for {counts}:\n{d.log()}"
    assert "Traceback" not in d.log()
    # The summaries come when each interval ends, naming the cause.
    deadline = time.monotonic() + 30
    while "more like this in the last" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.1)


@pytest.mark.slow
def test_a_refused_peer_reconnecting_at_full_speed_writes_a_few_lines(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    config = short_tmp / "inferd.toml"
    config.write_text(f"[access]\nuids = [{os.getuid() + 4242}]\n")
    d = start_daemon("--config", str(config), ready=False)
    deadline = time.monotonic() + 60
    while "ready;" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    before, n = _lines(d), 0
    until = time.monotonic() + FLOOD_S
    while time.monotonic() < until:
        with Client(d.endpoint, timeout=30) as c:  # a new connection each time
            with pytest.raises(RequestError) as e:
                c.ping()
            assert e.value.code is ErrorCode.PERMISSION_DENIED
        n += 1
    written = _lines(d) - before
    assert n >= 100, n
    assert written <= LINES_PER_S * FLOOD_S, f"{written} lines for {n} connections"
