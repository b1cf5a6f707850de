"""Native custom ops: the ctypes side of ``include/inferd_customop.h``.

:func:`load_libraries` probes every ``libinferdcst_<name>.so`` in a child process first
(this module's ``__main__``, through :func:`inferd.libbackends.childprobe.probe_in_children`):
dlopen, ``inferd_customop_get()``, the table's version and members, and for CPU ops one
``init()`` + ``destroy()``. A library that crashes, hangs, lacks the symbol or was built
for another API version is skipped with the stage and reason; the others are opened in
the daemon and registered. Kernel variants are chosen by CPU feature when the op is
opened (:mod:`.cpufeatures`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferd.libbackends import childprobe
from inferd.libbackends import native as backend_native
from inferd.libbackends.customops import cpufeatures
from inferd.libbackends.customops.contract import (
    BindContext, BoundOp, CustomOp, OpKind, OpRegistry, Skipped,
)
from inferd.libbackends.native import Tensor, _text
from inferd.libbackends.registry import CandidateError, Stage

log = logging.getLogger(__name__)

API_VERSION = (1, 0)
"""(major, minor) of ``inferd_customop.h``."""
GETTER = "inferd_customop_get"
TARGETS = {0: OpKind.NATIVE_CPU, 1: OpKind.NATIVE_GPU}
_OP_TYPE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_c = ctypes.CFUNCTYPE
_TP = ctypes.POINTER(Tensor)


class Window(ctypes.Structure):
    _fields_ = [("start", ctypes.c_int64), ("end", ctypes.c_int64)]


ComputeFn = _c(ctypes.c_int32, ctypes.c_void_p, _TP, ctypes.c_size_t, _TP, ctypes.c_size_t,
               ctypes.POINTER(Window))


class Kernel(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("features", ctypes.c_char_p),
                ("compute", ComputeFn)]


GetFloat = _c(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float))
GetInt = _c(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64))
GetString = _c(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
               ctypes.c_size_t)
GetFloats = _c(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p,
               ctypes.POINTER(ctypes.c_float), ctypes.c_size_t,
               ctypes.POINTER(ctypes.c_size_t))
GetInts = _c(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p,
             ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t))


class Attrs(ctypes.Structure):
    _fields_ = [("node", ctypes.c_void_p), ("get_float", GetFloat), ("get_int", GetInt),
                ("get_string", GetString), ("get_floats", GetFloats), ("get_ints", GetInts)]


class Context(ctypes.Structure):
    _fields_ = [("attrs", ctypes.POINTER(Attrs)), ("threads", ctypes.c_int32),
                ("cl_context", ctypes.c_void_p), ("cl_device", ctypes.c_void_p),
                ("cl_queue", ctypes.c_void_p)]


class Table(ctypes.Structure):
    """``inferd_customop`` (API 1.0)."""

    _fields_ = [
        ("api_version", ctypes.c_uint32), ("size", ctypes.c_uint32),
        ("op_type", ctypes.c_char_p), ("domain", ctypes.c_char_p),
        ("target", ctypes.c_int32), ("split_dim", ctypes.c_int32),
        ("split_step", ctypes.c_int64),
        ("kernels", ctypes.POINTER(Kernel)), ("n_kernels", ctypes.c_size_t),
        ("init", _c(ctypes.c_int32, ctypes.POINTER(Context), ctypes.POINTER(ctypes.c_void_p))),
        ("prepare", _c(ctypes.c_int32, ctypes.c_void_p, _TP, ctypes.c_size_t, _TP,
                       ctypes.c_size_t)),
        ("destroy", _c(None, ctypes.c_void_p)),
        ("last_error", _c(ctypes.c_char_p)),
    ]


FUNCTIONS = ("init", "prepare", "destroy", "last_error")


def version_problem(packed: int) -> str | None:
    """The backends' version rule, for the custom-op API (``packed``: major << 16 | minor)."""
    return backend_native.version_problem(packed >> 16, packed & 0xFFFF, API_VERSION)


