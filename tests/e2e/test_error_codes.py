"""One test per row of docs/protocol.md's error codes table (issue 19, item 5), each
against a real daemon: the code a client's retry logic sees is the code the table says.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import zmq
from onnx import TensorProto, helper

from inferd.ipc import Client, RequestError
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import TAG, Op, Reply, Request, decode_reply, encode_request
from tests.links import link_tree

pytestmark = pytest.mark.slow  # each test runs a daemon or a child process: seconds

X = np.zeros((1, 3, 48, 192), np.float32)  # one ocr-cls input


def raw(endpoint: str, frames: list[Any]) -> Reply:
    """One request's frames sent as they are, and its reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        return decode_reply(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


def code_of(call: Any) -> tuple[ErrorCode, str]:
    with pytest.raises(RequestError) as e:
        call()
    return e.value.code, e.value.message


def repo_with(tmp: Path, models_dir: Path, *names: str) -> Path:
    repo = tmp / "repo"
    for name in names:
        (repo / name).mkdir(parents=True)
        link_tree(models_dir / name / "1", repo / name / "1")
    return repo


def _save(model: onnx.ModelProto, repo: Path, name: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, repo / name / "1" / "model.onnx")


@pytest.fixture(scope="module")
def served(module_daemon, models_dir):
    """One daemon with the demo models for the tests below that only send it requests
    (ocr-cls loaded; ocr-det is loaded by none but test_deadline_exceeded)."""
    return module_daemon("--models", str(models_dir), "--preload", "ocr-cls")


def test_invalid_argument(served) -> None:
    """Malformed messages and inputs that do not fit: fix the request."""
    d = served
    reply = raw(d.endpoint, [b"INFERD/0", b'{"id":"a","op":"ping"}'])
    assert reply.error is not None and reply.error.code is ErrorCode.INVALID_ARGUMENT
    assert raw(d.endpoint, [TAG, b'{"id":"b"}']).error.code is ErrorCode.INVALID_ARGUMENT
    with d.client() as c:
        for inputs in ({"x": X.astype(np.float64)}, {"x": X, "extra": X},
                       {"x": np.zeros((1, 3, 48), np.float32)}):
            code, message = code_of(lambda: c.infer("ocr-cls", inputs))
            assert code is ErrorCode.INVALID_ARGUMENT, message
        code, _ = code_of(lambda: c.infer("../etc", {"x": X}))
        assert code is ErrorCode.INVALID_ARGUMENT


def test_invalid_argument_found_by_the_engine(served) -> None:
    """Inputs the engine fails on because they hold no element, on an axis the model
    leaves free (onnxruntime says FAIL): the client's error, not INTERNAL (issue 31
    item 12). vad with a zero batch is not sent: it aborts onnxruntime (issue 30)."""
    _engine_refuses_empty_inputs(served)


def test_invalid_argument_found_by_the_engine_in_a_worker(start_daemon, short_tmp,
                                                          models_dir) -> None:
    """The same with the engine in a worker process: the code crosses over with it."""
    config = short_tmp / "inferd.toml"
    config.write_text('[workers]\nisolation = "backend"\n')
    d = start_daemon("--config", str(config), "--models", str(models_dir))
    _engine_refuses_empty_inputs(d)
    assert "worker onnxruntime started" in d.log(), d.log()


def _engine_refuses_empty_inputs(d) -> None:
    vad = {"input": np.zeros((1, 0), np.float32), "state": np.zeros((2, 1, 128), np.float32),
           "sr": np.array(16000, np.int64)}
    with d.client() as c:
        for name, inputs, empty in (
                ("ocr-rec", {"x": np.zeros((0, 3, 48, 320), np.float32)}, "'x' has shape [0, "),
                ("vad", vad, "'input' has shape [1, 0]")):
            code, message = code_of(lambda: c.infer(name, inputs))
            assert code is ErrorCode.INVALID_ARGUMENT, message
            assert f"an empty input: {empty}" in message, message
        # a zero on an axis the model fixes is refused before the engine sees it
        code, message = code_of(lambda: c.infer("ocr-rec", {"x": np.zeros((1, 0, 48, 320),
                                                                          np.float32)}))
        assert code is ErrorCode.INVALID_ARGUMENT and "axis 1 must be 3" in message, message
        assert c.ping()["ready"]


def test_not_found(served) -> None:
    d = served
    with d.client() as c:
        code, message = code_of(lambda: c.infer("idnetity", {"x": X}))
        assert code is ErrorCode.NOT_FOUND and "ocr-cls" in message  # lists what exists
        code, _ = code_of(lambda: c.infer("ocr-cls", {"x": X}, version=7))
        assert code is ErrorCode.NOT_FOUND


def test_unavailable_no_backend_can_run_the_model(start_daemon, short_tmp,
                                                  models_dir) -> None:
    """Try again later: a backend plugin may be installed, the daemon reloaded."""
    repo = repo_with(short_tmp, models_dir, "ocr-cls")
    (repo / "ocr-cls" / "model.toml").write_text('backends = ["npu"]\n')
    d = start_daemon("--models", str(repo))
    with d.client() as c:
        code, message = code_of(lambda: c.infer("ocr-cls", {"x": X}))
    assert code is ErrorCode.UNAVAILABLE and "no backend can run it" in message, message
    # (the daemon shutting down: tests/ipc/test_server.py and tests/e2e/test_sigterm.py)


