"""An example inferd backend plugin in Python: onnx's reference evaluator on the CPU.

Drop this file into a backends directory (default ``/usr/lib/inferd/backends``) and
inferd registers it as backend ``onnx-reference``. A model picks it with
``backends = ["onnx-reference"]`` in its ``model.toml``.

What it really runs: any ONNX model whose operators ``onnx.reference`` implements, in
pure numpy — correct enough to cross-check other backends, far too slow for production.
It refuses models that use BatchNormalization, whose reference implementation gives
wrong results for inference graphs (it treats the ``momentum`` attribute as training
mode; see the field notes in the inferd repository).

The whole contract a plugin must meet is :mod:`inferd.libbackends.contract`; the loader
calls :func:`create_backend` once and checks the object it returns.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import BackendError, ModelError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)

# ops whose onnx.reference implementation is known to be wrong for inference
REFUSED_OPS = {"BatchNormalization"}


def _spec(value_info: Any) -> TensorSpec:
    from onnx import helper

    tensor = value_info.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                  for d in tensor.shape.dim)
    return TensorSpec(value_info.name, "string" if dtype.kind == "O" else dtype.name, shape)


class ReferenceModel(LoadedModel):
    """One model in an ``onnx.reference.ReferenceEvaluator``."""

    def __init__(self, proto: Any, path: Path) -> None:
        from onnx.reference import ReferenceEvaluator

        self._path = path
        self._session: Any = ReferenceEvaluator(proto)
        weights = {i.name for i in proto.graph.initializer}
        self.inputs = tuple(_spec(v) for v in proto.graph.input if v.name not in weights)
        self.outputs = tuple(_spec(v) for v in proto.graph.output)
        # onnx.reference does not promise thread safety: one run at a time per model.
        self._lock = threading.Lock()

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        names = outputs or [s.name for s in self.outputs]
        with self._lock:
            if self._session is None:
                raise BackendError(f"model {self._path} was unloaded")
            try:
                results = self._session.run(names, inputs)
            except Exception as e:  # the evaluator raises whatever numpy raises
                raise ModelError(f"onnx-reference failed to run {self._path}: "
                                 f"{type(e).__name__}: {e}") from e
        return {n: np.asarray(r) for n, r in zip(names, results, strict=True)}

    def unload(self) -> None:
        with self._lock:
            self._session = None


class OnnxReferenceBackend(Backend):
    """The backend object the loader registers."""

    id = "onnx-reference"
    kind = DeviceKind.CPU

    def __init__(self) -> None:
        import onnx

        self._onnx = onnx
        self.version = f"onnx-{onnx.__version__}"

    def probe(self) -> Probe:
        # No device to open: numpy on the CPU is always there.
        return Probe(True, devices=("cpu",))

    def _read(self, path: Path) -> Any:
        try:
            return self._onnx.load(str(path))
        except Exception as e:  # DecodeError, OSError...
            raise ModelError(f"onnx-reference cannot read {path}: "
                             f"{type(e).__name__}: {e}") from e

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.suffix != ".onnx":
            return False, f"{model_path.name} is not an .onnx file"
        try:
            proto = self._read(model_path)
        except ModelError as e:
            return False, e.message
        ops = {n.op_type for n in proto.graph.node}
        refused = sorted(ops & REFUSED_OPS)
        if refused:
            return False, (f"uses {', '.join(refused)}, which onnx.reference computes "
                           f"wrongly for inference")
        try:
            from onnx.reference import ReferenceEvaluator

            ReferenceEvaluator(proto)
        except Exception as e:  # noqa: BLE001  NotImplementedError for a missing op, ...
            return False, f"onnx.reference cannot build it: {type(e).__name__}: {e}"
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        ok, why = self.supports(model_path)
        if not ok:
            raise ModelError(f"onnx-reference cannot load {model_path}: {why}")
        return ReferenceModel(self._read(model_path), model_path)


def create_backend() -> Backend:
    """The factory the inferd loader calls once per runtime."""
    return OnnxReferenceBackend()
