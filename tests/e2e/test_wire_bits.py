"""The same bits every time, for every type (issue 19, items 3 and 4), through a real
daemon: one request resent with 16 header lengths gives one output, the one in-process
onnxruntime gives on an aligned input; bfloat16, float8 and 4-bit tensors travel both
ways bit for bit, from the Python client and from ``inferctl infer``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import zmq
from onnx import TensorProto, helper

from inferd.ipc.protocol import Op, Request, decode_reply, encode_request
from inferd.libbackends.contract import aligned

pytestmark = pytest.mark.slow  # each test runs a daemon or a child process: seconds

TYPES = {"b": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
         "f": (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
         "g": (TensorProto.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz),
         "i": (TensorProto.INT4, ml_dtypes.int4),
         "u": (TensorProto.UINT4, ml_dtypes.uint4)}


def _save(model: onnx.ModelProto, repo: Path, name: str) -> Path:
    path = repo / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(model, path)
    return path


def reduce_sum_model(repo: Path) -> Path:
    """ReduceSum over rows of 257 float32: onnxruntime's result depends on the input's
    address (3 different results over 16 offsets on this machine kind)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 257])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"])], "sum", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return _save(model, repo, "sum")


def casts_model(repo: Path) -> Path:
    """For each type of TYPES: input k, output k_f (as float32) and k (cast back)."""
    nodes, ins, outs = [], [], []
    for k, (tp, _) in TYPES.items():
        ins.append(helper.make_tensor_value_info(k, tp, [None]))
        outs += [helper.make_tensor_value_info(f"{k}_f", TensorProto.FLOAT, [None]),
                 helper.make_tensor_value_info(f"{k}_out", tp, [None])]
        nodes += [helper.make_node("Cast", [k], [f"{k}_f"], to=TensorProto.FLOAT),
                  helper.make_node("Cast", [f"{k}_f"], [f"{k}_out"], to=tp)]
    model = helper.make_model(helper.make_graph(nodes, "casts", ins, outs),
                              opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return _save(model, repo, "casts")


def test_one_request_with_16_header_lengths_gives_one_output(start_daemon, short_tmp):
    repo = short_tmp / "repo"
    path = reduce_sum_model(repo)
    x = np.random.default_rng(0).standard_normal((3, 257)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    expected = session.run(None, aligned({"x": x}))[0]
    d = start_daemon("--models", str(repo), "--preload", "sum")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    got = set()
    try:
        for pad in range(16):  # the tensor frame lands at 16 different offsets
            frames = encode_request(Request(f"r{pad}", Op.INFER, model="sum",
                                            inputs={"x": x}, params={"pad": "x" * pad}))
            sock.send_multipart(frames)
            reply = decode_reply(sock.recv_multipart())
            assert reply.ok, reply.error
            got.add(reply.outputs["y"].tobytes())
    finally:
        sock.close(0)
        ctx.term()
    assert got == {expected.tobytes()}


def test_bfloat16_float8_and_int4_travel_bit_for_bit(start_daemon, short_tmp):
    repo = short_tmp / "repo"
    casts_model(repo)
    d = start_daemon("--models", str(repo), "--preload", "casts")
    values = [1, 2, -3, 5, 0.5, 6]
    inputs = {k: np.array([v if k not in "iu" else int(abs(v)) % 8 for v in values],
                          dtype=dt) for k, (_, dt) in TYPES.items()}
    with d.client() as c:
        out = c.infer("casts", inputs)
        described = {s["name"]: s["dtype"] for s in c.models()[0]["inputs"]}
    assert described == {"b": "bfloat16", "f": "float8_e4m3fn", "g": "float8_e5m2fnuz",
                         "i": "int4", "u": "uint4"}
    for k, x in inputs.items():
        assert out[f"{k}_out"].dtype == x.dtype
        assert out[f"{k}_out"].tobytes() == x.tobytes(), k
        np.testing.assert_array_equal(out[f"{k}_f"], x.astype(np.float32))

    # inferctl: a .npy of bfloat16 (numpy saves it as raw |V2 items) read with :bfloat16
    np.save(short_tmp / "b.npy", inputs["b"])
    for k in "fgiu":
        np.save(short_tmp / f"{k}.npy", inputs[k])
    args = [f"{k}={short_tmp}/{k}.npy:{np.dtype(dt).name}" for k, (_, dt) in TYPES.items()]
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", d.endpoint,
                        "infer", "casts", *sum((["-i", a] for a in args), []),
                        "-o", str(short_tmp / "out")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "b_out: bfloat16[6]" in r.stdout and "[1.0, 2.0, -3.0, 5.0, 0.5, 6.0]" in r.stdout
    assert "i_out: int4[6]" in r.stdout
    saved = np.load(short_tmp / "out" / "b_out.npy").view(ml_dtypes.bfloat16)
    assert saved.tobytes() == inputs["b"].tobytes()
    saved = np.load(short_tmp / "out" / "i_out.npy").view(ml_dtypes.int4)
    assert saved.tolist() == inputs["i"].tolist()
