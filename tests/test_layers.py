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

Each module is imported in a child forked from one interpreter that has imported only
the third-party libraries the floors share (numpy, zmq) and nothing of inferd, of an
engine or of ml_dtypes: its ``sys.modules`` after the import holds the same inferd
modules as a fresh interpreter's would, without paying an interpreter start per module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
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


ENGINES = ("onnxruntime", "openvino", "onnx")
# Imported with the first tensor of its types (bfloat16, float8, int4), not before: it
# cost ~1 s of every daemon start, inferctl call and client process (9337634).
LAZY = ("ml_dtypes",)
# Native code the built-in processors call: imported by the processors worker (or by the
# daemon with isolation = "in-process") at the first step that needs it, never by an
# import of daemon/.
PROCESSOR_LIBS = ("cv2", "pyclipper")
WATCHED = (*ENGINES, *LAZY, *PROCESSOR_LIBS)

# Reads a module name a line, imports it in a forked child, prints the inferd and engine
# modules the child then holds (JSON, one line), or the child's error.
_FORKER = r"""
import importlib, json, os, sys
import numpy, zmq  # noqa: F401  shared by every floor; not what is checked
assert not [m for m in sys.modules if m.startswith("inferd") or m in %r]
for line in sys.stdin:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(line.strip())
            out = {"modules": sorted(m for m in sys.modules
                                     if m.startswith("inferd") or m in %r)}
        except BaseException as e:
            out = {"error": repr(e)}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    print(got or json.dumps({"error": f"the child died: wait status {status}"}), flush=True)
""" % (WATCHED, WATCHED)


@pytest.fixture(scope="module")
def forker() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _FORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    yield proc
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(60)


def _loaded(forker: subprocess.Popen[str], module: str) -> set[str]:
    """The inferd and engine modules an import of ``module`` brings in."""
    assert forker.poll() is None, "the forking interpreter exited"
    forker.stdin.write(module + "\n")  # type: ignore[union-attr]
    forker.stdin.flush()  # type: ignore[union-attr]
    out = json.loads(forker.stdout.readline())  # type: ignore[union-attr]
    assert "error" not in out, f"import {module}: {out['error']}"
    return set(out["modules"])


def _imported_after(forker: subprocess.Popen[str], module: str) -> set[str]:
    return {m for m in _loaded(forker, module) if m.startswith("inferd")}


def test_the_module_lists_are_not_empty() -> None:
    assert "inferd.ipc.protocol" in IPC and "inferd.libbackends.contract" in LIBBACKENDS


@pytest.mark.parametrize("module", IPC)
def test_the_wire_imports_nothing_of_the_backends_or_the_daemon(forker, module: str) -> None:
    above = {m for m in _imported_after(forker, module)
             if m.startswith(("inferd.libbackends", "inferd.daemon"))}
    assert not above, above


@pytest.mark.parametrize("module", LIBBACKENDS)
def test_the_backends_use_only_the_wire_vocabulary(forker, module: str) -> None:
    loaded = _imported_after(forker, module)
    assert not {m for m in loaded if m.startswith("inferd.daemon")}
    # the framing comes only with the hosted backends (the loader imports them)
    allowed = VOCABULARY | (FRAMING if module in HOSTED or loaded & HOSTED else set())
    wire = {m for m in loaded if m.startswith("inferd.ipc")}
    assert wire <= allowed, wire - allowed


def test_the_client_brings_in_no_engine(forker) -> None:
    loaded = _loaded(forker, "inferd.ipc.client")
    assert not {m for m in loaded if m.startswith(("inferd.libbackends", "inferd.daemon"))}
    assert not loaded & set(WATCHED), loaded & set(WATCHED)


@pytest.mark.parametrize("module", ["inferd.ipc", "inferd.ipc.inferctl", "inferd.daemon.main"])
def test_ml_dtypes_waits_for_a_tensor_of_its_types(forker, module: str) -> None:
    assert not _loaded(forker, module) & set(LAZY)


