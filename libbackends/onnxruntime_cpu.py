"""The built-in CPU backend: onnxruntime with the CPU execution provider."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import BackendError, ModelError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)

log = logging.getLogger(__name__)

# Ops onnxruntime runs without a kernel: it folds them into initializers at load.
_NO_KERNEL = {("", "Constant")}


def _is_function(op_type: str, version: int, domain: str) -> bool:
    """Whether ONNX defines the op as a function, which onnxruntime expands into ops it
    has kernels for."""
    try:
        from onnx import defs

        schema = defs.get_schema(op_type, version, domain)
    except Exception:  # noqa: BLE001  no such schema (onnx raises SchemaError)
        return False
    return bool(getattr(schema, "has_function", False)
                or getattr(schema, "has_context_dependent_function", False))

# onnxruntime type strings -> wire dtype names
_ORT_TYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(int16)": "int16",
    "tensor(uint16)": "uint16", "tensor(int32)": "int32", "tensor(uint32)": "uint32",
    "tensor(int64)": "int64", "tensor(uint64)": "uint64", "tensor(bool)": "bool",
    "tensor(string)": "string",
}


def _spec(arg: Any, model: str) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ModelError(f"model {model}: tensor {arg.name!r} has type {arg.type}, "
                         f"which inferd cannot carry")
    shape = tuple(d if isinstance(d, int | str) else None for d in (arg.shape or ()))
    return TensorSpec(arg.name, dtype, shape)


class OrtModel(LoadedModel):
    """An onnxruntime InferenceSession behind the LoadedModel contract."""

    def __init__(self, session: Any, path: Path) -> None:
        self._session = session
        self._path = path
        self.inputs = tuple(_spec(a, str(path)) for a in session.get_inputs())
        self.outputs = tuple(_spec(a, str(path)) for a in session.get_outputs())
        self._output_names = [o.name for o in self.outputs]

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        names = outputs or self._output_names
        try:
            results = self._session.run(names, inputs)
        except Exception as e:  # onnxruntime raises its own exception classes
            raise ModelError(f"onnxruntime failed to run {self._path}: {e}") from e
        return {name: np.asarray(value) for name, value in zip(names, results)}

    def unload(self) -> None:
        self._session = None


class OnnxRuntimeCpuBackend(Backend):
    """onnxruntime, CPU execution provider, thread counts from the load options."""

    id = "onnxruntime"
    kind = DeviceKind.CPU

    def __init__(self) -> None:
        self._kernel_table: dict[tuple[str, str], list[tuple[int, int]]] | None = None
        try:
            import onnxruntime
        except ImportError:
            self._ort = None
            self.version = "unavailable"
        else:
            self._ort = onnxruntime
            self.version = onnxruntime.__version__

    def probe(self) -> Probe:
        if self._ort is None:
            return Probe(False, "python module onnxruntime is not installed")
        providers = self._ort.get_available_providers()
        if "CPUExecutionProvider" not in providers:
            return Probe(False, f"CPUExecutionProvider missing (have {providers})")
        return Probe(True, devices=("cpu",))

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.suffix != ".onnx":
            return False, f"{model_path.name} is not an .onnx file"
        return True, ""

    def supported_nodes(self, model: Any) -> list[str]:
        """For each node of ``model`` (an onnx.ModelProto): "" if the CPU provider's
        kernel registry has a kernel for its op at the model's opset, else why not."""
        kernels = self._kernels()
        if kernels is None:  # the table cannot be read: a standard domain is taken as run
            from inferd.libbackends.customops.contract import STANDARD_DOMAINS

            return ["" if (n.domain or "") in STANDARD_DOMAINS else
                    f"domain {n.domain!r} is not a standard ONNX domain"
                    for n in model.graph.node]
        opsets = {(o.domain or ""): o.version for o in model.opset_import}
        local = {(f.domain, f.name) for f in model.functions}  # inlined by onnxruntime
        answer = []
        for node in model.graph.node:
            domain = "" if node.domain in ("", "ai.onnx") else node.domain
            version = opsets.get(domain, opsets.get("ai.onnx", 0) if not domain else 1)
            ranges = kernels.get((domain, node.op_type), [])
            if (domain, node.op_type) in _NO_KERNEL or (domain, node.op_type) in local or \
                    any(lo <= version <= hi for lo, hi in ranges) or \
                    _is_function(node.op_type, version, domain):
                answer.append("")
            elif ranges:
                answer.append(f"no CPU kernel for {node.op_type} at opset {version}")
            else:
                answer.append(f"no CPU kernel for {node.op_type} (domain "
                              f"{domain or 'ai.onnx'!r})")
        return answer

    def _kernels(self) -> dict[tuple[str, str], list[tuple[int, int]]] | None:
        if self._ort is not None and \
                "CUDAExecutionProvider" in self._ort.get_available_providers():
            # onnxruntime-gpu's get_all_opkernel_def() loads the CUDA provider library
            # and crashes the process (SIGSEGV, 1.31) where CUDA is missing: not asked.
            return None
        if self._kernel_table is None:
            table: dict[tuple[str, str], list[tuple[int, int]]] = {}
            if self._ort is not None:
                from onnxruntime.capi import onnxruntime_pybind11_state as C

                for k in C.get_all_opkernel_def():
                    if k.provider == "CPUExecutionProvider":
                        domain = "" if k.domain in ("", "ai.onnx") else k.domain
                        table.setdefault((domain, k.op_name), []).append(k.version_range)
            self._kernel_table = table
        return self._kernel_table

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        if self._ort is None:
            raise BackendError("onnxruntime is not installed")
        so = self._ort.SessionOptions()
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = options.inter_op_threads
        so.log_severity_level = 3
        if not options.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            session = self._ort.InferenceSession(
                str(model_path), sess_options=so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's own Fail/InvalidGraph/... classes
            raise ModelError(f"onnxruntime cannot load {model_path}: {e}") from e
        return OrtModel(session, model_path)
