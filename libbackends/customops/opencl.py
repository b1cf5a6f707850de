"""The OpenCL side of GPU-target custom ops (pyopencl; pocl on a machine without a GPU).

One context per process, on the first GPU device, else the first device of any type
(pocl's CPU device); one in-order command queue per bound op. For each compute the
daemon writes the inputs into device buffers, passes their ``cl_mem`` handles to the
op, which enqueues its kernel on the queue, and reads the outputs back when the queue
is done.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from numpy.typing import NDArray

from inferd.ipc.errors import ErrorCode, ModelError

if TYPE_CHECKING:
    from inferd.libbackends.customops.native_run import NativeBound

log = logging.getLogger(__name__)

_lock = threading.Lock()
_shared: tuple[Any, Any] | None = None  # (context, device), made on first use


def shared_context(where: str) -> tuple[Any, Any]:
    """The process's OpenCL (context, device).

    Raises:
        ModelError (UNAVAILABLE): pyopencl is missing or no OpenCL device is present.
    """
    global _shared
    with _lock:
        if _shared is not None:
            return _shared
        try:
            import pyopencl as cl
        except ImportError as e:
            raise ModelError(f"{where}: a GPU custom op needs the Python module pyopencl "
                             f"(pip install pyopencl) and an OpenCL driver",
                             ErrorCode.UNAVAILABLE) from e
        try:
            devices = [d for p in cl.get_platforms() for d in p.get_devices()]
        except cl.Error as e:
            raise ModelError(f"{where}: no OpenCL platform: {e}", ErrorCode.UNAVAILABLE) from e
        if not devices:
            raise ModelError(f"{where}: no OpenCL device", ErrorCode.UNAVAILABLE)
        gpus = [d for d in devices if d.type & cl.device_type.GPU]
        device = (gpus or devices)[0]
        _shared = (cl.Context([device]), device)
        log.info("OpenCL for custom ops: %s (%s, %s)", device.name.strip(),
                 device.platform.name.strip(),
                 "gpu" if device.type & cl.device_type.GPU else "not a gpu")
        return _shared


class OpenCl:
    """One op's queue on the shared context."""

    def __init__(self, cl: Any, context: Any, device: Any) -> None:
        self._cl = cl
        self.context = context
        self.device = device
        self.queue = cl.CommandQueue(context, device)
        self.device_name = device.name.strip()

    @classmethod
    def create(cls, where: str) -> OpenCl:
        context, device = shared_context(where)
        import pyopencl as cl

        return cls(cl, context, device)

    def handles(self) -> tuple[int, int, int]:
        return self.context.int_ptr, self.device.int_ptr, self.queue.int_ptr

    def run(self, op: NativeBound, ins: Any, outs: Any, arrays: list[NDArray[Any]],
            results: list[NDArray[Any]]) -> None:
        """Inputs to device buffers, the op's compute, outputs back to ``results``."""
        cl = self._cl
        mf = cl.mem_flags
        buffers = []
        try:
            for t, a in zip(ins, arrays):
                buf = cl.Buffer(self.context, mf.READ_ONLY | mf.COPY_HOST_PTR,
                                hostbuf=a) if a.nbytes else None
                buffers.append(buf)
                t.data, t.nbytes = (buf.int_ptr if buf else None), a.nbytes
            out_bufs = []
            for i, r in enumerate(results):
                buf = cl.Buffer(self.context, mf.WRITE_ONLY, size=max(1, r.nbytes))
                out_bufs.append(buf)
                buffers.append(buf)
                outs[i].data, outs[i].nbytes = buf.int_ptr, r.nbytes
            op.call(ins, len(arrays), outs, 0, 1)
            for r, buf in zip(results, out_bufs):
                if r.nbytes:
                    cl.enqueue_copy(self.queue, r, buf, is_blocking=False)
            self.queue.finish()
        except cl.Error as e:
            raise ModelError(f"{op.where}: OpenCL: {e}", ErrorCode.INTERNAL) from e
        finally:
            for buf in buffers:
                if buf is not None:
                    buf.release()

    def close(self) -> None:
        self.queue.finish()
