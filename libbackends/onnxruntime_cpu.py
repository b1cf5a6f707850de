"""The built-in CPU backend: onnxruntime with the CPU execution provider.

Its ``[onnxruntime]`` options (model.toml, over inferd.toml's daemon-wide defaults) choose
the CPU memory-arena policy of each model (docs/cache.md, "Working memory and the
onnxruntime arena"):

- ``memory_arena``: onnxruntime's CPU arena on (true) or off (false);
- ``arena_extend_strategy``: ``"next_power_of_two"`` gives the model its own arena,
  grown by powers of two (onnxruntime's default); ``"same_as_requested"`` puts the model
  in the daemon's one shared arena, grown by what is requested, whose chunks every
  model in it reuses;
- ``arena_max_memory``: a cap on the shared arena (bytes or ``"256MiB"``; 0 or
  ``"unlimited"``: none); a run that needs more fails instead of growing it. One value
  per process: the first model to use the shared arena sets it up;
- ``arena_shrinkage``: after each run, arena chunks not in use are handed back
  (``memory.enable_memory_arena_shrinkage``);
- ``memory_pattern``: onnxruntime's per-shape memory pattern (``enable_mem_pattern``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import logging
import sys
import threading
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.dtypes import PACKED, numpy_dtype, pack, unpack
from inferd.ipc.errors import BackendError, ModelError
from inferd.libbackends.childprobe import engine_facts
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec, address_free, aligned,
    run_error,
)
from inferd.libbackends.onnxfile import op_types

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
    "tensor(bfloat16)": "bfloat16", "tensor(float8e4m3fn)": "float8_e4m3fn",
    "tensor(float8e4m3fnuz)": "float8_e4m3fnuz", "tensor(float8e5m2)": "float8_e5m2",
    "tensor(float8e5m2fnuz)": "float8_e5m2fnuz", "tensor(int4)": "int4",
    "tensor(uint4)": "uint4", "tensor(float8e8m0)": "float8_e8m0fnu",
    "tensor(float4e2m1)": "float4_e2m1fn", "tensor(int2)": "int2", "tensor(uint2)": "uint2",
}
# ONNX's element type numbers of the types numpy lacks (ml_dtypes holds them): the
# onnxruntime Python binding takes and gives them only as OrtValues of raw bytes
_ONNX_ELEMENT = {"bfloat16": 16, "float8_e4m3fn": 17, "float8_e4m3fnuz": 18,
                 "float8_e5m2": 19, "float8_e5m2fnuz": 20, "uint4": 21, "int4": 22,
                 "float4_e2m1fn": 23, "float8_e8m0fnu": 24, "uint2": 25, "int2": 26}


def _spec(arg: Any, model: str) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ModelError(f"model {model}: tensor {arg.name!r} has type {arg.type}, "
                         f"which inferd cannot carry")
    shape = tuple(d if isinstance(d, int | str) else None for d in (arg.shape or ()))
    return TensorSpec(arg.name, dtype, shape)


EXTEND_STRATEGIES = {"next_power_of_two": 0, "same_as_requested": 1}
SHARED_ARENA_STRATEGY = "same_as_requested"


@dataclass(frozen=True)
class ArenaPolicy:
    """The memory options of one model (see the module docstring)."""

    memory_arena: bool = True
    arena_extend_strategy: str = "next_power_of_two"
    arena_max_memory: int = 0
    arena_shrinkage: bool = False
    memory_pattern: bool = True

    @property
    def shared(self) -> bool:
        return self.memory_arena and self.arena_extend_strategy == SHARED_ARENA_STRATEGY


def _flag(options: dict[str, Any], key: str, default: bool, where: str) -> bool:
    value = options.get(key, default)
    if not isinstance(value, bool):
        raise ModelError(f"{where}: [onnxruntime] {key} = {value!r}: expected true or false")
    return value


def _size(value: Any, key: str, where: str) -> int:
    if value in (0, "0", "unlimited", "none"):
        return 0
    text = value.strip().upper() if isinstance(value, str) else None
    units = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if text:
        number = text.rstrip("KMGIB")
        unit = text[len(number):].strip()
        try:
            if unit in units and float(number) > 0:
                return int(float(number) * units[unit])
        except ValueError:
            pass
    raise ModelError(f"{where}: [onnxruntime] {key} = {value!r}: expected a size such as "
                     f"'256MiB', or 'unlimited'")


PROBE_TIMEOUT_S = 60.0
"""How long the child process that imports onnxruntime for the probe may take."""
ENGINE_FACTS = ("import os, onnxruntime as o\nprint(json.dumps({'version': o.__version__, "
                "'location': os.path.dirname(o.__file__), "
                "'providers': o.get_available_providers()}))")


@functools.cache
def ort_facts() -> dict[str, Any]:
    """onnxruntime's version and execution providers, asked once per process of a child
    (both onnxruntime backends probe with it)."""
    return engine_facts("onnxruntime", ENGINE_FACTS, PROBE_TIMEOUT_S)  # type: ignore[no-any-return]


def installed_version(distribution: str) -> str:
    """A package's version from its metadata, without importing it ("" where an add-on
    vendored it without metadata: the probe's child says it)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


