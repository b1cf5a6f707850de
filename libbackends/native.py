"""Native backend plugins: the ctypes side of ``include/inferd_backend.h``.

:func:`open_native` dlopens a ``lib<name>_backend.so``, checks its API version before
calling anything else, fetches its function table and wraps it as a
:class:`~inferd.libbackends.contract.Backend`. Before the daemon does so,
:func:`inferd.libbackends.childprobe.probe_in_children` runs the same steps plus
``probe()`` in a short-lived child process, so a plugin that segfaults, aborts or hangs
never touches the daemon.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import BackendError, ErrorCode, InferdError, ModelError
from inferd.libbackends.contract import (
    API_VERSION, BACKEND_ID, Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)
from inferd.libbackends.registry import CandidateError, Stage

API_VERSION_SYMBOL = "inferd_backend_api_version"
GETTER_SYMBOL = "inferd_backend_get"
MAX_DIMS = 8  # INFERD_MAX_DIMS

# ONNX TensorProto element type numbers (INFERD_DTYPE_*) <-> wire dtype names.
DTYPE_NAMES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32",
               7: "int64", 9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64"}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}
KINDS = {0: DeviceKind.CPU, 1: DeviceKind.GPU, 2: DeviceKind.NPU}
# INFERD_ERR_* -> wire error codes
ERRORS = {1: ErrorCode.INVALID_ARGUMENT, 2: ErrorCode.NOT_FOUND, 3: ErrorCode.UNSUPPORTED,
          4: ErrorCode.UNAVAILABLE, 5: ErrorCode.RESOURCE_EXHAUSTED, 6: ErrorCode.INTERNAL}


class Tensor(ctypes.Structure):
    """``inferd_tensor``."""

    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * MAX_DIMS),
                ("data", ctypes.c_void_p), ("nbytes", ctypes.c_uint64)]


_TensorP = ctypes.POINTER(Tensor)
_c = ctypes.CFUNCTYPE  # foreign calls through CFUNCTYPE release the GIL


class Table(ctypes.Structure):
    """``inferd_backend`` (API 1.0). Members are appended by later minors."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("id", _c(ctypes.c_char_p)),
        ("version", _c(ctypes.c_char_p)),
        ("device_kind", _c(ctypes.c_int32)),
        ("probe", _c(ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t)),
        ("supports", _c(ctypes.c_int32, ctypes.c_char_p)),
        ("load", _c(ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32,
                    ctypes.POINTER(ctypes.c_void_p))),
        ("describe", _c(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
                        ctypes.POINTER(_TensorP), ctypes.POINTER(ctypes.c_size_t))),
        ("run", _c(ctypes.c_int32, ctypes.c_void_p, _TensorP, ctypes.c_size_t,
                   ctypes.POINTER(_TensorP), ctypes.POINTER(ctypes.c_size_t))),
        ("free", _c(None, _TensorP, ctypes.c_size_t)),
        ("unload", _c(None, ctypes.c_void_p)),
        ("last_error", _c(ctypes.c_char_p)),
    ]


FUNCTIONS = [f[0] for f in Table._fields_ if f[0] != "size"]

StageHook = Callable[[str, Stage], None]


def _no_step(what: str, stage: Stage) -> None:
    pass


def version_problem(major: int, minor: int,
                    api: tuple[int, int] = API_VERSION) -> str | None:
    """Why a plugin built for API ``major.minor`` cannot load into this daemon's API
    ``api`` (the backend contract's by default), or None if it can."""
    ours = f"{api[0]}.{api[1]}"
    if major != api[0]:
        return (f"API version {major}.{minor} is incompatible with the daemon's {ours}: "
                f"the major version must be equal")
    if minor > api[1]:
        return (f"API version {major}.{minor} is newer than the daemon's {ours}: the "
                f"minor version must not be greater (update inferd, or build the plugin "
                f"against the header of inferd {ours})")
    return None


def open_native(path: Path, step: StageHook = _no_step) -> NativeBackend:
    """dlopen a native plugin, check its version and table, and wrap it.

    Args:
        path: the ``lib<name>_backend.so``.
        step: called before each action with what is about to happen and its stage
            (the child process reports these, so a crash names where it happened).

    Raises:
        CandidateError: the stage that failed and why; the library is closed again.
    """
    step("dlopen()", Stage.OPENED)
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    except OSError as e:
        raise CandidateError(Stage.OPENED, f"dlopen failed: {e}") from e
    try:
        return _wrap(lib, path, step)
    except CandidateError:
        _dlclose(lib)
        raise


