"""The backend host: a process that serves one backend's contract over a ZeroMQ socket.

An out-of-process backend (docs/backends.md, "Out-of-process backends") runs in its own
interpreter, usually a separate virtual environment whose dependencies would fight the
daemon's (rknn-toolkit2 pins numpy 1.26 and imports torch). The daemon starts this
module there (:mod:`inferd.libbackends.hosted` is the other end), and it answers
``probe``, ``supports``, ``load``, ``run``, ``unload`` and ``exit`` requests by calling
the backend object that ``MODULE:FACTORY`` creates.

Framing is protocol v1's (:mod:`inferd.ipc.protocol`): a request is ``[HOST_TAG,
header JSON, one raw frame per tensor]``; a reply is exactly a v1 reply
(:func:`~inferd.ipc.protocol.encode_reply`: ``status``, ``result`` or coded ``error``,
output tensors as frames).

This module must stay light: the host interpreter has pyzmq, numpy and inferd's own
``ipc`` and ``libbackends`` folders, and nothing else of the daemon's is assumed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import zmq

from inferd.ipc.errors import ErrorCode, InferdError, ProtocolError, failure
from inferd.ipc.protocol import Frame, Reply, decode_tensors, encode_reply, encode_tensors

HOST_TAG = b"INFERD-HOST/1"
"""First frame of every request to a host; replies carry protocol v1's tag."""

OPS = ("probe", "supports", "load", "run", "unload", "exit")

# The bootstrap the daemon runs with ``python -I -c``: it makes ``inferd.ipc`` and
# ``inferd.libbackends`` importable from the daemon's own folders (whatever the layout:
# an installed package or a source tree; their __init__ files are not run, so only the
# modules the host imports are), puts vendored directories on sys.path, then
# calls ENTRY (``module:function``, usually this module's main) with the remaining
# arguments. argv: [-c, JSON {"packages": {name: dir}, "sys_path": [dir]}, ENTRY, *args].
BOOTSTRAP = """\
import importlib, json, sys, types
if sys.version_info < (3, 11):
    sys.exit("inferd backend host needs Python >= 3.11; %s is %s"
             % (sys.executable, sys.version.split()[0]))
cfg = json.loads(sys.argv[1])
sys.path[:0] = cfg["sys_path"]
root = types.ModuleType("inferd")
root.__path__ = []
sys.modules["inferd"] = root
for name, folder in cfg["packages"].items():
    module = types.ModuleType(name)
    module.__path__ = [folder]
    module.__package__ = name
    sys.modules[name] = module
    setattr(root, name.split(".")[-1], module)
module, _, function = sys.argv[2].partition(":")
sys.exit(getattr(importlib.import_module(module), function)(*sys.argv[3:]))
"""
HOST_MAIN = "inferd.libbackends.host:main"


def encode_call(op: str, params: dict[str, Any] | None = None,
                tensors: dict[str, Any] | None = None) -> list[Frame]:
    """Frames of one request to a host."""
    header: dict[str, Any] = {"op": op, **(params or {})}
    frames: list[Frame] = []
    if tensors:
        header["inputs"], frames = encode_tensors(tensors)
    return [HOST_TAG, json.dumps(header, default=str).encode(), *frames]


