"""Running a native custom op on one node: attributes in, shapes through ``prepare``,
``compute`` over windows split across the model's threads (CPU) or on the daemon's
OpenCL queue with buffers in and out (GPU)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from onnx import AttributeProto, NodeProto

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.customops.contract import BindContext, BoundOp, OpKind, Shape
from inferd.libbackends.customops.native import (
    Attrs, Context, GetFloat, GetFloats, GetInt, GetInts, GetString, Window,
)
from inferd.libbackends.customops.window import Scheduler
from inferd.libbackends.native import DTYPE_CODES, DTYPE_NAMES, ERRORS, MAX_DIMS, Tensor

if TYPE_CHECKING:
    from inferd.libbackends.customops.native import NativeOp


def _find(node: NodeProto | None, name: bytes, kind: int) -> AttributeProto | None:
    if node is None:
        return None
    key = name.decode("utf-8", "replace")
    return next((a for a in node.attribute if a.name == key and a.type == kind), None)


def make_attrs(node: NodeProto | None) -> tuple[Attrs, list[Any]]:
    """The ``inferd_cst_attrs`` reader of ``node`` and the callbacks to keep alive."""
    A = AttributeProto

    def get_float(_: Any, name: bytes, out: Any) -> int:
        a = _find(node, name, A.FLOAT)
        if a is None:
            return 0
        out[0] = a.f
        return 1

    def get_int(_: Any, name: bytes, out: Any) -> int:
        a = _find(node, name, A.INT)
        if a is None:
            return 0
        out[0] = a.i
        return 1

    def get_string(_: Any, name: bytes, out: int, size: int) -> int:
        a = _find(node, name, A.STRING)
        if a is None or size < 1:
            return 0
        data = a.s[:size - 1] + b"\0"
        ctypes.memmove(out, data, len(data))
        return 1

    def get_list(kind: int, field: str) -> Any:
        def get(_: Any, name: bytes, out: Any, cap: int, count: Any) -> int:
            a = _find(node, name, kind)
            if a is None:
                return 0
            values = list(getattr(a, field))
            for i, v in enumerate(values[:cap]):
                out[i] = v
            count[0] = len(values)
            return 1
        return get

    keep = [GetFloat(get_float), GetInt(get_int), GetString(get_string),
            GetFloats(get_list(A.FLOATS, "floats")), GetInts(get_list(A.INTS, "ints"))]
    return Attrs(None, *keep), keep


def empty_attrs() -> Attrs:
    """A reader that finds nothing (the child probe's init)."""
    attrs, keep = make_attrs(None)
    _KEEP.append(keep)
    return attrs


_KEEP: list[Any] = []


def _tensor(t: Tensor, name: bytes, dtype: str, shape: Sequence[int]) -> None:
    t.name, t.dtype, t.ndim = name, DTYPE_CODES[dtype], len(shape)
    for i, d in enumerate(shape):
        t.shape[i] = d


class NativeBound(BoundOp):
    """A native op's state for one node of one model."""

    def __init__(self, op: NativeOp, node: NodeProto, ctx: BindContext) -> None:
        self.op = op
        self.t = op.t
        self.node = node
        self.where = f"custom op {op.op_type} ({op.source}) on node {node.name or '?'}"
        self.n_out = len(node.output)
        self._names = [n.encode() for n in node.input] + [n.encode() for n in node.output]
        if op.kernel is None:
            raise ModelError(f"{self.where}: {op.no_kernel}", ErrorCode.UNSUPPORTED)
        self.compute_fn = self.t.kernels[op.kernel].compute
        self.detail = f"kernel {op.kernel_name}" if op.kind is OpKind.NATIVE_CPU else \
            "opencl"
        self.cl: Any = None
        self.scheduler: Scheduler | None = None
        attrs, keep = make_attrs(node)
        cctx = Context(ctypes.pointer(attrs), max(1, ctx.threads), None, None, None)
        if op.kind is OpKind.NATIVE_GPU:
            from inferd.libbackends.customops.opencl import OpenCl

            self.cl = OpenCl.create(self.where)
            cctx.cl_context, cctx.cl_device, cctx.cl_queue = self.cl.handles()
            self.detail = f"opencl {self.cl.device_name}"
        state = ctypes.c_void_p()
        rc = self.t.init(ctypes.byref(cctx), ctypes.byref(state))
        del keep  # attributes are valid during init only
        if rc != 0:
            raise ModelError(f"{self.where}: init failed: {op.error()}",
                             ERRORS.get(rc, ErrorCode.INTERNAL))
        self.state = state
        if op.kind is OpKind.NATIVE_CPU and self.t.split_dim >= 0 and ctx.threads > 1:
            self.scheduler = Scheduler(ctx.threads, f"inferd-{ctx.model.split(' ')[0]}-cst")

    def _prepare(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[str]
                 ) -> tuple[Any, Any]:
        n_in = len(shapes)
        ins, outs = (Tensor * max(1, n_in))(), (Tensor * max(1, self.n_out))()
        for i, (s, d) in enumerate(zip(shapes, dtypes)):
            if len(s) > MAX_DIMS:
                raise ModelError(f"{self.where}: input {i} has rank {len(s)}; the C ABI "
                                 f"carries at most {MAX_DIMS}", ErrorCode.INVALID_ARGUMENT)
            _tensor(ins[i], self._names[i], d, s)
        for i in range(self.n_out):
            outs[i].name = self._names[n_in + i] if n_in + i < len(self._names) else b""
        rc = self.t.prepare(self.state, ins, n_in, outs, self.n_out)
        if rc != 0:
            raise ModelError(f"{self.where}: prepare failed: {self.op.error()}",
                             ERRORS.get(rc, ErrorCode.INVALID_ARGUMENT))
        for i in range(self.n_out):
            if outs[i].dtype not in DTYPE_NAMES or not 0 <= outs[i].ndim <= MAX_DIMS:
                raise ModelError(f"{self.where}: prepare gave output {i} dtype "
                                 f"{outs[i].dtype} and rank {outs[i].ndim}",
                                 ErrorCode.INTERNAL)
        return ins, outs

    def shape_infer(self, in_shapes: list[Shape], in_dtypes: list[np.dtype[Any]]
                    ) -> tuple[list[Shape], list[np.dtype[Any]]]:
        if any(s is None for s in in_shapes):
            raise ModelError(f"{self.where}: an input's rank is unknown")
        shapes = [[d if isinstance(d, int) else -1 for d in s] for s in in_shapes]
        _, outs = self._prepare(shapes, [np.dtype(d).name for d in in_dtypes])
        return ([[int(d) if d >= 0 else None for d in o.shape[:o.ndim]] for o in outs[:self.n_out]],
                [np.dtype(DTYPE_NAMES[o.dtype]) for o in outs[:self.n_out]])

    def compute(self, inputs: Sequence[NDArray[Any]]) -> list[NDArray[Any]]:
        arrays = [np.ascontiguousarray(a) for a in inputs]
        ins, outs = self._prepare([a.shape for a in arrays], [a.dtype.name for a in arrays])
        results = [np.empty(tuple(outs[i].shape[:outs[i].ndim]), DTYPE_NAMES[outs[i].dtype])
                   for i in range(self.n_out)]
        if self.cl is not None:
            self.cl.run(self, ins, outs, arrays, results)
            return results
        for t, a in zip(ins, arrays):
            t.data, t.nbytes = a.ctypes.data, a.nbytes
        for i, r in enumerate(results):
            outs[i].data, outs[i].nbytes = r.ctypes.data, r.nbytes
        n_in = len(arrays)
        dim = self.t.split_dim
        if dim < 0 or not results or results[0].ndim <= dim:
            self.call(ins, n_in, outs, 0, 1)
        elif self.scheduler is not None:
            self.scheduler.run(lambda s, e: self.call(ins, n_in, outs, s, e), 0,
                               results[0].shape[dim], self.t.split_step)
        else:
            self.call(ins, n_in, outs, 0, results[0].shape[dim])
        return results

    def call(self, ins: Any, n_in: int, outs: Any, start: int, end: int) -> None:
        """One compute() call on the window [start, end) (releases the GIL)."""
        rc = self.compute_fn(self.state, ins, n_in, outs, self.n_out,
                             ctypes.byref(Window(start, end)))
        if rc != 0:
            raise ModelError(f"{self.where}: compute failed: {self.op.error()}",
                             ERRORS.get(rc, ErrorCode.INTERNAL))

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.state:
            self.t.destroy(self.state)
            self.state = ctypes.c_void_p()
        if self.cl is not None:
            self.cl.close()
