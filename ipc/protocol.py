"""Wire protocol v1: pure framing, no sockets (see docs/protocol.md).

A message is a list of frames::

    [TAG, header (UTF-8 JSON), tensor frame 0, tensor frame 1, ...]

The header lists every tensor (name, dtype, shape) in frame order. A numeric tensor is
its C-contiguous little-endian bytes (the 2- and 4-bit types packed several elements per
byte, :mod:`inferd.ipc.dtypes`); a ``string`` tensor is, per element, a uint32 LE byte
length followed by that many UTF-8 bytes. ``encode_*`` returns frames that
reference the arrays' memory (send them with ``copy=False``); ``decode_*`` builds arrays
over the received buffers with ``np.frombuffer`` after checking every byte count.

Decoding a request is two steps, so that nothing proportional to what a message claims
happens before it is admitted (docs/protocol.md, "What a request costs"):
:func:`decode_request` with ``defer=True`` checks the header, every tensor description,
byte count and region bound, and prices the request (:class:`Cost`: the bytes of its
tensors wherever they are, and what decoding will make) from those alone; numeric tensors
become views at once (no copy), while packed tensors (unpacked to a byte per element)
and strings (a Python object per element) are left in :attr:`Request.pending` until
:meth:`Request.decode` runs on a thread that may take the time.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray
from zmq import Frame as ZmqFrame

from inferd.ipc import header as hdr
from inferd.ipc.errors import ErrorCode, Failure, ProtocolError
from inferd.ipc.dtypes import (
    ML_DTYPES,
    NUMERIC_DTYPES,
    PACKED,
    PACKED_BITS,
    STRING,
    WIRE_DTYPES,
    dtype_name,
    numpy_dtype,
    pack,
    unpack,
    wire_size,
)

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
    METRICS = "metrics"


Frame = bytes | memoryview | Any  # anything exporting the buffer protocol (zmq.Frame too)

_OPS = {op.value: op for op in Op}

MAX_RANK = 32
"""Most dimensions of a tensor on the wire (numpy allows 64; ONNX models use few)."""
MAX_ELEMENTS = 2**48
"""Most elements of a tensor (its non-zero dimensions multiplied)."""
SHM_ALIGN = 64
"""Boundary of each output the daemon writes into a shared-memory slot."""
MAX_TIMEOUT_MS = 2**53
"""Largest ``timeout_ms`` (about 285,000 years; JSON integers stay exact up to it)."""

STRING_OBJECT_BYTES = 72
"""What each element of a decoded ``string`` tensor takes beside its characters: the
object array's 8-byte pointer and a Python ``str`` (``sys.getsizeof("ab")`` is 51,
rounded up by the allocator); 2 million two-byte strings decoded took 71 B each."""
STRING_CHAR_BYTES = 4
"""Most bytes a decoded string takes per UTF-8 byte of its text: CPython stores a string
with any character past U+FFFF at 4 bytes per character (200,000 strings of an emoji
and 40 ASCII letters took 242 B each: 72 + 4 x 44 = 248 priced)."""

_WIRE_DTYPE_SET = frozenset(WIRE_DTYPES)
_ML_DTYPE_SET = frozenset(ML_DTYPES)


@dataclass(slots=True)
class Cost:
    """What a request's tensors cost, from its header and frame sizes alone.

    Attributes:
        tensor_bytes: bytes of the tensors once decoded, wherever they travel (frames
            or shared-memory regions): packed types at a byte per element, strings as
            objects. What a run reads; the I/O thread's fast path decides by it.
        decoded_bytes: memory the daemon makes when decoding, beyond views of the
            frames and regions: unpacked packed tensors (those read from a region
            included), string objects, copies of misaligned frames. A region's own
            bytes are the client's and count nowhere.
    """

    tensor_bytes: int = 0
    decoded_bytes: int = 0


def string_bytes(count: int, frame_bytes: int) -> int:
    """Bytes ``count`` strings decoded from a frame of ``frame_bytes`` may take at most
    (:data:`STRING_OBJECT_BYTES` each, :data:`STRING_CHAR_BYTES` per byte of text)."""
    return count * STRING_OBJECT_BYTES + STRING_CHAR_BYTES * (frame_bytes - 4 * count)


STREAM_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""What a stream id may be (docs/protocol.md, "Streams")."""


