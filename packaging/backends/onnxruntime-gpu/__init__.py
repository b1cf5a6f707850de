"""inferd backend plugin: onnxruntime on NVIDIA GPUs (CUDA, TensorRT), from the Debian
add-on package inferd-backend-onnxruntime-gpu.

The onnxruntime and onnxruntime-gpu builds share the import name ``onnxruntime``: one
process can hold only one of them. So this package replaces inferd-backend-onnxruntime:
it ships the GPU build in /usr/lib/inferd/backends/onnxruntime/vendor, where the CPU
plugin beside it (backend ``onnxruntime``, the GPU build's CPU provider) finds it too,
and this plugin (backend ``onnxruntime-gpu``) puts the same directory on ``sys.path``.
The CUDA 13 and cuDNN 9 libraries (TensorRT 10 for the TensorRT provider) come from
NVIDIA; where they are missing the backend is unavailable with the missing library as
its reason (``inferctl backends``).
"""

from __future__ import annotations

import sys
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "onnxruntime" / "vendor"


def create_backend():  # -> inferd.libbackends.contract.Backend
    """The onnxruntime GPU backend, running on the vendored onnxruntime-gpu."""
    if str(VENDOR) not in sys.path:
        sys.path.insert(0, str(VENDOR))
    from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend

    return OnnxRuntimeGpuBackend()
