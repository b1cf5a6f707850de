"""Dependencies point one way, checked on a fresh interpreter's ``sys.modules``.

The floors, from the ground up (docs/architecture.md, "Layers"):

- ``inferd.ipc``: the wire and its vocabulary (error codes and errors, tensor dtypes,
  install paths, framing), the server loop and the clients. It imports nothing of the
  backends or the daemon, so an application's ``from inferd.ipc import Client`` brings
  in no engine.
- ``inferd.libbackends``: the backend contract, the plugin loader, the built-in
  backends. It builds on the wire's vocabulary only (errors, dtypes, paths, the C
  allocator's knobs); the out-of-process backends (``host``, ``hosted``) also reuse the
  framing on their pipe. It imports nothing of the daemon.
- ``inferd.daemon``: the process. It reaches the server loop only through the runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules(folder: str, package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out.append(".".join([package, *parts]))
    return out


IPC = _modules("ipc", "inferd.ipc")
LIBBACKENDS = [m for m in _modules("libbackends", "inferd.libbackends")
               if not m.endswith("__main__")]
# The vocabulary every floor above the wire may use, and the C allocator's knobs.
VOCABULARY = {"inferd.ipc", "inferd.ipc.errors", "inferd.ipc.dtypes", "inferd.ipc.defs",
              "inferd.ipc.libc"}
# The out-of-process backends also speak protocol v1 on their pipe to the host process.
FRAMING = {"inferd.ipc.protocol", "inferd.ipc.header", "inferd.ipc.transport"}
HOSTED = {"inferd.libbackends.host", "inferd.libbackends.hosted"}


def _imported_after(module: str) -> set[str]:
    code = (f"import sys, json, {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith('inferd'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return set(json.loads(out))


def test_the_module_lists_are_not_empty() -> None:
    assert "inferd.ipc.protocol" in IPC and "inferd.libbackends.contract" in LIBBACKENDS


@pytest.mark.parametrize("module", IPC)
def test_the_wire_imports_nothing_of_the_backends_or_the_daemon(module: str) -> None:
    above = {m for m in _imported_after(module)
             if m.startswith(("inferd.libbackends", "inferd.daemon"))}
    assert not above, above


@pytest.mark.parametrize("module", LIBBACKENDS)
def test_the_backends_use_only_the_wire_vocabulary(module: str) -> None:
    loaded = _imported_after(module)
    assert not {m for m in loaded if m.startswith("inferd.daemon")}
    # the framing comes only with the hosted backends (the loader imports them)
    allowed = VOCABULARY | (FRAMING if module in HOSTED or loaded & HOSTED else set())
    wire = {m for m in loaded if m.startswith("inferd.ipc")}
    assert wire <= allowed, wire - allowed


def test_the_client_brings_in_no_engine() -> None:
    loaded = _imported_after("inferd.ipc.client")
    assert not {m for m in loaded if m.startswith(("inferd.libbackends", "inferd.daemon"))}
    code = ("import sys, inferd.ipc.client; "
            "print(sorted(m for m in ('onnxruntime', 'openvino', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("module", ["inferd.daemon.models", "inferd.daemon.worker",
                                    "inferd.daemon.graphs", "inferd.daemon.reload"])
def test_the_daemon_reaches_the_server_loop_only_through_the_runtime(module: str) -> None:
    assert "inferd.ipc.server" not in _imported_after(module)