@dataclass(frozen=True, slots=True)
class StreamRef:
    """The ``stream`` field of an infer: which of the client's streams the request
    belongs to, and whether it starts (or restarts) or ends it (docs/streams.md)."""

    id: str
    start: bool = False
    end: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.start:
            out["start"] = True
        if self.end:
            out["end"] = True
        return out


_STREAM_KEYS = frozenset(("id", "start", "end"))


def _stream(value: Any) -> StreamRef:
    """The ``stream`` of a request header, every field checked."""
    if type(value) is not dict:
        raise ProtocolError(f"'stream' must be an object with 'id' and optionally 'start' "
                            f"and 'end', got {_short(value)}")
    unknown = [] if value.keys() <= _STREAM_KEYS else sorted(
        k for k in value if k not in _STREAM_KEYS)
    if unknown:
        raise ProtocolError(f"'stream' has unknown keys {_short(unknown)}; it takes 'id', "
                            f"'start' and 'end'")
    sid = value.get("id")
    if type(sid) is not str or not STREAM_ID.fullmatch(sid):
        raise ProtocolError(f"'stream': 'id' must be a string of 1 to 64 characters from "
                            f"A-Z a-z 0-9 . _ -, got {_short(sid)}")
    start, end = value.get("start", False), value.get("end", False)
    if type(start) is not bool or type(end) is not bool:
        raise ProtocolError(f"'stream': 'start' and 'end' must be true or false, got "
                            f"{_short(start)} and {_short(end)}")
    return StreamRef(sid, start, end)


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
    outputs_into: Slot | None = None
    """Where the daemon writes the outputs (a shared-memory slot), if the client said."""
    cost: Cost = field(default_factory=Cost)
    """What its tensors cost (set by :func:`decode_request`)."""
    stream: StreamRef | None = None
    """The client's stream the request belongs to (an infer), if it names one."""
    pending: dict[str, Any] | None = None
    """Inputs not decoded yet, in order: arrays, and the packed and string tensors still
    to decode (:meth:`decode` turns them into :attr:`inputs`); None once decoded."""

    def decode(self) -> None:
        """Decode the inputs left in :attr:`pending` into :attr:`inputs` (unpacking,
        string objects: time and memory proportional to the tensors, which admission
        priced). Raises ProtocolError (with the request's id) for a string frame that
        does not hold what its header says."""
        pending = self.pending
        if pending is None:
            return
        try:
            self.inputs = {name: value() if type(value) is partial else value
                           for name, value in pending.items()}
        except ProtocolError as e:
            e.request_id = self.id
            raise
        finally:
            self.pending = None


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


@dataclass
class Slot:
    """Where a request's outputs go: ``size`` bytes of ``region`` from ``offset``."""

    token: str
    buffer: memoryview
    offset: int
    size: int
    used: int = field(default=0)
    _base: int | None = field(default=None, repr=False)

    def claim(self, array: NDArray[Any]) -> int | None:
        """The offset of ``array`` if it already lies in this slot exactly where
        :meth:`place` would put it next (an engine in a worker process wrote it there):
        placed without a copy. None otherwise."""
        if not array.nbytes or not array.flags.c_contiguous:
            return None
        if self._base is None:
            self._base = int(np.frombuffer(self.buffer, np.uint8).__array_interface__[
                "data"][0])
        start = self.offset + self.used
        start += -start % SHM_ALIGN
        if int(array.__array_interface__["data"][0]) - self._base != start or \
                start + array.nbytes > self.offset + self.size:
            return None
        self.used = start + array.nbytes - self.offset
        return start

    def place(self, nbytes: int) -> int:
        """The next 64-aligned offset with room for ``nbytes`` (RESOURCE_EXHAUSTED if
        the slot is full)."""
        start = self.offset + self.used
        start += -start % SHM_ALIGN
        if start + nbytes > self.offset + self.size:
            raise ProtocolError(f"outputs_into: region {self.token} has {self.size} bytes "
                                f"from offset {self.offset}; the outputs need more",
                                ErrorCode.RESOURCE_EXHAUSTED)
        self.used = start + nbytes - self.offset
        return start


Locator = Callable[[NDArray[Any]], "tuple[str, int] | None"]
"""array -> (region token, offset) if the array lies in a registered region."""
Resolver = Callable[[str], memoryview]
"""region token -> the region's bytes (ProtocolError if the sender may not name it)."""


