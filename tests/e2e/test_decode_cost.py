"""Admission counts what a request will cost before the I/O thread does anything
proportional to it (issue 31, items 6-8), against a real daemon.

Facts, not timings: the reply's code, whether the daemon's peak RSS moved by what
decoding would have made (the peak is reset before each request: ``clear_refs``), and
whether the request ran on the I/O thread (``io_thread_runs``). The timings (another
client's ping beside each case) are bench/bench_hostile.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.ipc import Region
from inferd.ipc.protocol import TAG

from tests.ipc.libinferd_kit import identity_model

MiB = 2**20


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _peak_growth(pid: int, send: Any) -> tuple[Any, int]:
    """(what ``send()`` returns, how far the daemon's peak RSS rose above its RSS
    before) with the peak reset first."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status(pid)["VmRSS"]
    result = send()
    return result, _status(pid)["VmHWM"] - before


def _raw(endpoint: str, header: dict[str, Any], *frames: bytes) -> dict[str, Any]:
    """Send one request as a client in any language would, and its reply's header."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart([TAG, json.dumps(header).encode(), *frames])
        assert s.poll(60_000), "no reply in 60 s"
        reply = s.recv_multipart()
    finally:
        s.close()
        ctx.term()
    return json.loads(reply[1])


def _int4_in_region(token: str, elements: int, model: str) -> dict[str, Any]:
    return {"id": "packed", "op": "infer", "model": model, "inputs": [
        {"name": "x", "dtype": "int4", "shape": [1, elements], "region": token,
         "offset": 0}]}


def _strings(count: int) -> bytes:
    """The wire frame of ``count`` two-byte strings (6 bytes each)."""
    return (np.uint32(2).tobytes() + b"ab") * count


@pytest.fixture
def int4_repo(short_tmp: Path) -> Path:
    repo = short_tmp / "repo"
    identity_model(repo / "id-int4" / "1" / "model.onnx", "int4")
    return repo


def test_a_packed_tensor_in_shared_memory_to_an_unknown_model_is_refused_undecoded(
        start_daemon, int4_repo: Path) -> None:
    """Item 7: a header-only request naming an int4 tensor that fills a 32 MiB region,
    for a model that does not exist (64 MiB once unpacked: within the default
    max_bytes_per_client). Before: unpacked on the I/O thread before the name was looked
    at (peak RSS about +96 MiB: the region read, 64 MiB unpacked). Now the name is
    refused first, nothing unpacked, the region not even read."""
    d = start_daemon("--models", str(int4_repo))
    with d.client() as c:
        region = c.register(Region(32 * MiB))
        assert region.token is not None
        header = _int4_in_region(region.token, 64 * MiB, "no-such-model")
        reply, growth = _peak_growth(d.proc.pid, lambda: _raw(d.endpoint, header))
    assert reply["status"] == "error" and reply["error"]["code"] == "NOT_FOUND", reply
    assert "id-int4" in reply["error"]["message"]  # what exists is listed
    assert growth < 24 * MiB, f"peak RSS +{growth / MiB:.0f} MiB"


def test_a_packed_tensor_is_priced_unpacked_against_max_bytes_in_flight(
        start_daemon, int4_repo: Path, short_tmp: Path) -> None:
    """Item 7: the same kind of request to a model that exists, under a 32 MiB bound:
    64 Mi int4 elements are 32 MiB in the region (the client's) and 64 MiB once
    unpacked (the daemon's). Before it was counted as its 150-byte header and run."""
    config = short_tmp / "inferd.toml"
    config.write_text('[server]\nmax_bytes_in_flight = "32MiB"\n')
    d = start_daemon("--config", str(config), "--models", str(int4_repo))
    with d.client() as c:
        region = c.register(Region(32 * MiB))
        assert region.token is not None
        header = _int4_in_region(region.token, 64 * MiB, "id-int4")
        reply, growth = _peak_growth(d.proc.pid, lambda: _raw(d.endpoint, header))
        assert c.ping()["pong"]
        # a small one still goes through, unpacked and run
        small = c.infer("id-int4", {"x": np.array([[1, -2, 7]], dtype=_int4())})["y"]
    assert reply["status"] == "error", reply
    assert reply["error"]["code"] == "RESOURCE_EXHAUSTED", reply
    assert "would take 64.0 MiB once decoded" in reply["error"]["message"], reply
    assert "server.max_bytes_in_flight" in reply["error"]["message"], reply
    assert growth < 24 * MiB, f"peak RSS +{growth / MiB:.0f} MiB"
    assert small.tolist() == [[1, -2, 7]]


def _int4() -> Any:
    import ml_dtypes

    return ml_dtypes.int4


def test_strings_to_an_unknown_model_are_refused_undecoded(start_daemon, int4_repo: Path,
                                                           short_tmp: Path) -> None:
    """Item 8: 1.2 million two-byte strings (a 7.2 MB frame, 96 MB priced: within the
    default max_bytes_per_client) to a model that does not exist. Before: decoded on
    the I/O thread first (1.2 million str objects, peak RSS about +85 MiB); now refused
    by name before anything is decoded (the frame itself is all the daemon holds). The
    strings come in frames (they cannot live in shared memory): max_message_bytes is set
    above them (its "auto" would close the connection on reading the frame's size)."""
    config = short_tmp / "inferd.toml"
    config.write_text('[server]\nmax_message_bytes = "16MiB"\n')
    d = start_daemon("--config", str(config), "--models", str(int4_repo))
    header = {"id": "strings", "op": "infer", "model": "no-such-model",
              "inputs": [{"name": "x", "dtype": "string", "shape": [1_200_000]}]}
    frame = _strings(1_200_000)
    reply, growth = _peak_growth(d.proc.pid, lambda: _raw(d.endpoint, header, frame))
    assert reply["status"] == "error" and reply["error"]["code"] == "NOT_FOUND", reply
    assert growth < 40 * MiB, f"peak RSS +{growth / MiB:.0f} MiB"


def test_strings_are_priced_as_objects_against_max_bytes_in_flight(
        start_daemon, int4_repo: Path, short_tmp: Path) -> None:
    """Item 8: 1 million two-byte strings are a 6 MB frame and 80 MB of Python objects
    once decoded (72 B each plus their text); under a 16 MiB bound the request is
    refused before decoding. Before it was taken (6 MB < 16 MiB) and decoded. In frames,
    with max_message_bytes above them (as above)."""
    config = short_tmp / "inferd.toml"
    config.write_text('[server]\nmax_bytes_in_flight = "16MiB"\nmax_message_bytes = "16MiB"\n')
    d = start_daemon("--config", str(config), "--models", str(int4_repo))
    header = {"id": "strings", "op": "infer", "model": "no-such-model",
              "inputs": [{"name": "x", "dtype": "string", "shape": [1_000_000]}]}
    reply, growth = _peak_growth(
        d.proc.pid, lambda: _raw(d.endpoint, header, _strings(1_000_000)))
    assert reply["status"] == "error", reply
    assert reply["error"]["code"] == "RESOURCE_EXHAUSTED", reply
    assert "once decoded" in reply["error"]["message"], reply
    assert growth < 40 * MiB, f"peak RSS +{growth / MiB:.0f} MiB"


def test_a_big_input_in_shared_memory_does_not_run_on_the_io_thread(
        start_daemon, short_tmp: Path) -> None:
    """Item 6: the I/O thread's fast path decided by the bytes of a request's frames,
    so a 16 MiB input in shared memory to a model whose small runs are short ran there
    (and another client's ping waited for it). It decides by the tensors' bytes
    wherever they are now: small requests still run there, the big one does not."""
    repo = short_tmp / "repo"
    identity_model(repo / "identity" / "1" / "model.onnx", "float32")
    config = short_tmp / "inferd.toml"  # 1 s: every run counts as short
    config.write_text('[models]\nio_run_max_us = 1000000\n[placement]\nmode = "first"\n')
    d = start_daemon("--config", str(config), "--models", str(repo), "--preload",
                     "identity")

    def io_runs(c: Any) -> int:
        return next(m for m in c.models() if m["name"] == "identity")["io_thread_runs"]

    with d.client() as c:
        x = np.ones((1, 4), np.float32)
        for _ in range(40):
            assert np.array_equal(c.infer("identity", {"x": x})["y"], x)
        before = io_runs(c)
        assert before > 0  # the fast path is on for this model
        region = c.register(Region(16 * MiB + 4096))
        big = region.ndarray((4, 1024 * 1024), np.float32)
        big[...] = 2.0
        assert np.array_equal(c.infer("identity", {"x": big})["y"], big)
        after_big = io_runs(c)
        assert np.array_equal(c.infer("identity", {"x": x})["y"], x)
        after_small = io_runs(c)
    assert after_big == before, "the 16 MiB shared-memory input ran on the I/O thread"
    assert after_small == before + 1