SHRINKAGE = "memory.enable_memory_arena_shrinkage"
"""The run option that shrinks onnxruntime's CPU arena after each run."""

THREAD_KEYS = ("intra_op_threads", "inter_op_threads", "allow_spinning")
OPTION_KEYS = ("memory_arena", "arena_extend_strategy", "arena_max_memory",
               "arena_shrinkage", "memory_pattern")


def arena_policy(options: dict[str, Any], where: str) -> ArenaPolicy:
    """The :class:`ArenaPolicy` that ``options`` (a model's ``[onnxruntime]`` table over
    the daemon-wide one) asks for.

    Raises:
        ModelError: an unknown key or a bad value, naming the model.toml key.
    """
    # the thread keys of the daemon's [onnxruntime] section arrive too; LoadOptions
    # carries them as its own fields
    unknown = sorted(set(options) - set(OPTION_KEYS) - set(THREAD_KEYS))
    if unknown:
        raise ModelError(f"{where}: unknown key(s) {unknown} in [onnxruntime]; known: "
                         f"{', '.join(OPTION_KEYS)}")
    strategy = options.get("arena_extend_strategy", "next_power_of_two")
    if strategy not in EXTEND_STRATEGIES:
        raise ModelError(f"{where}: [onnxruntime] arena_extend_strategy = {strategy!r}: "
                         f"expected one of {', '.join(EXTEND_STRATEGIES)}")
    return ArenaPolicy(
        memory_arena=_flag(options, "memory_arena", True, where),
        arena_extend_strategy=strategy,
        arena_max_memory=_size(options.get("arena_max_memory", 0), "arena_max_memory",
                               where),
        arena_shrinkage=_flag(options, "arena_shrinkage", False, where),
        memory_pattern=_flag(options, "memory_pattern", True, where))


def _needs_alignment(path: Path) -> bool:
    """Whether the model's float inputs must be aligned for the same bits every time:
    not for a model made only of :data:`~inferd.libbackends.contract.ADDRESS_FREE_OPS`
    (4.9 MB through an Identity skips a 0.2 ms copy); a file that onnx cannot read is
    aligned."""
    try:
        return not address_free(op_types(path))
    except ModelError:
        return True