def encode_tensors(tensors: dict[str, NDArray[Any]], locate: Locator | None = None,
                   into: Slot | None = None) -> tuple[list[dict[str, Any]], list[Frame]]:
    """Describe and frame tensors. Numeric frames are views of the arrays (no copy); an
    array that ``locate`` finds in a shared-memory region is described by reference
    (no frame), and with ``into`` numeric tensors are copied into that slot instead of
    being framed."""
    specs: list[dict[str, Any]] = []
    frames: list[Frame] = []
    for name, value in tensors.items():
        array = value if type(value) is np.ndarray else np.asarray(value)
        dtype = dtype_name(array)
        spec: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(array.shape)}
        specs.append(spec)
        if dtype != STRING and (locate is not None or into is not None) and \
                dtype not in PACKED:
            where = locate(array) if locate is not None else None
            if where is None and into is not None:
                start = into.claim(array)
                if start is None:
                    start = into.place(array.nbytes)
                    np.frombuffer(into.buffer, array.dtype, array.size, start).reshape(
                        array.shape)[...] = array
                where = (into.token, start)
            if where is not None:
                spec["region"], spec["offset"] = where
                continue
        if dtype == STRING:
            frames.append(_encode_strings(array))
            continue
        if dtype in PACKED:
            frames.append(pack(array))
            continue
        if dtype in _ML_DTYPE_SET:  # ml_dtypes' types export no buffer: their bytes do
            frames.append(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
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


def _check_spec(spec: Any, where: str) -> tuple[str, str, tuple[int, ...], int]:
    """(name, dtype, shape, element count) of a tensor description, every field checked.
    On the request path: plain loops, no generator per tensor."""
    if type(spec) is not dict:
        raise ProtocolError(f"{where}: each tensor description must be an object")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if type(name) is not str or not name:
        raise ProtocolError(f"{where}: tensor 'name' must be a non-empty string")
    if len(name) > 256:
        raise ProtocolError(f"{where}: tensor name {_short(name)} is over 256 characters")
    if type(dtype) is not str or dtype not in _WIRE_DTYPE_SET:
        raise ProtocolError(f"{where}: tensor {name!r} has dtype {_short(dtype)}; "
                            f"expected one of {', '.join(WIRE_DTYPES)}")
    if type(shape) is not list:
        raise ProtocolError(f"{where}: tensor {name!r} shape must be a list of "
                            f"non-negative integers, got {_short(shape)}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"{where}: tensor {name!r} shape must be a list of "
                                f"non-negative integers, got {_short(shape)}")
    if len(shape) > MAX_RANK:
        raise ProtocolError(f"{where}: tensor {name!r} has rank {len(shape)}; at most "
                            f"{MAX_RANK} dimensions are allowed")
    count = math.prod(shape)
    # with a 0 dimension the others still may not claim more (the product of the rest)
    if count > MAX_ELEMENTS or (count == 0 and math.prod(
            [d or 1 for d in shape]) > MAX_ELEMENTS):
        raise ProtocolError(f"{where}: tensor {name!r} shape {_short(shape)} has more "
                            f"than {MAX_ELEMENTS} elements")
    return name, dtype, tuple(shape), count


def _short(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for error messages about client input."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _in_region(spec: dict[str, Any], regions: Resolver | None, name: str,
               dtype: str, where: str) -> memoryview:
    """The bytes a shared-memory tensor description names (docs/protocol.md, "Shared
    memory"), every bound checked."""
    if regions is None:
        raise ProtocolError(f"{where}: tensor {name!r} names a shared-memory region, which "
                            f"this connection cannot use (tcp://, or no registration)")
    if dtype == STRING:
        raise ProtocolError(f"{where}: tensor {name!r}: string tensors cannot live in "
                            f"shared memory")
    offset = spec.get("offset", 0)
    if type(offset) is not int or offset < 0:
        raise ProtocolError(f"{where}: tensor {name!r}: 'offset' must be a non-negative "
                            f"integer, got {_short(offset)}")
    region = regions(spec["region"])
    if offset > len(region):  # even for a tensor of no bytes
        raise ProtocolError(f"{where}: tensor {name!r}: offset {offset} is past the end of "
                            f"its region ({len(region)} bytes)")
    return region[offset:]  # the length is checked against the dtype and shape next


def decode_tensors(specs: Any, frames: Sequence[Frame], where: str,
                   regions: Resolver | None = None) -> dict[str, NDArray[Any]]:
    """Arrays over ``frames`` (or shared-memory regions, through ``regions``) described
    by ``specs``; every byte count and offset is checked."""
    planned, _ = plan_tensors(specs, frames, where, regions)
    return {name: value() if type(value) is partial else value
            for name, value in planned.items()}


def plan_tensors(specs: Any, frames: Sequence[Frame], where: str,
                 regions: Resolver | None = None) -> tuple[dict[str, Any], Cost]:
    """Check ``specs`` against ``frames`` and ``regions`` and price them, decoding only
    what costs nothing: (name -> an array over a frame or region, or for a packed or
    string tensor a ``functools.partial`` that decodes it; the :class:`Cost`). The work
    is per tensor description, never per element: what a header may claim is bounded."""
    if type(specs) is not list:
        raise ProtocolError(f"{where}: expected a list of tensor descriptions")
    framed = len(specs)
    for s in specs:
        if type(s) is dict and "region" in s:
            framed -= 1
    if len(frames) != framed:
        sent = " in frames" if framed != len(specs) else ""  # the others in regions
        raise ProtocolError(f"{where}: header describes {framed} tensors{sent} but "
                            f"{len(frames)} tensor frames follow")
    tensors: dict[str, Any] = {}
    cost = Cost()
    next_frame = iter(frames)
    for spec in specs:
        name, dtype, shape, count = _check_spec(spec, where)
        if name in tensors:
            raise ProtocolError(f"{where}: tensor {name!r} appears twice")
        if "region" in spec:
            view = _in_region(spec, regions, name, dtype, where)
            np_dtype = _numeric(dtype, name, where)
            size = wire_size(dtype, count)
            if len(view) < size:
                raise ProtocolError(f"{where}: tensor {name!r} is {dtype}{list(shape)}, "
                                    f"{size} bytes, past the end of its region (offset "
                                    f"{spec.get('offset', 0)})")
            if dtype in PACKED:  # unpacked here, a byte per element: the daemon's memory
                tensors[name] = partial(_unpacked, view[:size], dtype, count, shape)
                cost.tensor_bytes += count
                cost.decoded_bytes += count
            else:  # a view of the shared memory: no copy, the client's bytes
                tensors[name] = np.frombuffer(view, np_dtype, count).reshape(shape)
                cost.tensor_bytes += size
            continue
        frame = next(next_frame)
        if dtype == STRING:
            view = _buffer(frame)
            # Each element takes at least its 4-byte length: a count the frame cannot
            # hold is refused before anything is allocated for it.
            if count * 4 > len(view):
                raise ProtocolError(f"{where}: tensor {name!r} declares {count} strings but "
                                    f"its frame has only {len(view)} bytes (at least 4 per "
                                    f"string)")
            tensors[name] = partial(_strings, view, count, name, shape)
            held = string_bytes(count, len(view))
            cost.tensor_bytes += held
            cost.decoded_bytes += held
            continue
        # A zmq.Frame exports its bytes directly; anything else through a byte view.
        buf = frame if type(frame) is ZmqFrame else _buffer(frame)
        np_dtype = _numeric(dtype, name, where)
        expected = wire_size(dtype, count) if dtype in PACKED else count * np_dtype.itemsize
        if len(buf) != expected:
            packing = (" (two elements per byte)" if PACKED_BITS.get(dtype) == 4 else
                       " (four elements per byte)" if dtype in PACKED else "")
            raise ProtocolError(f"{where}: tensor {name!r} is {dtype}{list(shape)}, "
                                f"which is {expected} bytes{packing}, but its frame has "
                                f"{len(buf)}")
        if dtype in PACKED:
            tensors[name] = partial(_unpacked, buf, dtype, count, shape)
            cost.tensor_bytes += count
            cost.decoded_bytes += count
            continue
        array = np.frombuffer(buf, dtype=np_dtype).reshape(shape)  # type: ignore[arg-type]
        if not array.flags.aligned:  # libzmq may hand out small frames at odd offsets
            array = array.copy()
            cost.decoded_bytes += expected
        tensors[name] = array
        cost.tensor_bytes += expected
    return tensors, cost


def _numeric(dtype: str, name: str, where: str) -> np.dtype[Any]:
    np_dtype = NUMERIC_DTYPES.get(dtype)
    if np_dtype is not None:
        return np_dtype
    try:
        return numpy_dtype(dtype)  # raises: why this process cannot hold it
    except ProtocolError as e:
        raise ProtocolError(f"{where}: tensor {name!r}: {e.message}", e.code) from None


def _unpacked(buf: Any, dtype: str, count: int, shape: tuple[int, ...]) -> NDArray[Any]:
    return unpack(buf, dtype, count).reshape(shape)


def _strings(buf: memoryview, count: int, name: str, shape: tuple[int, ...]) -> NDArray[Any]:
    return _decode_strings(buf, count, name).reshape(shape)


# --------------------------------------------------------------------------- messages

def _header(frames: Sequence[Frame], kind: str) -> dict[str, Any]:
    if len(frames) < 2:
        raise ProtocolError(f"{kind} has {len(frames)} frames; expected at least 2 "
                            f"(protocol tag and header)")
    tag = _bytes(frames[0]) if len(frames[0]) <= 64 else b"(a frame of %d bytes)" % len(
        frames[0])
    if tag != TAG:
        raise ProtocolError(f"{kind} starts with protocol tag {tag[:32]!r}; expected {TAG!r}")
    if kind == "request":
        # Sized before the copy: a huge header frame is refused without being read.
        raw = frames[1]
        if len(raw) > hdr.MAX_HEADER_BYTES:
            raise hdr.HeaderError(
                f"request header is {len(raw)} bytes; at most {hdr.MAX_HEADER_BYTES} "
                f"are allowed", request_id=hdr.first_key_id(bytes(_buffer(raw)[:2048])))
        return hdr.parse(_bytes(raw), kind)
    return hdr.parse(_bytes(frames[1]), kind, max_bytes=None)


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps would build one per call
# Its C encoder, made once: JSONEncoder.encode makes a new one, and a dict of the objects
# on the way to refuse circular ones, at every call (headers hold no cycles).
_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE = None if _MAKE_ENCODER is None else _MAKE_ENCODER(
    None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False,
    False, True)


def _dumps(obj: Any) -> bytes:
    if _C_ENCODE is None:
        return _ENCODER.encode(obj).encode("utf-8")
    return "".join(_C_ENCODE(obj, 0)).encode("utf-8")


_REQUEST_KEYS = {"id", "op", "model", "version", "inputs", "outputs", "timeout_ms",
                 "outputs_into", "stream"}


def encode_request(request: Request, locate: Locator | None = None) -> list[Frame]:
    """Frames of ``request``; tensor frames are views of the input arrays (inputs that
    ``locate`` finds in a registered region go by reference)."""
    specs, frames = encode_tensors(request.inputs, locate)
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
    if request.stream is not None:
        header["stream"] = request.stream.to_json()
    header.update(request.params)
    return [TAG, _dumps(header), *frames]


def peek_request_id(frames: Sequence[Frame]) -> str | None:
    """The request id of a message, if it can be read without parsing the header: the
    header's first key must be ``"id"`` (see :func:`inferd.ipc.header.first_key_id`).
    Used to address replies to messages that are refused unread."""
    if len(frames) < 2:
        return None
    raw = frames[1]
    return hdr.first_key_id(bytes(_buffer(raw)[:2048]))


def _slot(value: Any, regions: Resolver | None) -> Slot:
    """The ``outputs_into`` of a request header: {"region", "offset", "size"}."""
    if not isinstance(value, dict) or "region" not in value:
        raise ProtocolError("'outputs_into' must be an object with 'region', 'offset' and "
                            "'size'")
    if regions is None:
        raise ProtocolError("'outputs_into' names a shared-memory region, which this "
                            "connection cannot use")
    offset, size = value.get("offset", 0), value.get("size")
    if type(offset) is not int or offset < 0 or type(size) is not int or size <= 0:
        raise ProtocolError(f"'outputs_into': 'offset' must be a non-negative and 'size' "
                            f"a positive integer, got {_short(offset)} and {_short(size)}")
    buffer = regions(value["region"])
    if offset + size > len(buffer):
        raise ProtocolError(f"'outputs_into': {size} bytes at offset {offset} pass the end "
                            f"of the region ({len(buffer)} bytes)")
    return Slot(value["region"], buffer, offset, size)


def decode_request(frames: Sequence[Frame], regions: Resolver | None = None,
                   defer: bool = False) -> Request:
    """Decode a request; ``regions`` resolves the shared-memory regions its sender may
    name. With ``defer``, packed and string tensors are left in :attr:`Request.pending`
    for :meth:`Request.decode` (the daemon's I/O thread prices a request before it lets
    anything proportional to its tensors happen). Raises ProtocolError (with
    ``request_id`` when known)."""
    head = _header(frames, "request")
    rid = head.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > hdr.MAX_ID_CHARS:
        raise ProtocolError(f"request header needs 'id': a non-empty string of at most "
                            f"{hdr.MAX_ID_CHARS} characters")
    try:
        op_name = head.get("op")
        if op_name is None:
            raise ProtocolError(f"request header needs 'op', one of "
                                f"{', '.join(o.value for o in Op)}")
        if type(op_name) is not str:
            raise ProtocolError(f"'op' must be a string, got {_short(op_name)}")
        op = _OPS.get(op_name)
        if op is None:
            raise ProtocolError(f"unknown op {op_name[:64]!r}; expected one of "
                                f"{', '.join(o.value for o in Op)}", ErrorCode.UNSUPPORTED)
        model = head.get("model")
        if model is not None and not isinstance(model, str):
            raise ProtocolError("'model' must be a string")
        version = head.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)
                                    or version < 1):
            raise ProtocolError(f"'version' must be a positive integer, got "
                                f"{_short(version)}")
        outputs = head.get("outputs")
        if outputs is not None and (not isinstance(outputs, list)
                                    or not all(isinstance(o, str) for o in outputs)):
            raise ProtocolError("'outputs' must be a list of output names")
        timeout = head.get("timeout_ms")
        if timeout is not None and (not isinstance(timeout, int | float)
                                    or isinstance(timeout, bool) or not
                                    0 < timeout <= MAX_TIMEOUT_MS):
            raise ProtocolError(f"'timeout_ms' must be a positive number of at most "
                                f"{MAX_TIMEOUT_MS}, got {_short(timeout)}")
        planned, cost = plan_tensors(head.get("inputs", []), frames[2:], "request inputs",
                                     regions)
        into = head.get("outputs_into")
        slot = _slot(into, regions) if into is not None else None
        stream = head.get("stream")
        if stream is not None:
            if op is not Op.INFER:
                raise ProtocolError(f"'stream' belongs to an infer, not to op {op}")
            stream = _stream(stream)
    except ProtocolError as e:
        e.request_id = rid
        raise
    params = {} if head.keys() <= _REQUEST_KEYS else {
        k: v for k, v in head.items() if k not in _REQUEST_KEYS}
    request = Request(id=rid, op=op, model=model, version=version,
                      outputs=outputs, timeout_ms=int(timeout) if timeout else None,
                      params=params, outputs_into=slot, cost=cost, stream=stream,
                      pending=planned)
    if not defer or not any(type(v) is partial for v in planned.values()):
        request.decode()  # (deferred: nothing left that takes time)
    return request


