"""inferd backend plugin: OpenVINO (CPU, Intel GPU, Intel NPU), from the Debian add-on
package inferd-backend-openvino.

Debian 12 has no OpenVINO package, so the add-on carries the upstream wheel's
``openvino`` module (its runtime, the ONNX and IR readers, the CPU, GPU and NPU plugins)
in ``vendor/`` beside this file. The daemon's plugin loader imports this package from
/usr/lib/inferd/backends and calls :func:`create_backend`; only then does the vendored
copy become importable.
"""

from __future__ import annotations

import sys
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "vendor"


def create_backend():  # -> inferd.libbackends.contract.Backend
    """The OpenVINO backend, running on the vendored openvino."""
    if str(VENDOR) not in sys.path:
        sys.path.insert(0, str(VENDOR))
    from inferd.libbackends.openvino_backend import OpenVinoBackend

    return OpenVinoBackend()