class OrtModel(LoadedModel):
    """An onnxruntime InferenceSession behind the LoadedModel contract."""

    def __init__(self, session: Any, path: Path, run_options: Any = None,
                 align: bool = True) -> None:
        self._session = session
        self._path = path
        self._run_options = run_options
        # False for a model made only of ops whose results do not depend on where the
        # inputs lie (contract.ADDRESS_FREE_OPS): its inputs are read where they are
        self._align = align
        # On the CPU provider alone, the binding's own run: InferenceSession.run only
        # adds checks the daemon made already (every input there, check_inputs), for
        # graph capture and OrtValue feeds (neither used here) and the fallback from
        # another execution provider to the CPU (2 us a run).
        cpu_only = session.get_providers() == ["CPUExecutionProvider"]
        self._run = getattr(session, "_sess", session).run if cpu_only else session.run
        self._cpu_only = cpu_only
        self._bindings = threading.local()  # run_into's IOBinding, one per thread
        self._bound_options: Any = None  # run_into's RunOptions, made at its first run
        self.inputs = tuple(_spec(a, str(path)) for a in session.get_inputs())
        self.outputs = tuple(_spec(a, str(path)) for a in session.get_outputs())
        self._output_names = [o.name for o in self.outputs]
        self._raw = {t.name: t.dtype for t in (*self.inputs, *self.outputs)
                     if t.dtype in _ONNX_ELEMENT}

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        names = outputs or self._output_names
        # the same bits whatever address the input is at; the scratch copies live
        # until this thread's next run, and onnxruntime's outputs are its own memory
        if self._align:
            inputs = aligned(inputs, scratch=True)
        try:
            if self._raw:
                return self._run_raw(inputs, names)
            results = self._run(names, inputs, self._run_options)
        except Exception as e:  # onnxruntime raises its own exception classes
            # Its INVALID_ARGUMENT status is about the inputs (a dimension the model
            # fixes), and so is a failure on an empty input; any other failure is the
            # engine's: INTERNAL (docs/protocol.md).
            raise run_error(f"onnxruntime failed to run {self._path}: {e}", inputs,
                            client=type(e).__name__ == "InvalidArgument") from e
        return {name: np.asarray(value) for name, value in zip(names, results)}

    def run_into(self, inputs: dict[str, NDArray[Any]], outputs: list[str] | None,
                 into: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """:meth:`run` with the outputs in ``into`` bound to those arrays (an IOBinding:
        onnxruntime writes them there, no copy after). Only on the CPU provider and for
        the plain dtypes; an output whose shape is not the one bound fails the bound run
        (onnxruntime checks it) and the model runs again the plain way."""
        if not into or self._raw or not self._cpu_only:
            return self.run(inputs, outputs)
        names = outputs or self._output_names
        binding = getattr(self._bindings, "binding", None)
        if binding is None:
            binding = self._bindings.binding = self._session.io_binding()
        ready = aligned(inputs, scratch=True) if self._align else inputs
        ort_value = sys.modules["onnxruntime"].OrtValue
        try:
            # OrtValues, not bind_cpu_input: the binding keeps a reference to an array
            # bound that way after clear_binding_inputs (a client's region it views
            # would stay mapped in the worker)
            for name, value in ready.items():
                binding.bind_ortvalue_input(name, ort_value.ortvalue_from_numpy(value))
            for name in names:
                dest = into.get(name)
                if dest is None:
                    binding.bind_output(name, "cpu")
                else:
                    binding.bind_output(name, "cpu", 0, dest.dtype, list(dest.shape),
                                        dest.ctypes.data)
            self._session.run_with_iobinding(binding, self._bound_run_options())
            values = binding.get_outputs()
        except Exception:  # noqa: BLE001  another shape, or the run's own failure:
            return self.run(inputs, outputs)  # the plain run answers (and its error)
        finally:
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
        return {name: into[name] if name in into else np.asarray(value.numpy())
                for name, value in zip(names, values)}

    def _bound_run_options(self) -> Any:
        """The model's run options, with onnxruntime's own logging of a failed run off: a
        bound run refused for another output shape is run again plainly, which logs
        a real failure (the refusal alone would be an ERROR line in the journal)."""
        if self._bound_options is None:
            options = sys.modules["onnxruntime"].RunOptions()
            options.log_severity_level = 4
            if self._run_options is not None:
                try:
                    options.add_run_config_entry(SHRINKAGE, self._run_options
                                                 .get_run_config_entry(SHRINKAGE))
                except RuntimeError:
                    pass  # not set on the model's own
            self._bound_options = options
        return self._bound_options

    def _run_raw(self, inputs: dict[str, NDArray[Any]],
                 names: list[str]) -> dict[str, NDArray[Any]]:
        """A run with bfloat16, float8, float4 or 2- and 4-bit tensors, which the binding
        takes and gives only as OrtValues of their raw bytes."""
        ort_value = sys.modules["onnxruntime"].OrtValue
        feeds = {}
        for name, array in inputs.items():
            dtype = self._raw.get(name)
            if dtype is None:
                feeds[name] = ort_value.ortvalue_from_numpy(array)
                continue
            if dtype in PACKED:  # the binding reads the packed bytes from the front
                raw = np.zeros(array.shape, np.uint8)
                packed = pack(array)
                raw.reshape(-1)[:len(packed)] = np.frombuffer(packed, np.uint8)
            else:
                raw = np.ascontiguousarray(array).view(
                    np.uint16 if array.dtype.itemsize == 2 else np.uint8)
            feeds[name] = ort_value.ortvalue_from_numpy_with_onnx_type(
                raw, _ONNX_ELEMENT[dtype])
        values = self._session.run_with_ort_values(names, feeds, self._run_options)
        out: dict[str, NDArray[Any]] = {}
        for name, value in zip(names, values):
            dtype = self._raw.get(name)
            if dtype is None:
                out[name] = np.asarray(value.numpy())
                continue
            shape = tuple(value.shape())
            data = ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())
            count = int(np.prod(shape, dtype=np.int64))
            out[name] = (unpack(data, dtype, count) if dtype in PACKED
                         else np.frombuffer(data, numpy_dtype(dtype))[:count]).reshape(shape)
        return out

    def unload(self) -> None:
        self._session = self._run = None


