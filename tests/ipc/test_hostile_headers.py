"""Hostile request headers (issue 12, items 1, 3, 4 and 13), decoded without sockets:
each is INVALID_ARGUMENT carrying the request's id, and nothing is parsed, recursed or
allocated in proportion to what the header claims."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from inferd.ipc.errors import ErrorCode, ProtocolError
from inferd.ipc.header import MAX_DEPTH, MAX_HEADER_BYTES, depth, first_key_id
from inferd.ipc.protocol import TAG, decode_request, peek_request_id


def _msg(header: str | bytes, *frames: bytes) -> list[bytes]:
    raw = header.encode() if isinstance(header, str) else header
    return [TAG, raw, *frames]


def _infer(spec: str, frame: bytes = b"") -> list[bytes]:
    return _msg('{"id":"r7","op":"infer","model":"m","inputs":[%s]}' % spec, frame)


HOSTILE = {
    "5000-digit integer": _msg('{"id":"r7","op":"ping","n":' + "9" * 5000 + "}"),
    "negative 5000-digit integer": _msg('{"id":"r7","op":"ping","n":-' + "9" * 5000 + "}"),
    "100,000-deep array": _msg('{"id":"r7","op":"ping","n":' + "[" * 100_000
                               + "]" * 100_000 + "}"),
    "100,000-deep objects": _msg('{"id":"r7","op":"ping","n":' + '{"a":' * 100_000
                                 + "1" + "}" * 100_000 + "}"),
    "unterminated deep array": _msg('{"id":"r7","op":"ping","n":' + "[" * 100_000),
    "timeout_ms NaN": _msg('{"id":"r7","op":"ping","timeout_ms":NaN}'),
    "timeout_ms Infinity": _msg('{"id":"r7","op":"ping","timeout_ms":Infinity}'),
    "timeout_ms -Infinity": _msg('{"id":"r7","op":"ping","timeout_ms":-Infinity}'),
    "timeout_ms 1e400": _msg('{"id":"r7","op":"ping","timeout_ms":1e400}'),
    "timeout_ms 10**30": _msg('{"id":"r7","op":"ping","timeout_ms":1' + "0" * 30 + "}"),
    "keep_alive 10**400": _msg('{"id":"r7","op":"infer","model":"m","keep_alive":1'
                               + "0" * 400 + "}"),
    "dimension 2**62, empty frame": _infer('{"name":"x","dtype":"float32","shape":[%d]}'
                                           % 2**62),
    "dimensions overflowing int64": _infer('{"name":"x","dtype":"uint8","shape":[%d,%d,0]}'
                                           % (2**62, 2**62)),
    "rank 70": _infer('{"name":"x","dtype":"float32","shape":[%s]}' % ",".join(["1"] * 70)),
    "string tensor of 2*10**8 elements, empty frame":
        _infer('{"name":"s","dtype":"string","shape":[200000000]}'),
    "string tensor of 2*10**8 elements, 8-byte frame":
        _infer('{"name":"s","dtype":"string","shape":[200000000]}', b"\0" * 8),
    "missing op": _msg('{"id":"r7"}'),
    "op null": _msg('{"id":"r7","op":null}'),
    "op a list": _msg('{"id":"r7","op":["infer"]}'),
    "header of 1 MiB": _msg('{"id":"r7","op":"ping","pad":"' + "x" * 2**20 + '"}'),
    "shape of floats": _infer('{"name":"x","dtype":"float32","shape":[1.5]}'),
    "shape of booleans": _infer('{"name":"x","dtype":"float32","shape":[true]}'),
    "long tensor name": _infer('{"name":"%s","dtype":"float32","shape":[0]}' % ("n" * 5000)),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_header_is_invalid_argument_with_its_id(name):
    # No allocation in proportion to the claims: the peak of what the decoding itself
    # allocates (Python objects and numpy arrays, freed again or not), not the process's
    # peak RSS, which an earlier test may have raised above anything this one does.
    received = sum(len(frame) for frame in HOSTILE[name])
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start = time.process_time()
    try:
        with pytest.raises(ProtocolError) as info:
            decode_request(HOSTILE[name])
        grown = tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    assert info.value.code is ErrorCode.INVALID_ARGUMENT, info.value.message
    assert info.value.request_id == "r7", info.value.message
    assert len(info.value.message) < 400  # the client's bytes are not echoed at length
    assert grown < 2 * received + 2**20, f"{grown} bytes allocated for {received} received"
    assert time.process_time() - start < 5  # generous: a hang would be minutes


def test_unknown_op_string_stays_unsupported():
    with pytest.raises(ProtocolError) as info:
        decode_request(_msg('{"id":"r7","op":"explode"}'))
    assert info.value.code is ErrorCode.UNSUPPORTED and info.value.request_id == "r7"


def test_numbers_within_the_bounds_still_parse():
    req = decode_request(_msg(json.dumps({"id": "a", "op": "ping", "timeout_ms": 2.5,
                                          "n": -(2**63), "m": 2**64 - 1,
                                          "nest": [[[[1]]]]})))
    assert req.timeout_ms == 2 and req.params["n"] == -(2**63)
    assert req.params["m"] == 2**64 - 1


def test_depth_counts_nesting_and_ignores_brackets_in_strings():
    assert depth(b'{"a":[[1]]}') == 3
    many = b'{"s":"' + b"[" * 1000 + b'","a":[1],"b":[2]}'
    assert depth(many) == 2
    assert depth(b"[" * (MAX_DEPTH + 5)) == MAX_DEPTH + 5
    assert depth(b'"\\"' + b"[" * 100) == 0  # all inside one unterminated string


def test_first_key_id_is_bounded_and_only_reads_a_leading_id():
    assert first_key_id(b' { "id" : "abc" , "op": 1') == "abc"
    assert first_key_id(b'{"id":"a\\"b","x":') == 'a"b'
    assert first_key_id(b'{"op":"ping","id":"abc"}') is None
    assert first_key_id(b'{"id":"' + b"x" * 300 + b'"}') is None
    assert peek_request_id([TAG, b'{"id":"q","n":' + b"9" * 10_000]) == "q"
    assert peek_request_id([TAG]) is None


def test_header_size_bound_is_exact():
    base = '{"id":"a","op":"ping","pad":"'
    fits = base + "x" * (MAX_HEADER_BYTES - len(base) - 2) + '"}'
    assert decode_request(_msg(fits)).id == "a"
    with pytest.raises(ProtocolError):
        decode_request(_msg(fits[:-2] + 'x"}'))
