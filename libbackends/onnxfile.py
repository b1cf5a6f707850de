"""What an ONNX file says: its inputs and outputs (names, wire dtypes, shapes), read with
the ``onnx`` package, for the backends that convert ONNX for another engine (rknn, ncnn)
and must present the ONNX model's tensors to the daemon; its op types, read from the
file's protobuf encoding alone, for the onnxruntime backend's choice of aligned inputs."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferd.ipc.errors import ModelError
from inferd.libbackends.contract import TensorSpec

ONNX_TYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64",
              9: "bool", 10: "float16", 11: "float64"}
"""ONNX ``TensorProto`` element types -> wire dtype names."""


def onnx_specs(path: Path, backend: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs (initializers left out) and outputs of an ONNX file; a free or symbolic
    dimension is None.

    Args:
        path: the ``.onnx`` file.
        backend: the backend asking, for the message of a dtype it cannot carry.

    Raises:
        ModelError: the file is not a readable ONNX model, or a tensor has a type
            inferd has no dtype for.
    """
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and others for a broken file
        raise ModelError(f"{path} is not a readable ONNX model: {type(e).__name__}: "
                         f"{e}") from e
    init = {i.name for i in model.graph.initializer}

    def spec(v: Any) -> TensorSpec:
        t = v.type.tensor_type
        dtype = ONNX_TYPES.get(t.elem_type)
        if dtype is None:
            raise ModelError(f"{path}: tensor {v.name!r} has ONNX type {t.elem_type}, "
                             f"which the {backend} backend does not carry")
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                     else None for d in t.shape.dim)
        return TensorSpec(v.name, dtype, dims)

    return ([spec(v) for v in model.graph.input if v.name not in init],
            [spec(v) for v in model.graph.output])


def op_types(path: Path) -> set[str]:
    """The op types of every node of an ONNX file, those of sub-graphs (If, Loop, Scan
    bodies) included; an op of another domain than ONNX's own as ``domain.op_type``.

    Read from the protobuf encoding itself, over a read-only map of the file: the
    weights (Constant nodes, initializers) are stepped over by their lengths, never
    read nor copied, so that this costs no memory at a model's load (``onnx.load``
    of ocr-rec's 11 MB grew the load's measured cost past a tight cache budget).

    Raises:
        ModelError: the file cannot be read or is not a protobuf message.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            with memoryview(m) as buf:
                found: set[str] = set()
                for field, start, end in _fields(buf, 0, len(buf)):
                    if field == 7:  # ModelProto.graph
                        _graph_ops(buf, start, end, found)
                return found
    except (OSError, ValueError) as e:  # mmap of an empty file raises ValueError too
        raise ModelError(f"{path} is not a readable ONNX model: {e}") from e


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("a protobuf varint runs past the end")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field of the protobuf message
    in ``buf[pos:end]``; the others are stepped over."""
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ValueError("a protobuf field runs past its message")
            yield key >> 3, pos, pos + size
            pos += size
        else:
            raise ValueError(f"protobuf wire type {wire} (not in ONNX files)")
    if pos != end:
        raise ValueError("a protobuf field runs past its message")


def _graph_ops(buf: memoryview, pos: int, end: int, found: set[str]) -> None:
    for field, start, stop in _fields(buf, pos, end):
        if field != 1:  # GraphProto.node
            continue
        op, domain = "", ""
        for f, s, e in _fields(buf, start, stop):
            if f == 4:  # NodeProto.op_type
                op = str(buf[s:e], "utf-8")
            elif f == 7:  # NodeProto.domain
                domain = str(buf[s:e], "utf-8")
            elif f == 5:  # NodeProto.attribute: AttributeProto.g (6) and .graphs (11)
                for af, a_s, a_e in _fields(buf, s, e):
                    if af in (6, 11):
                        _graph_ops(buf, a_s, a_e, found)
        found.add(op if domain in ("", "ai.onnx") else f"{domain}.{op}")