def encode_reply(reply: Reply, into: Slot | None = None) -> list[Frame]:
    """Frames of ``reply``; tensor frames are views of the output arrays (with ``into``,
    numeric outputs are written into that shared-memory slot instead)."""
    header: dict[str, Any] = {"id": reply.id}
    frames: list[Frame] = []
    if reply.error is not None:
        code, message = reply.error
        header["status"] = "error"
        header["error"] = {"code": str(code), "message": message}
    else:
        header["status"] = "ok"
        if reply.outputs:
            try:
                header["outputs"], frames = encode_tensors(reply.outputs, into=into)
            except ProtocolError as e:  # the slot is too small: the reply says so
                return encode_reply(Reply(reply.id, error=Failure(e.code, e.message)))
        if reply.result is not None:
            header["result"] = reply.result
    return [TAG, _dumps(header), *frames]


def decode_reply(frames: Sequence[Frame], regions: Resolver | None = None) -> Reply:
    """Decode a reply (outputs in shared memory through ``regions``: views of it).
    Raises ProtocolError if the daemon's message is malformed."""
    head = _header(frames, "reply")
    rid = head.get("id")
    if not isinstance(rid, str):
        raise ProtocolError("reply header has no string 'id'")
    if head.get("status") == "error":
        err = head.get("error") or {}
        try:
            code = ErrorCode(err.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        return Reply(id=rid, error=Failure(code, str(err.get("message", ""))))
    outputs = decode_tensors(head.get("outputs", []), frames[2:], "reply outputs", regions)
    return Reply(id=rid, outputs=outputs, result=head.get("result"))
