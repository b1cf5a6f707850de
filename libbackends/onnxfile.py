"""What an ONNX file says, read with the ``onnx`` package alone: its inputs and outputs
(names, wire dtypes, shapes), for the backends that convert ONNX for another engine
(rknn, ncnn) and must present the ONNX model's tensors to the daemon; its op types, for
the onnxruntime backend's choice of aligned inputs."""

from __future__ import annotations

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
    bodies) included.

    Raises:
        ModelError: the file is not a readable ONNX model.
    """
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and others for a broken file
        raise ModelError(f"{path} is not a readable ONNX model: {type(e).__name__}: "
                         f"{e}") from e
    found: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            found.add(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)
    return found
