"""ONNX's own node test cases, as the daemon's test sees them (issue 19, item 6).

``onnx.backend.test.case.node.collect_testcases()`` builds every node conformance case
of the installed ``onnx`` package in memory (model + inputs + expected outputs; the
wheel ships no ``backend/test/data/node`` folder any more). A *tensor case* is one whose
inputs and outputs are all tensors (not sequences, maps or optionals: the wire carries
tensors only). In-process onnxruntime is the reference: a case counts when onnxruntime
passes it in-process (its outputs within the case's rtol/atol of the expected ones, as
``onnx.backend.test`` checks), and the daemon must then give exactly onnxruntime's bits.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.dtypes import dtype_name
from inferd.ipc.errors import ProtocolError
from inferd.libbackends.contract import aligned

Tensors = dict[str, NDArray[Any]]


@dataclass
class Case:
    """One tensor case: ``name`` (a valid model name), the model's bytes, and its data
    sets as (inputs by name, expected outputs by name)."""

    name: str
    model: bytes
    data: list[tuple[Tensors, Tensors]]
    rtol: float
    atol: float


def _array(value: Any) -> NDArray[Any] | None:
    from onnx import TensorProto, numpy_helper

    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value)
    return None  # a sequence, a map, an optional: not a tensor


def _wire_ok(array: NDArray[Any]) -> bool:
    try:
        dtype_name(array)
    except ProtocolError:  # complex numbers and the like: not on the wire
        return False
    return True


def tensor_cases() -> list[Case]:
    """Every node case whose inputs and outputs are all wire tensors."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators divide by zero on purpose
        cases = collect_testcases()
    out = []
    for case in cases:
        if case.model is None or not case.data_sets:
            continue
        graph = case.model.graph
        initialized = {i.name for i in graph.initializer}
        in_names = [i.name for i in graph.input if i.name not in initialized]
        out_names = [o.name for o in graph.output]
        data = []
        for inputs, outputs in case.data_sets:
            ins = [_array(v) for v in inputs]
            outs = [_array(v) for v in outputs]
            if (len(ins) != len(in_names) or len(outs) != len(out_names)
                    or any(a is None or not _wire_ok(a) for a in [*ins, *outs])):
                data = []
                break
            data.append((dict(zip(in_names, ins)), dict(zip(out_names, outs))))
        if data:
            name = re.sub(r"[^A-Za-z0-9._-]", "_", case.name)
            out.append(Case(name, case.model.SerializeToString(), data, case.rtol,
                            case.atol))
    return out


def close(got: NDArray[Any], want: NDArray[Any], rtol: float, atol: float) -> bool:
    """Whether ``got`` matches ``want`` as ``onnx.backend.test`` checks an output."""
    if got.shape != want.shape:
        return False
    if want.dtype == object or got.dtype == object:
        return bool(np.array_equal(got.astype(object), want.astype(object)))
    if got.dtype != want.dtype:
        return False
    if got.dtype.kind in "biu" or dtype_name(got) in ("int4", "uint4", "int2", "uint2"):
        return bool(np.array_equal(got, want))
    try:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


def in_process(case: Case, session_options: Any = None) -> list[Tensors] | None:
    """onnxruntime's outputs for each data set, in-process on aligned inputs (through
    the same backend class the daemon uses); None if it fails the case."""
    from inferd.libbackends.onnxruntime_cpu import OrtModel

    import onnxruntime as ort

    so = session_options or ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    try:
        session = ort.InferenceSession(case.model, so, providers=["CPUExecutionProvider"])
        model = OrtModel(session, case.name)
        results = []
        for inputs, expected in case.data:
            got = model.run(aligned(inputs))
            if set(got) != set(expected) or not all(
                    close(got[k], expected[k], case.rtol, case.atol) for k in expected):
                return None
            results.append(got)
    except Exception:  # noqa: BLE001  onnxruntime fails the case: not one to check
        return None
    return results


def same_bits(a: NDArray[Any], b: NDArray[Any]) -> bool:
    """Identical shape, dtype and bytes (strings: identical elements)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == object:
        return a.tolist() == b.tolist()
    return a.tobytes() == b.tobytes()
