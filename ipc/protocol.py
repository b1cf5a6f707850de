"""Wire protocol v1: pure framing, no sockets (see docs/protocol.md).

A message is a list of frames::

    [TAG, header (UTF-8 JSON), tensor frame 0, tensor frame 1, ...]

The header lists every tensor (name, dtype, shape) in frame order. A numeric tensor is
its C-contiguous little-endian bytes; a ``string`` tensor is, per element, a uint32 LE
byte length followed by that many UTF-8 bytes. ``encode_*`` returns frames that
reference the arrays' memory (send them with ``copy=False``); ``decode_*`` builds arrays
over the received buffers with ``np.frombuffer`` after checking every byte count.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray
from zmq import Frame as ZmqFrame

from inferd.ipc.errors import ErrorCode, Failure, ProtocolError
from inferd.libbackends.dtypes import NUMERIC_DTYPES, STRING, WIRE_DTYPES, dtype_name

TAG = b"INFERD/1"
"""First frame of every request and reply; names the protocol and its major version."""

class Op(StrEnum):
    """Request operations."""

    INFER = "infer"
    MODELS = "models"
    STATUS = "status"
    LOAD = "load"
    UNLOAD = "unload"
    PING = "ping"
    BACKENDS = "backends"
    RELOAD = "reload"


Frame = bytes | memoryview | Any  # anything exporting the buffer protocol (zmq.Frame too)

_OPS = {op.value: op for op in Op}


@dataclass(slots=True)
class Request:
    """One decoded request.

    ``params`` holds the header keys this module does not interpret (for example
    ``keep_alive`` or ``verbose``), so later ops need no protocol change.
    """

    id: str
    op: Op
    model: str | None = None
    version: int | None = None
    inputs: dict[str, NDArray[Any]] = field(default_factory=dict)
    outputs: list[str] | None = None
    timeout_ms: int | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Reply:
    """One decoded reply: ``outputs`` and ``result`` on success, ``error`` otherwise."""

    id: str
    outputs: dict[str, NDArray[Any]] = field(default_factory=dict)
    result: Any = None
    error: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# --------------------------------------------------------------------------- tensors

def _encode_strings(array: NDArray[Any]) -> bytes:
    parts = []
    for item in array.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def _decode_strings(buf: memoryview, count: int, name: str) -> NDArray[Any]:
    out = np.empty(count, dtype=object)
    pos, size = 0, len(buf)
    for i in range(count):
        if pos + 4 > size:
            raise ProtocolError(f"tensor {name!r}: string frame ends inside element {i}")
        (length,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + length > size:
            raise ProtocolError(f"tensor {name!r}: string element {i} claims {length} bytes, "
                                f"frame has {size - pos} left")
        try:
            out[i] = bytes(buf[pos:pos + length]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"tensor {name!r}: string element {i} is not UTF-8") from e
        pos += length
    if pos != size:
        raise ProtocolError(f"tensor {name!r}: {size - pos} bytes left over after "
                            f"{count} string elements")
    return out


def encode_tensors(tensors: dict[str, NDArray[Any]]) -> tuple[list[dict[str, Any]], list[Frame]]:
    """Describe and frame tensors. Numeric frames are views of the arrays (no copy)."""
    specs: list[dict[str, Any]] = []
    frames: list[Frame] = []
    for name, value in tensors.items():
        array = np.asarray(value)
        dtype = dtype_name(array)
        specs.append({"name": name, "dtype": dtype, "shape": list(array.shape)})
        if dtype == STRING:
            frames.append(_encode_strings(array))
            continue
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        frames.append(np.ascontiguousarray(array).data)  # a view unless not contiguous
    return specs, frames


def _buffer(frame: Frame) -> memoryview:
    buf = frame.buffer if type(frame) is ZmqFrame else memoryview(frame)
    return buf.cast("B")


def _bytes(frame: Frame) -> bytes:
    return frame.bytes if type(frame) is ZmqFrame else bytes(_buffer(frame))


def _check_spec(spec: Any, where: str) -> tuple[str, str, tuple[int, ...]]:
    if not isinstance(spec, dict):
        raise ProtocolError(f"{where}: each tensor description must be an object")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}: tensor 'name' must be a non-empty string")
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"{where}: tensor {name!r} has dtype {dtype!r}; "
                            f"expected one of {', '.join(WIRE_DTYPES)}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"{where}: tensor {name!r} shape must be a list of "
                            f"non-negative integers, got {shape!r}")
    return name, dtype, tuple(shape)


def decode_tensors(specs: Any, frames: Sequence[Frame], where: str) -> dict[str, NDArray[Any]]:
    """Arrays over ``frames`` described by ``specs``; every byte count is checked."""
    if not isinstance(specs, list):
        raise ProtocolError(f"{where}: expected a list of tensor descriptions")
    if len(frames) != len(specs):
        raise ProtocolError(f"{where}: header describes {len(specs)} tensors but "
                            f"{len(frames)} tensor frames follow")
    tensors: dict[str, NDArray[Any]] = {}
    for spec, frame in zip(specs, frames):
        name, dtype, shape = _check_spec(spec, where)
        if name in tensors:
            raise ProtocolError(f"{where}: tensor {name!r} appears twice")
        count = math.prod(shape)
        if dtype == STRING:
            tensors[name] = _decode_strings(_buffer(frame), count, name).reshape(shape)
            continue
        # A zmq.Frame exports its bytes directly; anything else through a byte view.
        buf = frame if type(frame) is ZmqFrame else _buffer(frame)
        np_dtype = NUMERIC_DTYPES[dtype]
        expected = count * np_dtype.itemsize
        if len(buf) != expected:
            raise ProtocolError(f"{where}: tensor {name!r} is {dtype}{list(shape)}, "
                                f"which is {expected} bytes, but its frame has {len(buf)}")
        array = np.frombuffer(buf, dtype=np_dtype).reshape(shape)  # type: ignore[arg-type]
        if not array.flags.aligned:  # libzmq may hand out small frames at odd offsets
            array = array.copy()
        tensors[name] = array
    return tensors


# --------------------------------------------------------------------------- messages

def _header(frames: Sequence[Frame], kind: str) -> dict[str, Any]:
    if len(frames) < 2:
        raise ProtocolError(f"{kind} has {len(frames)} frames; expected at least 2 "
                            f"(protocol tag and header)")
    tag = _bytes(frames[0])
    if tag != TAG:
        raise ProtocolError(f"{kind} starts with protocol tag {tag[:32]!r}; expected {TAG!r}")
    try:
        # Decoded first: json.loads on bytes would guess the encoding each time.
        header = json.loads(_bytes(frames[1]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{kind} header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(f"{kind} header must be a JSON object")
    return header


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps would build one per call


def _dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode("utf-8")


_REQUEST_KEYS = {"id", "op", "model", "version", "inputs", "outputs", "timeout_ms"}


def encode_request(request: Request) -> list[Frame]:
    """Frames of ``request``; tensor frames are views of the input arrays."""
    specs, frames = encode_tensors(request.inputs)
    header: dict[str, Any] = {"id": request.id, "op": str(request.op)}
    if request.model is not None:
        header["model"] = request.model
    if request.version is not None:
        header["version"] = request.version
    if specs:
        header["inputs"] = specs
    if request.outputs is not None:
        header["outputs"] = list(request.outputs)
    if request.timeout_ms is not None:
        header["timeout_ms"] = request.timeout_ms
    header.update(request.params)
    return [TAG, _dumps(header), *frames]


def peek_request_id(frames: Sequence[Frame]) -> str | None:
    """The request id of a message, if one can be read; used to address error replies."""
    try:
        rid = _header(frames, "request").get("id")
    except ProtocolError:
        return None
    return rid if isinstance(rid, str) else None


def decode_request(frames: Sequence[Frame]) -> Request:
    """Decode a request. Raises ProtocolError (with ``request_id`` when known)."""
    header = _header(frames, "request")
    rid = header.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise ProtocolError("request header needs 'id': a non-empty string of at most 256 "
                            "characters")
    try:
        op_name = header.get("op")
        op = _OPS.get(op_name) if type(op_name) is str else None
        if op is None:
            raise ProtocolError(f"unknown op {header.get('op')!r}; expected one of "
                                f"{', '.join(o.value for o in Op)}", ErrorCode.UNSUPPORTED)
        model = header.get("model")
        if model is not None and not isinstance(model, str):
            raise ProtocolError("'model' must be a string")
        version = header.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)
                                    or version < 1):
            raise ProtocolError(f"'version' must be a positive integer, got {version!r}")
        outputs = header.get("outputs")
        if outputs is not None and (not isinstance(outputs, list)
                                    or not all(isinstance(o, str) for o in outputs)):
            raise ProtocolError("'outputs' must be a list of output names")
        timeout = header.get("timeout_ms")
        if timeout is not None and (not isinstance(timeout, int | float)
                                    or isinstance(timeout, bool) or timeout <= 0):
            raise ProtocolError(f"'timeout_ms' must be a positive number, got {timeout!r}")
        inputs = decode_tensors(header.get("inputs", []), frames[2:], "request inputs")
    except ProtocolError as e:
        e.request_id = rid
        raise
    params = {k: v for k, v in header.items() if k not in _REQUEST_KEYS}
    return Request(id=rid, op=op, model=model, version=version, inputs=inputs,
                   outputs=outputs, timeout_ms=int(timeout) if timeout else None,
                   params=params)


def encode_reply(reply: Reply) -> list[Frame]:
    """Frames of ``reply``; tensor frames are views of the output arrays."""
    header: dict[str, Any] = {"id": reply.id}
    frames: list[Frame] = []
    if reply.error is not None:
        code, message = reply.error
        header["status"] = "error"
        header["error"] = {"code": str(code), "message": message}
    else:
        header["status"] = "ok"
        if reply.outputs:
            header["outputs"], frames = encode_tensors(reply.outputs)
        if reply.result is not None:
            header["result"] = reply.result
    return [TAG, _dumps(header), *frames]


def decode_reply(frames: Sequence[Frame]) -> Reply:
    """Decode a reply. Raises ProtocolError if the daemon's message is malformed."""
    header = _header(frames, "reply")
    rid = header.get("id")
    if not isinstance(rid, str):
        raise ProtocolError("reply header has no string 'id'")
    if header.get("status") == "error":
        err = header.get("error") or {}
        try:
            code = ErrorCode(err.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        return Reply(id=rid, error=Failure(code, str(err.get("message", ""))))
    outputs = decode_tensors(header.get("outputs", []), frames[2:], "reply outputs")
    return Reply(id=rid, outputs=outputs, result=header.get("result"))