def open_table(path: Path, step: backend_native.StageHook = backend_native._no_step
               ) -> tuple[ctypes.CDLL, Table]:
    """dlopen an op library and check its table.

    Raises:
        CandidateError: the stage that failed and why.
    """
    step("dlopen()", Stage.OPENED)
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    except OSError as e:
        raise CandidateError(Stage.OPENED, f"dlopen failed: {e}") from e
    check = Stage.CONTRACT_CHECKED
    try:
        getter = getattr(lib, GETTER)
    except AttributeError:
        raise CandidateError(check, f"symbol {GETTER} is not exported") from None
    getter.restype, getter.argtypes = ctypes.POINTER(Table), []
    step(f"{GETTER}()", check)
    ptr = getter()
    if not ptr:
        raise CandidateError(check, f"{GETTER}() returned NULL")
    head = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint32 * 2)).contents
    problem = version_problem(head[0])
    if problem:
        raise CandidateError(check, problem)
    if head[1] < ctypes.sizeof(Table):
        raise CandidateError(check, f"the table is {head[1]} bytes, API 1.0 needs "
                                    f"{ctypes.sizeof(Table)}")
    t = ptr.contents
    missing = [f for f in FUNCTIONS if not getattr(t, f)]
    if missing:
        raise CandidateError(check, f"table entries {', '.join(missing)} are NULL")
    op_type = _text(t.op_type)
    if not _OP_TYPE.fullmatch(op_type):
        raise CandidateError(check, f"op_type {op_type!r} is not a valid op type")
    if t.target not in TARGETS:
        raise CandidateError(check, f"target {t.target} is not 0 (cpu) or 1 (gpu)")
    if not t.kernels or t.n_kernels < 1:
        raise CandidateError(check, "the op has no kernel (n_kernels is 0)")
    for i in range(t.n_kernels):
        if not t.kernels[i].compute:
            raise CandidateError(check, f"kernel {i} ({_text(t.kernels[i].name)}) has a "
                                        f"NULL compute")
    if t.split_step < 1 and t.split_dim >= 0:
        raise CandidateError(check, f"split_step is {t.split_step}, must be >= 1")
    return lib, t


class NativeOp(CustomOp):
    """One op library, opened in the daemon, with its kernel chosen for this CPU."""

    def __init__(self, lib: ctypes.CDLL, table: Table, path: Path) -> None:
        self._lib = lib  # keeps the library loaded
        self.t = table
        self.op_type = _text(table.op_type)
        self.domain = _text(table.domain) or None
        self.kind = TARGETS[table.target]
        self.source = str(path)
        self.kernels = [(_text(table.kernels[i].name) or f"kernel{i}",
                         _text(table.kernels[i].features)) for i in range(table.n_kernels)]
        if self.kind is OpKind.NATIVE_CPU:
            self.kernel, self.no_kernel = cpufeatures.choose(self.kernels)
        else:
            self.kernel, self.no_kernel = 0, ""

    def error(self) -> str:
        return _text(self.t.last_error()) or "no message"

    @property
    def kernel_name(self) -> str:
        return self.kernels[self.kernel][0] if self.kernel is not None else "-"

    def bind(self, node: Any, ctx: BindContext) -> BoundOp:
        from inferd.libbackends.customops.native_run import NativeBound

        return NativeBound(self, node, ctx)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "kernel": self.kernel_name,
                "kernels": [f"{n} ({f or 'any CPU'})" for n, f in self.kernels],
                "reason": self.no_kernel}


def load_libraries(paths: Sequence[Path], registry: OpRegistry, timeout_s: float) -> None:
    """Probe ``paths`` in child processes, then open and register the good ones."""
    reports = childprobe.probe_in_children(paths, timeout_s,
                                           module="inferd.libbackends.customops.native")
    for path in paths:
        report = reports[path]
        try:
            if not report.ok:
                raise CandidateError(report.stage, report.reason)
            lib, table = open_table(path)
            op = NativeOp(lib, table, path)
        except CandidateError as e:
            registry.skipped.append(Skipped(str(path), e.reason, str(e.stage)))
            log.warning("custom op library %s skipped at stage '%s': %s", path, e.stage,
                        e.reason, extra={"PLUGIN_PATH": str(path), "STAGE": str(e.stage)})
            continue
        taken = registry.add(op)
        if taken:
            registry.skipped.append(Skipped(str(path), taken, "registered"))
            log.warning("custom op library %s skipped at stage 'registered': %s", path,
                        taken, extra={"PLUGIN_PATH": str(path), "STAGE": "registered"})
            continue
        chosen = f", kernel {op.kernel_name}" if op.kernel is not None else \
            f", {op.no_kernel}"
        log.info("custom op %s registered from %s (%s%s)", op.label, path, op.kind,
                 chosen if op.kind is OpKind.NATIVE_CPU else "",
                 extra={"PLUGIN_PATH": str(path), "OP": op.op_type})


def _child_main(path: str, parent: int) -> int:
    if not childprobe.child_setup(parent):
        return 1

    def step(what: str, stage: Stage) -> None:
        childprobe.report({"doing": what, "stage": str(stage)})

    try:
        _, t = open_table(Path(path), step)
        if t.target == 0:  # a GPU op's init needs the daemon's OpenCL context
            step("init() without attributes, destroy()", Stage.PROBED)
            from inferd.libbackends.customops.native_run import empty_attrs

            attrs = empty_attrs()
            ctx = Context(ctypes.pointer(attrs), 1, None, None, None)
            state = ctypes.c_void_p()
            if t.init(ctypes.byref(ctx), ctypes.byref(state)) == 0:
                t.destroy(state)
    except CandidateError as e:
        childprobe.report({"failed": str(e.stage), "reason": e.reason})
        return 0
    childprobe.report({"ok": True, "id": _text(t.op_type)})
    return 0


if __name__ == "__main__":
    # Run the importable module's copy: native_run's ctypes types are that module's.
    from inferd.libbackends.customops import native as _module

    sys.exit(_module._child_main(sys.argv[1], int(sys.argv[2])))
