"""inferd backend plugin: onnxruntime (CPU), from the Debian add-on package
inferd-backend-onnxruntime.

Debian 12 has no onnxruntime package, so the add-on carries the upstream wheel's
``onnxruntime`` module in ``vendor/`` beside this file. The daemon's plugin loader
imports this package from /usr/lib/inferd/backends and calls :func:`create_backend`;
only then does the vendored copy become importable, so the daemon itself runs without
onnxruntime installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "vendor"


def create_backend():  # -> inferd.libbackends.contract.Backend
    """The built-in onnxruntime CPU backend, running on the vendored onnxruntime."""
    if str(VENDOR) not in sys.path:
        sys.path.insert(0, str(VENDOR))
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend

    return OnnxRuntimeCpuBackend()
