"""The tensor element types inferd carries, by their wire names: part of the wire's
vocabulary, used by the protocol (:mod:`inferd.ipc.protocol`) and by the backend
contract (:mod:`inferd.libbackends.contract`), which builds on it."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import ProtocolError

STRING = "string"
"""dtype name of a string tensor."""

NUMERIC_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "float16", "float32", "float64")
}
"""wire name -> little-endian numpy dtype of every numeric type."""

WIRE_DTYPES = (*NUMERIC_DTYPES, STRING)
"""Every wire dtype name."""

# dtype -> wire name; a dict lookup is much cheaper than numpy's dtype.name property
_WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in NUMERIC_DTYPES.items()}


def dtype_name(array: NDArray[Any]) -> str:
    """The wire dtype name of ``array``; raises ProtocolError for dtypes not on the wire."""
    name = _WIRE_NAMES.get(array.dtype)
    if name is not None:
        return name
    if array.dtype.kind in "OUT":
        return STRING
    name = array.dtype.name  # e.g. a big-endian float32 (encode_tensors swaps it)
    if name not in NUMERIC_DTYPES:
        raise ProtocolError(f"dtype {array.dtype} is not carried by the protocol "
                            f"(supported: {', '.join(WIRE_DTYPES)})")
    return name