def _symbol(lib: ctypes.CDLL, name: str, restype: Any) -> Any:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise CandidateError(Stage.CONTRACT_CHECKED,
                             f"symbol {name} is not exported") from None
    fn.restype, fn.argtypes = restype, []
    return fn


def _wrap(lib: ctypes.CDLL, path: Path, step: StageHook) -> NativeBackend:
    check = Stage.CONTRACT_CHECKED
    step(f"{API_VERSION_SYMBOL}()", check)
    packed = _symbol(lib, API_VERSION_SYMBOL, ctypes.c_uint32)()
    major, minor = packed >> 16, packed & 0xFFFF
    problem = version_problem(major, minor)
    if problem:
        raise CandidateError(check, problem)
    getter = _symbol(lib, GETTER_SYMBOL, ctypes.POINTER(Table))
    step(f"{GETTER_SYMBOL}()", check)
    ptr = getter()
    if not ptr:
        raise CandidateError(check, f"{GETTER_SYMBOL}() returned NULL")
    table = ptr.contents
    if table.size < ctypes.sizeof(Table):
        raise CandidateError(check, f"function table is {table.size} bytes, API "
                                    f"{major}.{minor} needs {ctypes.sizeof(Table)}")
    missing = [f for f in FUNCTIONS if not getattr(table, f)]
    if missing:
        raise CandidateError(check, f"function table entries {', '.join(missing)} are NULL")
    step("id(), version(), device_kind()", check)
    ident = _text(table.id())
    if not BACKEND_ID.fullmatch(ident):
        raise CandidateError(check, f"id() returned {ident!r}: an id is 1-64 letters, "
                                    f"digits, '.', '_' or '-'")
    kind_code = table.device_kind()
    if kind_code not in KINDS:
        raise CandidateError(check, f"device_kind() returned {kind_code}, not one of "
                                    f"{sorted(KINDS)} (cpu, gpu, npu)", ident)
    return NativeBackend(lib, table, path, ident, _text(table.version()),
                         KINDS[kind_code], (major, minor))


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def _dlclose(lib: ctypes.CDLL) -> None:
    import _ctypes

    _ctypes.dlclose(lib._handle)  # type: ignore[attr-defined]


class NativeBackend(Backend):
    """A native plugin's function table behind the Backend contract."""

    def __init__(self, lib: ctypes.CDLL, table: Table, path: Path, ident: str,
                 version: str, kind: DeviceKind, api_version: tuple[int, int]) -> None:
        self._lib = lib  # keeps the library loaded as long as the backend lives
        self._t = table
        self.path = path
        self.id = ident
        self.version = version
        self.kind = kind
        self.api_version = api_version

    def _error(self) -> str:
        return _text(self._t.last_error()) or "no message"

    def probe(self) -> Probe:
        buf = ctypes.create_string_buffer(1024)
        if self._t.probe(buf, len(buf)) == 1:
            devices = tuple(d.strip() for d in _text(buf.value).split(",") if d.strip())
            return Probe(True, devices=devices)
        return Probe(False, self._error())

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if self._t.supports(os.fsencode(model_path)) == 1:
            return True, ""
        return False, self._error()

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        handle = ctypes.c_void_p()
        rc = self._t.load(os.fsencode(model_path), options.intra_op_threads,
                          ctypes.byref(handle))
        if rc != 0 or not handle:
            raise ModelError(f"backend {self.id} cannot load {model_path}: {self._error()}",
                             ERRORS.get(rc, ErrorCode.INTERNAL))
        try:
            return NativeModel(self, handle, model_path)
        except InferdError:
            self._t.unload(handle)
            raise