@pytest.mark.parametrize("module", ["inferd.daemon.models", "inferd.daemon.model_threads",
                                    "inferd.daemon.graphs", "inferd.daemon.reload"])
def test_the_daemon_reaches_the_server_loop_only_through_the_runtime(forker,
                                                                     module: str) -> None:
    assert "inferd.ipc.server" not in _imported_after(forker, module)


WORKERS = _modules("daemon/workers", "inferd.daemon.workers")


@pytest.mark.parametrize("module", WORKERS)
def test_the_worker_floor_sits_under_the_cache(forker, module: str) -> None:
    """daemon/workers/ (the zygote, the worker's side, the channel, the pool, the
    quarantine and the processor steps) imports nothing else of the daemon but the
    activations and the processors' contract (leaves, which the workers run): the cache
    builds on it, never the other way; and importing it brings in no engine (a worker
    imports its engine at its first load), nor a processor's native library (OpenCV,
    pyclipper: the processors worker imports them at its first step that needs them)."""
    loaded = _loaded(forker, module)
    daemon = {m for m in loaded if m.startswith("inferd.daemon")
              and not m.startswith("inferd.daemon.workers")
              and m not in ("inferd.daemon", "inferd.daemon.activations",  # leaves
                            "inferd.daemon.processors")}
    assert not daemon, daemon
    assert not loaded & set(ENGINES), loaded & set(ENGINES)
    assert not loaded & set(PROCESSOR_LIBS), loaded & set(PROCESSOR_LIBS)


# The floors of daemon/, from the ground up (docs/architecture.md, "Floors of the
# daemon"): a module imports only from its own floor and those below it. Every module of
# daemon/ is on one floor, so a new one must be placed.
DAEMON_FLOORS: list[tuple[str, set[str]]] = [
    ("the vocabulary: settings, files, queues, processors, logs and signals", {
        "units", "logs", "systemd", "config", "model_settings", "repository", "graph",
        "decisions", "metrics", "metrics_http", "stages", "fairqueue", "batching", "merging",
        "activations", "streams", "pipeline", "processors", "processors.builtin",
        "processors.ocr"}),
    ("the worker processes", {m.removeprefix("inferd.daemon.") for m in WORKERS}),
    ("a loaded model: its threads, memory and placement", {
        "memory", "placement", "placed_model", "measure", "warmup", "model_threads"}),
    ("the cache: its entries, budget, loader, placer and the manager that owns them", {
        "model_entry", "budget", "catalog", "placer", "loading", "reload", "models"}),
    ("the graphs", {"executors", "graphs"}),
    ("the process: the runtime that wires the floors, its ops, watch and entry point", {
        "inline", "watch", "runtime", "main"}),
]
DAEMON = [m for m in _modules("daemon", "inferd.daemon") if m != "inferd.daemon"]


def _floor(module: str) -> int:
    short = module.removeprefix("inferd.daemon.")
    return next(i for i, (_, names) in enumerate(DAEMON_FLOORS) if short in names)


def test_every_daemon_module_is_on_one_floor() -> None:
    placed = [m for _, names in DAEMON_FLOORS for m in names]
    assert len(placed) == len(set(placed)), "a module on two floors"
    assert sorted(f"inferd.daemon.{m}" for m in placed) == sorted(DAEMON)


@pytest.mark.parametrize("module", DAEMON)
def test_the_daemon_imports_one_way(forker, module: str) -> None:
    """What importing a module of daemon/ brings in of the daemon sits on its floor or
    below: the cache builds on the loaded model and the workers, never the other way (a
    module put on a floor below one it imports fails here, as model_threads on the
    first floor does: it imports the workers)."""
    floor = _floor(module)
    loaded = _loaded(forker, module)
    above = {m for m in loaded if m.startswith("inferd.daemon.") and _floor(m) > floor}
    assert not above, f"{module} ({DAEMON_FLOORS[floor][0]}) imports {sorted(above)}"
    # and no processor's native library (in the daemon: only with isolation =
    # "in-process", at the first step that needs it)
    assert not loaded & set(PROCESSOR_LIBS), loaded & set(PROCESSOR_LIBS)