def test_permission_denied(start_daemon, short_tmp, models_dir) -> None:
    config = short_tmp / "inferd.toml"
    config.write_text(f"[access]\nuids = [{os.getuid() + 4242}]\n")
    d = start_daemon("--config", str(config), "--models", str(models_dir), ready=False)
    deadline = time.monotonic() + 60
    while "ready;" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    with Client(d.endpoint, timeout=10) as c:
        code, message = code_of(c.ping)
    assert code is ErrorCode.PERMISSION_DENIED and f"uid {os.getuid()}" in message


def test_resource_exhausted(start_daemon, short_tmp, models_dir) -> None:
    """Retry with backoff, except a message over the size limit: a client with only
    libzmq that sends a tensor in frames past the inline limit is told the limit and the
    way (shared memory), under its request's id; the limit is in ``ping``'s answer; the
    Python client moves the same tensor into shared memory by itself and is served."""
    config = short_tmp / "inferd.toml"
    config.write_text('[server]\nmax_message_bytes = "64KiB"\n')
    d = start_daemon("--config", str(config), "--models", str(models_dir))
    with d.client() as c, Client(d.endpoint, max_inline_bytes=None) as framing:
        assert c.ping()["max_message_bytes"] == 65536
        code, message = code_of(lambda: framing.infer("ocr-cls", {"x": X}))  # in frames
        assert code is ErrorCode.RESOURCE_EXHAUSTED and "max_message_bytes" in message
        scores = next(iter(c.infer("ocr-cls", {"x": X}).values()))  # in shared memory
        assert scores.shape == (1, 2)
    frames = encode_request(Request("raw-1", Op.INFER, model="ocr-cls", inputs={"x": X}))
    size = sum(memoryview(f).nbytes for f in frames)  # 110,592 bytes of tensor and more
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 30_000)
    raw.connect(d.endpoint)
    try:
        raw.send_multipart(frames, copy=False)
        reply = decode_reply(raw.recv_multipart())
    finally:
        raw.close(0)
        ctx.term()
    assert reply.id == "raw-1" and reply.error is not None
    assert reply.error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert reply.error.message == (
        f"message of {size} bytes is over the limit of 65536 bytes "
        "(server.max_message_bytes): send tensors this large through shared memory, named "
        "by region and offset (docs/protocol.md, \"Shared memory\"); a single frame over "
        "131072 bytes closes the connection")


def test_deadline_exceeded(served) -> None:
    """A request that waits past its timeout_ms (here: behind the model's load)."""
    d = served
    with d.client() as c:
        code, message = code_of(lambda: c.infer("ocr-det", {"x": np.zeros(
            (1, 3, 64, 64), np.float32)}, timeout=0.001))
    assert code is ErrorCode.DEADLINE_EXCEEDED, message


def test_unsupported(served) -> None:
    d = served
    reply = raw(d.endpoint, [TAG, b'{"id":"u","op":"frobnicate"}'])
    assert reply.id == "u" and reply.error is not None
    assert reply.error.code is ErrorCode.UNSUPPORTED and "frobnicate" in reply.error.message


def test_cancelled(start_daemon, models_dir) -> None:
    """A client gone with requests queued: they are dropped, counted CANCELLED."""
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-rec")
    x = np.zeros((1, 3, 48, 320), np.float32)
    ctx = zmq.Context()
    gone = ctx.socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 0)
    gone.connect(d.endpoint)
    with d.client() as c:
        for i in range(60):
            gone.send_multipart(encode_request(Request(f"g{i}", Op.INFER, "ocr-rec",
                                                       inputs={"x": x})))
        deadline = time.monotonic() + 60
        while next(m for m in c.models() if m["name"] == "ocr-rec")["queued"] < 10:
            assert time.monotonic() < deadline, "the requests never queued up"
            time.sleep(0.02)
        gone.close(0)
        ctx.term()

        def cancelled() -> float:
            return sum(v for n, lab, v in c.call("metrics")["samples"]
                       if n == "inferd_requests_total" and lab.get("code") == "CANCELLED")
        deadline = time.monotonic() + 60
        while cancelled() < 1:
            assert time.monotonic() < deadline, "no request was counted CANCELLED"
            time.sleep(0.05)
    assert "requests were still queued and are dropped" in d.log()


def test_internal(start_daemon, short_tmp) -> None:
    """The daemon's side failed: a model file its backend cannot load, and an engine
    failure while running (onnxruntime's FAIL status). Report it; do not retry."""
    repo = short_tmp / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = helper.make_tensor("s", TensorProto.INT64, [1], [7])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])], "r", [x], [y], initializer=[shape]),
        opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    _save(model, repo, "reshape7")
    d = start_daemon("--models", str(repo))
    with d.client() as c:
        code, message = code_of(lambda: c.infer("broken", {"x": X}))
        assert code is ErrorCode.INTERNAL and "broken" in message, message
        code, message = code_of(lambda: c.infer("broken", {"x": X}))  # held, same code
        assert code is ErrorCode.INTERNAL
        assert c.infer("reshape7", {"x": np.ones(7, np.float32)})["y"].shape == (7,)
        code, message = code_of(lambda: c.infer("reshape7", {"x": np.ones(6, np.float32)}))
        assert code is ErrorCode.INTERNAL and "onnxruntime failed to run" in message
