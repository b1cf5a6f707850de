"""The tensor element types inferd carries, by their wire names: part of the wire's
vocabulary, used by the protocol (:mod:`inferd.ipc.protocol`) and by the backend
contract (:mod:`inferd.libbackends.contract`), which builds on it.

Every ONNX tensor type but complex numbers and the 2- and 6-bit and e8m0 floats has a
wire name (docs/protocol.md, "Tensor frames"). numpy itself has no bfloat16, float8 or
4-bit integer: those come from the ``ml_dtypes`` package (what JAX, TensorFlow and the
``onnx`` package use), as numpy dtypes of one element per byte (two for bfloat16). On
the wire the 4-bit integers are packed two per byte, the first element in the low
nibble, as ONNX stores them (:func:`pack`, :func:`unpack`). Without ``ml_dtypes`` the
names are still known, and a tensor of one of those types is refused with
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
             "float8_e5m2fnuz", "int4", "uint4")
"""Wire names of the types that need the ``ml_dtypes`` package (its names too)."""
PACKED = frozenset({"int4", "uint4"})
"""Types of 4 bits, packed two elements per byte on the wire (low nibble first)."""

NUMERIC_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<") for name in _NUMPY_TYPES}
"""wire name -> little-endian numpy dtype of every numeric type this process holds (the
``ml_dtypes`` ones once :func:`numpy_dtype` or :func:`dtype_name` has needed them, where
that package is installed)."""

WIRE_DTYPES = (*_NUMPY_TYPES, *ML_DTYPES, STRING)
"""Every wire dtype name."""

MISSING_ML_DTYPES = ("needs the Python package ml_dtypes, which is not installed beside "
                     "this inferd (pip install ml-dtypes; Debian 12 has no package of it)")

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
                dt = np.dtype(getattr(ml, name))
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
            return NUMERIC_DTYPES[name]
        raise ProtocolError(f"dtype {name} {MISSING_ML_DTYPES}", ErrorCode.UNSUPPORTED)
    raise ProtocolError(f"dtype {name!r} is not a numeric wire dtype")


def wire_size(name: str, count: int) -> int:
    """Bytes of a frame of ``count`` elements of numeric wire dtype ``name``."""
    if name in PACKED:
        return (count + 1) // 2
    return count * numpy_dtype(name).itemsize


def pack(array: NDArray[Any]) -> bytes:
    """The wire bytes of a 4-bit tensor: two elements per byte, the first in the low
    nibble; an odd count leaves the last high nibble 0."""
    nibbles = np.ascontiguousarray(array).reshape(-1).view(np.uint8) & 0x0F
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def unpack(buf: Any, name: str, count: int) -> NDArray[Any]:
    """The ``count`` elements of 4-bit wire dtype ``name`` packed in ``buf``, one per
    byte as ``ml_dtypes`` holds them (a new array)."""
    packed = np.frombuffer(buf, dtype=np.uint8)
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    return nibbles[:count].view(numpy_dtype(name))


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
