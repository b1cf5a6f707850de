"""Protocol v1 framing, tested without sockets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferd.ipc.errors import ErrorCode, Failure, ProtocolError
from inferd.ipc.protocol import (
    TAG, Op, Reply, Request, decode_reply, decode_request, encode_reply, encode_request,
)


def _bytes(frames):
    return [bytes(f) for f in frames]


def test_request_round_trip_keeps_every_field_and_tensor():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    sr = np.array(16000, dtype=np.int64)
    req = Request(id="r1", op=Op.INFER, model="m", version=2, inputs={"x": x, "sr": sr},
                  outputs=["y"], timeout_ms=500, params={"keep_alive": 30})
    got = decode_request(_bytes(encode_request(req)))
    assert (got.id, got.op, got.model, got.version, got.outputs, got.timeout_ms) == \
        ("r1", Op.INFER, "m", 2, ["y"], 500)
    assert got.params == {"keep_alive": 30}
    np.testing.assert_array_equal(got.inputs["x"], x)
    assert got.inputs["x"].dtype == np.float32 and got.inputs["sr"].shape == ()
    assert int(got.inputs["sr"]) == 16000


def test_tensor_frames_are_views_not_copies():
    x = np.ones((4, 4), dtype=np.float32)
    frames = encode_request(Request(id="a", op=Op.INFER, model="m", inputs={"x": x}))
    view = np.frombuffer(frames[2], dtype=np.float32)
    x[0, 0] = 7.0
    assert view[0] == 7.0


def test_decoded_tensors_share_the_received_buffer():
    buf = bytearray(np.arange(4, dtype=np.int32).tobytes())
    header = json.dumps({"id": "a", "op": "infer", "model": "m",
                         "inputs": [{"name": "x", "dtype": "int32", "shape": [4]}]}).encode()
    got = decode_request([TAG, header, buf]).inputs["x"]
    buf[0] = 9
    assert got[0] == 9


def test_string_tensors_round_trip():
    texts = np.array(["hello", "", "naïve ✓"], dtype=object)
    reply = decode_reply(_bytes(encode_reply(Reply(id="s", outputs={"texts": texts}))))
    assert reply.outputs["texts"].tolist() == ["hello", "", "naïve ✓"]


def test_error_reply_round_trip():
    error = Failure(ErrorCode.NOT_FOUND, "no")
    reply = decode_reply(_bytes(encode_reply(Reply(id="e", error=error))))
    assert not reply.ok and reply.error == (ErrorCode.NOT_FOUND, "no")


def _raw(header, *frames, tag=TAG):
    return [tag, json.dumps(header).encode() if isinstance(header, dict) else header, *frames]


@pytest.mark.parametrize("frames, code, words", [
    ([TAG], ErrorCode.INVALID_ARGUMENT, "at least 2"),
    (_raw({"id": "a", "op": "ping"}, tag=b"HTTP/1.1"), ErrorCode.INVALID_ARGUMENT, "tag"),
    (_raw(b"{not json"), ErrorCode.INVALID_ARGUMENT, "JSON"),
    (_raw(b"[1, 2]"), ErrorCode.INVALID_ARGUMENT, "object"),
    (_raw({"op": "ping"}), ErrorCode.INVALID_ARGUMENT, "'id'"),
    (_raw({"id": "a", "op": "fly"}), ErrorCode.UNSUPPORTED, "unknown op"),
    (_raw({"id": "a", "op": "infer", "model": "m",
           "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}),
     ErrorCode.INVALID_ARGUMENT, "1 tensors but 0"),
    (_raw({"id": "a", "op": "infer", "model": "m",
           "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}, b"123"),
     ErrorCode.INVALID_ARGUMENT, "8 bytes, but its frame has 3"),
    (_raw({"id": "a", "op": "infer", "model": "m",
           "inputs": [{"name": "x", "dtype": "complex64", "shape": [1]}]}, b"12345678"),
     ErrorCode.INVALID_ARGUMENT, "dtype"),
    (_raw({"id": "a", "op": "infer", "model": "m",
           "inputs": [{"name": "x", "dtype": "uint8", "shape": [-1]}]}, b""),
     ErrorCode.INVALID_ARGUMENT, "shape"),
    (_raw({"id": "a", "op": "infer", "model": "m", "timeout_ms": -1}),
     ErrorCode.INVALID_ARGUMENT, "timeout_ms"),
])
def test_malformed_requests_raise_protocol_errors_with_codes(frames, code, words):
    with pytest.raises(ProtocolError) as info:
        decode_request(frames)
    assert info.value.code == code
    assert words in info.value.message


def test_protocol_error_keeps_the_request_id_when_it_was_readable():
    with pytest.raises(ProtocolError) as info:
        decode_request(_raw({"id": "keep-me", "op": "nope"}))
    assert info.value.request_id == "keep-me"


def test_a_tensor_at_an_offset_past_its_regions_end_is_refused_even_of_zero_bytes() -> None:
    """Issue 31, item 12: a zero-byte tensor named past a region's end was taken (its
    empty slice fits); the offset itself is bounded now, the end itself still allowed."""
    region = memoryview(bytearray(64))

    def resolve(token: str) -> memoryview:
        return region

    def request(offset: int) -> list[bytes]:
        header = {"id": "r", "op": "infer", "model": "m", "inputs": [
            {"name": "x", "dtype": "float32", "shape": [0, 3], "region": "r1",
             "offset": offset}]}
        return [TAG, json.dumps(header).encode()]

    assert decode_request(request(64), resolve).inputs["x"].shape == (0, 3)
    with pytest.raises(ProtocolError, match="offset 65 is past the end of its region "
                                            r"\(64 bytes\)") as e:
        decode_request(request(65), resolve)
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and e.value.request_id == "r"


def test_a_stream_field_round_trips_and_is_checked():
    from inferd.ipc.protocol import StreamRef

    req = Request(id="r1", op=Op.INFER, model="vad",
                  inputs={"input": np.zeros((1, 512), np.float32)},
                  stream=StreamRef("mic-0.left_1", start=True))
    frames = encode_request(req)
    assert json.loads(bytes(frames[1]))["stream"] == {"id": "mic-0.left_1", "start": True}
    back = decode_request(_bytes(frames))
    assert back.stream == StreamRef("mic-0.left_1", True, False) and "stream" not in back.params
    assert decode_request(_bytes(encode_request(Request(id="r2", op=Op.INFER, model="vad")))
                          ).stream is None

    def refused(stream, op="infer"):
        header = json.dumps({"id": "r3", "op": op, "model": "vad", "stream": stream})
        with pytest.raises(ProtocolError) as e:
            decode_request([TAG, header.encode()])
        assert e.value.code is ErrorCode.INVALID_ARGUMENT and e.value.request_id == "r3"
        return e.value.message

    assert refused("s1") == ("'stream' must be an object with 'id' and optionally 'start' "
                             "and 'end', got 's1'")
    assert refused({"id": "a/b"}) == ("'stream': 'id' must be a string of 1 to 64 "
                                      "characters from A-Z a-z 0-9 . _ -, got 'a/b'")
    assert refused({"id": "x" * 65}).startswith("'stream': 'id' must be")
    assert refused({"id": ""}).startswith("'stream': 'id' must be")
    assert refused({"id": 7}).startswith("'stream': 'id' must be")
    assert refused({"id": "s", "start": 1}) == ("'stream': 'start' and 'end' must be true "
                                                "or false, got 1 and False")
    assert refused({"id": "s", "stop": True}) == ("'stream' has unknown keys ['stop']; it "
                                                  "takes 'id', 'start' and 'end'")
    assert refused({"id": "s"}, op="models") == "'stream' belongs to an infer, not to op models"
