"""The tensor element types inferd carries, by their wire names: part of the wire's
vocabulary, used by the protocol (:mod:`inferd.ipc.protocol`) and by the backend
contract (:mod:`inferd.libbackends.contract`), which builds on it.

Every ONNX tensor type but complex numbers and the 6-bit floats has a wire name
(docs/protocol.md, "Tensor frames"). numpy itself has no bfloat16, float8, float4 or
2- and 4-bit integer: those come from the ``ml_dtypes`` package (what JAX, TensorFlow
and the ``onnx`` package use), as numpy dtypes of one element per byte (two for
bfloat16). On the wire the types narrower than a byte are packed as ONNX stores them
(:data:`PACKED_BITS`: the 4-bit ones two per byte, the 2-bit ones four per byte), the
first element in the lowest bits (:func:`pack`, :func:`unpack`); once decoded each
element takes a byte, which is what admission counts (:func:`held_size`). Without
``ml_dtypes`` (or with one older than 0.5, which lacks the 2-bit, e8m0 and float4
types) the names are still known, and a tensor of one of those types is refused with
UNSUPPORTED, naming the package (:func:`numpy_dtype`). ``ml_dtypes`` is imported when a
tensor of one of its types first comes by, not before: its import alone takes about a
second (it computes its types' limits), which every daemon start, ``inferctl`` call and
client process would pay.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import ErrorCode, ProtocolError

STRING = "string"
"""dtype name of a string tensor."""

_NUMPY_TYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                "uint64", "float16", "float32", "float64")
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
             "float8_e5m2fnuz", "int4", "uint4", "float8_e8m0fnu", "float4_e2m1fn",
             "int2", "uint2")
"""Wire names of the types that need the ``ml_dtypes`` package (its names too)."""
PACKED_BITS = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}
"""Bits per element of the types packed several to a byte on the wire (the first
element in the lowest bits, as ONNX stores them)."""
PACKED = frozenset(PACKED_BITS)
"""The types packed several elements per byte on the wire (:data:`PACKED_BITS`)."""

NUMERIC_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<") for name in _NUMPY_TYPES}
"""wire name -> little-endian numpy dtype of every numeric type this process holds (the
``ml_dtypes`` ones once :func:`numpy_dtype` or :func:`dtype_name` has needed them, where
that package is installed)."""

WIRE_DTYPES = (*_NUMPY_TYPES, *ML_DTYPES, STRING)
"""Every wire dtype name."""

MISSING_ML_DTYPES = ("needs the Python package ml_dtypes, which is not installed beside "
                     "this inferd (pip install ml-dtypes; Debian 12 has no package of it)")
OLD_ML_DTYPES = ("needs ml_dtypes 0.5 or later; the one installed beside this inferd "
                 "(%s) lacks it (pip install -U ml-dtypes)")

# dtype -> wire name; a dict lookup is much cheaper than numpy's dtype.name property
_WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in NUMERIC_DTYPES.items()}
_ml_tried = False
_ml_lock = threading.Lock()


def _add_ml_dtypes() -> bool:
    """Imports ``ml_dtypes`` (once) and adds its types to :data:`NUMERIC_DTYPES`;
    whether they are there."""
    global _ml_tried
    with _ml_lock:
        if not _ml_tried:
            _ml_tried = True
            try:
                ml = importlib.import_module("ml_dtypes")
            except ImportError:  # the Debian package: bookworm has no python3-ml-dtypes
                return False
            for name in ML_DTYPES:
                kind = getattr(ml, name, None)  # the newer ones since ml_dtypes 0.5
                if kind is None:
                    continue
                dt = np.dtype(kind)
                _WIRE_NAMES[dt] = name
                NUMERIC_DTYPES[name] = dt
        return ML_DTYPES[0] in NUMERIC_DTYPES


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of wire dtype ``name`` (numeric).

    Raises:
        ProtocolError: UNSUPPORTED for an ``ml_dtypes`` type where that package is not
            installed; INVALID_ARGUMENT for a name that is not a numeric wire dtype.
    """
    dt = NUMERIC_DTYPES.get(name)
    if dt is not None:
        return dt
    if name in ML_DTYPES:
        if _add_ml_dtypes():
            dt = NUMERIC_DTYPES.get(name)
            if dt is not None:
                return dt
            version = getattr(sys.modules.get("ml_dtypes"), "__version__", "?")
            raise ProtocolError(f"dtype {name} {OLD_ML_DTYPES % version}",
                                ErrorCode.UNSUPPORTED)
        raise ProtocolError(f"dtype {name} {MISSING_ML_DTYPES}", ErrorCode.UNSUPPORTED)
    raise ProtocolError(f"dtype {name!r} is not a numeric wire dtype")


def wire_size(name: str, count: int) -> int:
    """Bytes of a frame of ``count`` elements of numeric wire dtype ``name``."""
    bits = PACKED_BITS.get(name)
    if bits is not None:
        per_byte = 8 // bits
        return (count + per_byte - 1) // per_byte
    return count * numpy_dtype(name).itemsize


def pack(array: NDArray[Any]) -> bytes:
    """The wire bytes of a packed tensor (:data:`PACKED_BITS`): the elements in C order
    from the lowest bits of each byte up (two 4-bit ones per byte, four 2-bit ones); a
    count that does not fill the last byte leaves its high bits 0."""
    bits = PACKED_BITS[dtype_name(array)]
    per_byte, mask = 8 // bits, (1 << bits) - 1
    items = np.ascontiguousarray(array).reshape(-1).view(np.uint8) & mask
    if items.size % per_byte:
        items = np.append(items, np.zeros(per_byte - items.size % per_byte, np.uint8))
    out = items[0::per_byte].copy()
    for i in range(1, per_byte):
        out |= items[i::per_byte] << (i * bits)
    return out.tobytes()


def unpack(buf: Any, name: str, count: int) -> NDArray[Any]:
    """The ``count`` elements of packed wire dtype ``name`` in ``buf``, one per byte as
    ``ml_dtypes`` holds them (a new array of ``count`` bytes: what
    :func:`held_size` counts)."""
    bits = PACKED_BITS[name]
    per_byte, mask = 8 // bits, (1 << bits) - 1
    packed = np.frombuffer(buf, dtype=np.uint8)
    items = np.empty(packed.size * per_byte, dtype=np.uint8)
    for i in range(per_byte):
        np.bitwise_and(packed >> (i * bits), mask, out=items[i::per_byte])
    return items[:count].view(numpy_dtype(name))


def dtype_name(array: NDArray[Any]) -> str:
    """The wire dtype name of ``array``; raises ProtocolError for dtypes not on the wire."""
    name = _WIRE_NAMES.get(array.dtype)
    if name is not None:
        return name
    if array.dtype.kind in "OUT":
        return STRING
    if "ml_dtypes" in sys.modules and _add_ml_dtypes():  # an array of one of its types
        name = _WIRE_NAMES.get(array.dtype)
        if name is not None:
            return name
    name = array.dtype.name  # e.g. a big-endian float32 (encode_tensors swaps it)
    if name not in NUMERIC_DTYPES:
        raise ProtocolError(f"dtype {array.dtype} is not carried by the protocol "
                            f"(supported: {', '.join(WIRE_DTYPES)})")
    return name
