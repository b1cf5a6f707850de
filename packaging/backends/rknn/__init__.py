"""inferd backend plugin: the Rockchip NPU (id ``rknn``), from the Debian add-on package
inferd-backend-rknn, run out of process.

The daemon's plugin loader imports this package from /usr/lib/inferd/backends and calls
:func:`create_backend`, which returns a proxy (:class:`~inferd.libbackends.hosted.
HostedBackend`): the real backend (:mod:`inferd.libbackends.rknn`) runs in a backend
host process, so the NPU runtime's libraries never load into the daemon and a crash or
hang there fails one model, not the daemon.

The host's interpreter: ``$INFERD_RKNN_PYTHON`` if set (a virtual environment with
rknn-toolkit-lite2, or on a development machine the simulator's ``.venv-rknn/bin/
python``), else ``/usr/bin/python3``. The package vendors nothing (Rockchip's licence
restricts redistribution): RKNNLite and the vendor's ``/usr/lib/librknnrt.so`` come
with the board's image or ``pip install rknn-toolkit-lite2``; see README.Debian.
"""

from __future__ import annotations

import os

ENV_PYTHON = "INFERD_RKNN_PYTHON"
SYSTEM_PYTHON = "/usr/bin/python3"


def create_backend():  # -> inferd.libbackends.contract.Backend
    """A proxy for the rknn backend, hosted in its own interpreter."""
    from inferd.libbackends.contract import DeviceKind
    from inferd.libbackends.hosted import HostedBackend, HostSpec

    python = os.environ.get(ENV_PYTHON) or SYSTEM_PYTHON
    # tqdm progress bars (the converter's) would flood the daemon's debug log.
    spec = HostSpec(python=python, target="inferd.libbackends.rknn:create_backend",
                    env={"TQDM_DISABLE": "1"})
    return HostedBackend("rknn", DeviceKind.NPU, "unprobed", spec)