class NativeModel(LoadedModel):
    """A model loaded by a native plugin."""

    def __init__(self, backend: NativeBackend, handle: ctypes.c_void_p, path: Path) -> None:
        self._b = backend
        self._t = backend._t
        self._handle: ctypes.c_void_p | None = handle
        self._path = path
        self._lock = threading.Lock()  # guards _handle against unload during a run
        self._running = 0
        self.inputs = self._describe(0)
        self.outputs = self._describe(1)

    def _describe(self, is_output: int) -> tuple[TensorSpec, ...]:
        arr, count = _TensorP(), ctypes.c_size_t()
        if self._t.describe(self._handle, is_output, ctypes.byref(arr),
                            ctypes.byref(count)) != 0:
            raise ModelError(f"backend {self._b.id}: describe() of {self._path} failed: "
                             f"{self._b._error()}")
        specs = []
        for i in range(count.value):
            t = arr[i]
            if t.dtype not in DTYPE_NAMES or not 0 <= t.ndim <= MAX_DIMS:
                raise ModelError(f"backend {self._b.id}: {self._path} tensor {i} has dtype "
                                 f"{t.dtype} and rank {t.ndim}, which inferd cannot carry")
            shape = tuple(int(d) if d >= 0 else None for d in t.shape[:t.ndim])
            specs.append(TensorSpec(_text(t.name), DTYPE_NAMES[t.dtype], shape))
        return tuple(specs)

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        with self._lock:
            if self._handle is None:
                raise BackendError(f"model {self._path} was unloaded", ErrorCode.UNAVAILABLE)
            self._running += 1
        try:
            return self._run(inputs, outputs)
        finally:
            with self._lock:
                self._running -= 1

    def _run(self, inputs: dict[str, NDArray[Any]],
             outputs: list[str] | None) -> dict[str, NDArray[Any]]:
        n = len(self.inputs)
        arr = (Tensor * n)()
        keep = []
        for i, spec in enumerate(self.inputs):
            a = np.ascontiguousarray(inputs[spec.name])
            if a.ndim > MAX_DIMS:
                raise ModelError(f"input {spec.name!r} has rank {a.ndim}; the C ABI "
                                 f"carries at most {MAX_DIMS}", ErrorCode.INVALID_ARGUMENT)
            name = spec.name.encode()
            keep.append((a, name))
            t = arr[i]
            t.name, t.dtype, t.ndim = name, DTYPE_CODES[spec.dtype], a.ndim
            for axis, d in enumerate(a.shape):
                t.shape[axis] = d
            t.data, t.nbytes = a.ctypes.data, a.nbytes
        out, count = _TensorP(), ctypes.c_size_t()
        rc = self._t.run(self._handle, arr, n, ctypes.byref(out), ctypes.byref(count))
        if rc != 0:
            raise ModelError(f"backend {self._b.id} failed to run {self._path}: "
                             f"{self._b._error()}", ERRORS.get(rc, ErrorCode.INTERNAL))
        try:
            results = {}
            for i in range(count.value):
                t = out[i]
                results[_text(t.name)] = self._copy_out(t)
        finally:
            self._t.free(out, count.value)
        wanted = outputs or [s.name for s in self.outputs]
        missing = [w for w in wanted if w not in results]
        if missing:
            raise ModelError(f"backend {self._b.id}: run() of {self._path} did not produce "
                             f"outputs {missing}")
        return {w: results[w] for w in wanted}

    def _copy_out(self, t: Tensor) -> NDArray[Any]:
        if t.dtype not in DTYPE_NAMES or not 0 <= t.ndim <= MAX_DIMS:
            raise ModelError(f"backend {self._b.id}: output {_text(t.name)!r} has dtype "
                             f"{t.dtype} and rank {t.ndim}")
        dtype = np.dtype(DTYPE_NAMES[t.dtype])
        shape = tuple(int(d) for d in t.shape[:t.ndim])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if t.nbytes != expected or (expected and not t.data):
            raise ModelError(f"backend {self._b.id}: output {_text(t.name)!r} holds "
                             f"{t.nbytes} bytes, its shape {list(shape)} needs {expected}")
        if expected == 0:
            return np.zeros(shape, dtype)
        raw = (ctypes.c_char * expected).from_address(t.data)
        return np.frombuffer(memoryview(raw), dtype).reshape(shape).copy()

    def unload(self) -> None:
        with self._lock:
            if self._running:
                raise BackendError(f"model {self._path}: unload while {self._running} "
                                   f"runs are in progress")
            handle, self._handle = self._handle, None
        if handle is not None:
            self._t.unload(handle)