def decode_call(frames: list[Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(op, header, input tensors) of one request; raises ProtocolError."""
    if len(frames) < 2 or bytes(frames[0]) != HOST_TAG:
        raise ProtocolError(f"a host request starts with {HOST_TAG!r} and a header")
    header = json.loads(bytes(frames[1]).decode())
    op = header.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown host op {op!r}; expected one of {', '.join(OPS)}",
                            ErrorCode.UNSUPPORTED)
    inputs = decode_tensors(header.get("inputs", []), frames[2:], "host request inputs")
    return op, header, inputs


def _create(target: str) -> Any:
    """Call ``module:factory`` (a module name, or a .py file or package folder path)."""
    where, _, factory = target.rpartition(":")
    if not where or not factory:
        raise ValueError(f"host target {target!r} is not MODULE:FACTORY")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        init = path / "__init__.py" if path.is_dir() else path
        spec = importlib.util.spec_from_file_location(
            "inferd_hosted_backend", init,
            submodule_search_locations=[str(path)] if path.is_dir() else None)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, factory)()


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the daemon goes (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent-pid check in the loop still ends the host


class Host:
    """One backend object and the models it loaded, answering requests in order."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.models: dict[int, Any] = {}
        self._next = 1

    def handle(self, op: str, header: dict[str, Any],
               inputs: dict[str, Any]) -> Reply:
        if op == "probe":
            probe = self.backend.probe()
            return Reply("", result={"available": bool(probe.available),
                                     "reason": str(probe.reason),
                                     "devices": [str(d) for d in probe.devices]})
        if op == "supports":
            ok, why = self.backend.supports(Path(header["path"]))
            return Reply("", result=[bool(ok), str(why)])
        if op == "load":
            from inferd.libbackends.contract import DeviceKind, LoadOptions

            fields = {f.name for f in dataclasses.fields(LoadOptions)}
            given = {k: v for k, v in header.get("options", {}).items() if k in fields}
            if isinstance(given.get("kind"), str):  # a DeviceKind, sent as its value
                given["kind"] = DeviceKind(given["kind"])
            options = LoadOptions(**given)
            model = self.backend.load(Path(header["path"]), options)
            handle, self._next = self._next, self._next + 1
            self.models[handle] = model
            return Reply("", result={"handle": handle,
                                     "inputs": [s.to_json() for s in model.inputs],
                                     "outputs": [s.to_json() for s in model.outputs],
                                     "device": str(getattr(model, "device", "") or ""),
                                     "memory_bytes": model.memory_bytes()})
        model = self.models.get(header.get("handle", -1))
        if model is None:
            raise InferdError(f"host has no model with handle {header.get('handle')!r}")
        if op == "run":
            outputs = model.run(inputs, header.get("outputs"))
            return Reply("", outputs=outputs)
        if op == "unload":
            self.models.pop(header["handle"]).unload()
            return Reply("", result=True)
        raise ProtocolError(f"op {op!r} not handled", ErrorCode.UNSUPPORTED)


def _error(e: BaseException) -> Reply:
    return Reply("", error=failure(e, "backend host", named=False))


def main(endpoint: str, target: str) -> int:
    """Serve ``target``'s backend on ``endpoint`` (the daemon binds it) until ``exit``."""
    _die_with_parent()
    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    hello: dict[str, Any] = {"pid": os.getpid(), "python": sys.version.split()[0],
                             "executable": sys.executable}
    host: Host | None = None
    try:
        backend = _create(target)
        hello.update(id=str(getattr(backend, "id", "")),
                     version=str(getattr(backend, "version", "")))
        host = Host(backend)
    except BaseException as e:  # noqa: BLE001  reported to the daemon, then exit
        hello["error"] = f"{target} raised {type(e).__name__}: {e}"
        traceback.print_exc()
    sock.send(json.dumps(hello).encode())
    if host is None:
        sock.close()
        ctx.term()
        return 1
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(1000):
            if os.getppid() != parent:  # the daemon went away without a word
                return 0
            continue
        frames = sock.recv_multipart(copy=False)
        op = "?"
        try:
            op, header, inputs = decode_call(frames)
            reply = host.handle(op, header, inputs) if op != "exit" else Reply("", result=True)
        except Exception as e:  # noqa: BLE001  every request gets a coded reply
            reply = _error(e)
        sock.send_multipart(encode_reply(reply), copy=False)
        if op == "exit":
            for model in list(host.models.values()):
                try:
                    model.unload()
                except Exception:  # noqa: BLE001  exiting anyway; say so on stderr
                    traceback.print_exc()
            sock.close()
            ctx.term()
            return 0
