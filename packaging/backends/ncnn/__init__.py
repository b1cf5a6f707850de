"""inferd backend plugin: ncnn (CPU, and GPUs through Vulkan: Arm Mali, Qualcomm Adreno,
Broadcom V3D), from the Debian add-on package inferd-backend-ncnn.

Debian 12 has no ncnn package, so the add-on carries the upstream wheel's ``ncnn``
module in ``vendor/`` beside this file (in a source tree there is none: the ``ncnn`` of
the environment serves). The daemon's plugin loader imports this package from
/usr/lib/inferd/backends and calls :func:`create_backend`; only then does the vendored
copy become importable. Vulkan itself is the system's: libvulkan1 and the device's
driver (Mesa's panvk, turnip, v3dv or lavapipe, or the board vendor's).
"""

from __future__ import annotations

import sys
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "vendor"


def create_backend():  # -> inferd.libbackends.contract.Backend
    """The ncnn backend, running on the vendored ncnn where there is one."""
    if VENDOR.is_dir() and str(VENDOR) not in sys.path:
        sys.path.insert(0, str(VENDOR))
    from inferd.libbackends.ncnn_backend import NcnnBackend

    return NcnnBackend()
