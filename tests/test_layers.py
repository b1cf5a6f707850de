"""Dependencies point one way (issue 14 item 4): the backends depend on nothing above
them, and the daemon does not reach into the server loop. Checked on a fresh
interpreter's ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIBBACKENDS = ["inferd.libbackends.contract", "inferd.libbackends.dtypes",
               "inferd.libbackends.registry", "inferd.libbackends.native",
               "inferd.libbackends.childprobe", "inferd.libbackends.discovery",
               "inferd.libbackends.loader", "inferd.libbackends.onnxruntime_cpu",
               "inferd.libbackends.customops.plan", "inferd.libbackends.customops.native",
               "inferd.libbackends.customops.native_run", "inferd.libbackends.customops.opencl"]
# What the backends may use above them: the shared error types, and the install paths
# (a leaf module that imports nothing).
SHARED = {"inferd.ipc", "inferd.ipc.errors", "inferd.ipc.defs"}


def _imported_after(module: str) -> set[str]:
    code = (f"import sys, json, {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith('inferd'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return set(json.loads(out))


def test_backend_contract_imports_only_the_error_types_from_above() -> None:
    loaded = _imported_after("inferd.libbackends.contract")
    assert not {m for m in loaded if m.startswith("inferd.daemon")}
    assert {m for m in loaded if m.startswith("inferd.ipc")} <= {"inferd.ipc",
                                                                 "inferd.ipc.errors"}


@pytest.mark.parametrize("module", LIBBACKENDS)
def test_libbackends_import_nothing_from_the_daemon_or_the_wire(module: str) -> None:
    loaded = _imported_after(module)
    above = {m for m in loaded if m.startswith(("inferd.daemon", "inferd.ipc"))}
    assert above <= SHARED, above - SHARED


@pytest.mark.parametrize("module", ["inferd.daemon.models", "inferd.daemon.worker",
                                    "inferd.daemon.graphs", "inferd.daemon.reload"])
def test_the_daemon_reaches_the_server_loop_only_through_the_runtime(module: str) -> None:
    assert "inferd.ipc.server" not in _imported_after(module)
