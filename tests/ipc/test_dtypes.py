"""Every ONNX tensor type on the wire (issue 19, item 3; issue 31, item 13): bfloat16,
the float8 types (e8m0 too), float4e2m1 and the 4-bit integers (packed two per byte, low
nibble first, as ONNX stores them) and the 2-bit integers (four per byte, lowest bits
first) round-trip bit for bit; without the ml_dtypes package they are refused with
UNSUPPORTED naming it."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from inferd.ipc.dtypes import ML_DTYPES, PACKED_BITS, pack, unpack, wire_size
from inferd.ipc.errors import ErrorCode, ProtocolError
from inferd.ipc.protocol import Op, Request, decode_request, encode_request


def _sample(name: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(getattr(ml_dtypes, name))
    rng = np.random.default_rng(7)
    if name in PACKED_BITS:  # every value of so few bits, as ml_dtypes holds them
        bits = rng.integers(0, 2 ** PACKED_BITS[name], shape, dtype=np.uint8)
        return bits.view(dt)
    # random bit patterns, NaNs included: compared as bytes
    bits = rng.integers(0, 2 ** (8 * dt.itemsize), shape, dtype=np.uint32)
    return bits.astype(np.uint16 if dt.itemsize == 2 else np.uint8).view(dt)


@pytest.mark.parametrize("name", ML_DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (2, 3, 5)])
def test_round_trip_is_bit_exact(name: str, shape: tuple[int, ...]) -> None:
    x = _sample(name, shape)
    frames = encode_request(Request("r", Op.INFER, model="m", inputs={"x": x}))
    assert len(bytes(frames[2])) == wire_size(name, x.size)
    got = decode_request([bytes(f) for f in frames]).inputs["x"]
    assert got.dtype == x.dtype and got.shape == x.shape
    assert got.tobytes() == x.tobytes()


def test_four_bit_types_are_packed_low_nibble_first() -> None:
    x = np.array([1, -3, 7], dtype=ml_dtypes.int4)
    assert pack(x) == bytes([0xD1, 0x07])  # -3 is 0xD; the odd last high nibble is 0
    assert unpack(b"\xd1\x07", "int4", 3).tolist() == x.tolist()
    u = np.array([[15, 0], [3, 9]], dtype=ml_dtypes.uint4)
    assert pack(u) == bytes([0x0F, 0x93])


def test_two_bit_types_are_packed_four_per_byte_lowest_bits_first() -> None:
    """As onnx.numpy_helper writes them (issue 31, item 13)."""
    from onnx import numpy_helper

    x = np.array([1, -2, 0, 1, -1], dtype=ml_dtypes.int2)
    assert pack(x) == numpy_helper.from_array(x).raw_data == bytes([0x49, 0x03])
    assert unpack(b"\x49\x03", "int2", 5).tolist() == x.tolist()
    u = np.array([3, 2, 1, 0, 3, 3], dtype=ml_dtypes.uint2)
    assert pack(u) == numpy_helper.from_array(u).raw_data == bytes([0x1B, 0x0F])
    f = np.array([1, -2, 0.5], dtype=ml_dtypes.float4_e2m1fn)
    assert pack(f) == numpy_helper.from_array(f).raw_data
    assert [wire_size(n, 5) for n in ("int2", "uint2", "float4_e2m1fn", "float8_e8m0fnu")] \
        == [2, 2, 3, 5]


def test_a_frame_of_the_wrong_size_is_refused() -> None:
    frames = encode_request(Request("r", Op.INFER, model="m",
                                    inputs={"x": np.zeros(5, ml_dtypes.int4)}))
    with pytest.raises(ProtocolError, match="which is 3 bytes .two elements per byte.") as e:
        decode_request([*frames[:2], b"\0\0\0\0\0"])
    assert e.value.code is ErrorCode.INVALID_ARGUMENT
    frames = encode_request(Request("r", Op.INFER, model="m",
                                    inputs={"x": np.zeros(5, ml_dtypes.uint2)}))
    with pytest.raises(ProtocolError, match="which is 2 bytes .four elements per byte.") as e:
        decode_request([*frames[:2], b"\0\0\0"])


def test_without_ml_dtypes_they_are_refused_naming_the_package() -> None:
    """The Debian package's case (no python3-ml-dtypes): a fresh interpreter where the
    import fails."""
    code = """
import sys
sys.modules["ml_dtypes"] = None  # import ml_dtypes raises ImportError
from inferd.ipc.protocol import decode_request
from inferd.ipc.errors import ProtocolError
header = (b'{"id":"r","op":"infer","model":"m","inputs":'
          b'[{"name":"x","dtype":"bfloat16","shape":[2]}]}')
try:
    decode_request([b"INFERD/1", header, b"\\0\\0\\0\\0"])
except ProtocolError as e:
    print(e.code, e.message)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("UNSUPPORTED request inputs: tensor 'x': dtype bfloat16 "
                               "needs the Python package ml_dtypes"), r.stdout


def test_ml_dtypes_is_imported_when_its_first_tensor_comes() -> None:
    """Its import takes about a second: a daemon, inferctl or client that never meets
    one of its types does not pay it; the first such tensor brings it in."""
    code = """
import sys
import numpy as np
import inferd.daemon.main, inferd.ipc.client, inferd.ipc.inferctl
print("before", "ml_dtypes" in sys.modules)
from inferd.ipc.protocol import decode_request
header = (b'{"id":"r","op":"infer","model":"m","inputs":'
          b'[{"name":"x","dtype":"bfloat16","shape":[2]}]}')
x = decode_request([b"INFERD/1", header, b"\\0\\x3f\\0\\x40"]).inputs["x"]
print("after", "ml_dtypes" in sys.modules, x.dtype, x.astype(np.float32).tolist())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["before False", "after True bfloat16 [0.5, 2.0]"], \
        r.stdout


def test_an_ml_dtypes_older_than_0_5_refuses_only_the_newer_types() -> None:
    """ml_dtypes 0.4 has bfloat16 and int4 but no int2, e8m0 or float4 (issue 31, item
    13): those are refused UNSUPPORTED, naming the version, the others still work."""
    code = """
import sys, types
import ml_dtypes
old = types.ModuleType("ml_dtypes")
old.__version__ = "0.4.1"
for name in ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
             "float8_e5m2fnuz", "int4", "uint4"):
    setattr(old, name, getattr(ml_dtypes, name))
sys.modules["ml_dtypes"] = old
from inferd.ipc.protocol import decode_request
from inferd.ipc.errors import ProtocolError
for dtype in ("int4", "int2"):
    header = ('{"id":"r","op":"infer","model":"m","inputs":'
              '[{"name":"x","dtype":"%s","shape":[2]}]}' % dtype).encode()
    try:
        print(decode_request([b"INFERD/1", header, bytes([0x21])]).inputs["x"].tolist())
    except ProtocolError as e:
        print(e.code, e.message)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == [
        "[1, 2]", "UNSUPPORTED request inputs: tensor 'x': dtype int2 needs ml_dtypes 0.5 "
        "or later; the one installed beside this inferd (0.4.1) lacks it (pip install -U "
        "ml-dtypes)"], r.stdout