class LazyOnnxRuntime:
    """The onnxruntime module of a backend, imported at its first use (19 MiB), not
    when the backend is made; both onnxruntime backends read it as ``self._ort``."""

    _module: Any = None
    _installed = True  # the cpu backend looks; the gpu one leaves it to its probe

    @property
    def _ort(self) -> Any:
        if self._module is None:
            import onnxruntime

            self._module = onnxruntime
        return self._module

    def import_engine(self) -> None:
        """Import onnxruntime now (the loader measures what it adds, once)."""
        if self._installed:
            self._ort  # noqa: B018  the property imports it


class OnnxRuntimeCpuBackend(LazyOnnxRuntime, Backend):
    """onnxruntime, CPU execution provider, thread counts from the load options."""

    id = "onnxruntime"
    kind = DeviceKind.CPU

    def __init__(self) -> None:
        self._kernel_table: dict[tuple[str, str], list[tuple[int, int]]] | None = None
        # onnxruntime is imported when the first model loads on it (19 MiB); until then
        # the probe asks a child process (libbackends/childprobe.py: engine_facts)
        self._installed = importlib.util.find_spec("onnxruntime") is not None
        self.version = installed_version("onnxruntime") if self._installed else "unavailable"
        self._shared_lock = threading.Lock()
        self._shared_cap: int | None = None  # the shared arena's cap, once set up

    def probe(self) -> Probe:
        if not self._installed:
            return Probe(False, "python module onnxruntime is not installed")
        try:
            facts = ort_facts()
        except RuntimeError as e:
            return Probe(False, f"onnxruntime cannot be imported: {e}")
        self.version, providers = facts["version"], facts["providers"]
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
        if self._installed and \
                "CUDAExecutionProvider" in self._ort.get_available_providers():
            # onnxruntime-gpu's get_all_opkernel_def() loads the CUDA provider library
            # and crashes the process (SIGSEGV, 1.31) where CUDA is missing: not asked.
            return None
        if self._kernel_table is None:
            table: dict[tuple[str, str], list[tuple[int, int]]] = {}
            if self._installed:
                from onnxruntime.capi import onnxruntime_pybind11_state as C

                for k in C.get_all_opkernel_def():
                    if k.provider == "CPUExecutionProvider":
                        domain = "" if k.domain in ("", "ai.onnx") else k.domain
                        table.setdefault((domain, k.op_name), []).append(k.version_range)
            self._kernel_table = table
        return self._kernel_table

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        if not self._installed:
            raise BackendError("onnxruntime is not installed")
        so = self._ort.SessionOptions()
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = options.inter_op_threads
        so.log_severity_level = 3
        if not options.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        policy = arena_policy(options.options, f"model {model_path}")
        so.enable_cpu_mem_arena = policy.memory_arena
        so.enable_mem_pattern = policy.memory_pattern
        if policy.shared:
            self._shared_arena(policy.arena_max_memory, model_path)
            so.add_session_config_entry("session.use_env_allocators", "1")
        run_options = None
        if policy.memory_arena and policy.arena_shrinkage:
            run_options = self._ort.RunOptions()
            run_options.add_run_config_entry(SHRINKAGE, "cpu:0")
        try:
            session = self._ort.InferenceSession(
                str(model_path), sess_options=so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's own Fail/InvalidGraph/... classes
            raise ModelError(f"onnxruntime cannot load {model_path}: {e}") from e
        return OrtModel(session, model_path, run_options, align=_needs_alignment(model_path))

    def _shared_arena(self, cap: int, model_path: Path) -> None:
        """Register the process's shared CPU arena (grown by what is requested) once;
        every later model that asks for it must ask for the same cap."""
        assert self._ort is not None
        with self._shared_lock:
            if self._shared_cap is None:
                ort = self._ort
                info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                         ort.OrtMemType.DEFAULT)
                config = ort.OrtArenaCfg(cap, EXTEND_STRATEGIES[SHARED_ARENA_STRATEGY],
                                         -1, -1)
                try:
                    ort.create_and_register_allocator(info, config)
                except Exception as e:  # onnxruntime's own exception classes
                    raise BackendError(f"onnxruntime cannot set up the shared arena: {e}") \
                        from e
                self._shared_cap = cap
                log.info("onnxruntime shared CPU arena set up (cap %s)",
                         f"{cap} bytes" if cap else "none")
            elif self._shared_cap != cap:
                raise ModelError(f"model {model_path}: [onnxruntime] arena_max_memory = "
                                 f"{cap} differs from the shared arena's cap "
                                 f"{self._shared_cap}, set by the first model that used "
                                 f"it; one value per daemon (inferd.toml [onnxruntime])")
