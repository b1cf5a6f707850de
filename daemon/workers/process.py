"""A worker process: where engines load and run, so that an engine or a custom op that
aborts, segfaults or exits costs the requests it was running, not the daemon.

Forked by the zygote (:mod:`inferd.daemon.workers.zygote`) with the daemon's registered
backends and custom ops already in memory. It serves its first channel and every channel
the daemon adds over it (``channel``), one thread each, so that calls from the daemon's
threads run side by side as they did in-process. Operations:

- ``load``: ``load_planned`` (the model's own custom ops, a partitioned plan) on the
  backend named; answers a handle, the model's tensors, ``describe()``, its batch sizes
  and what the load added to this process's resident memory.
- ``run``: the inputs are read in place from the daemon's arena; the outputs go back
  through this end's arena.
- ``engine``: import the backend's engine (a worker started again after a death, so
  that the next request pays only its model's load).
- ``peak``: a run's peak of activations for the input shapes a client chose (onnx's
  shape inference, native code, runs here, not in the daemon).
- ``unload``, ``trim`` (``malloc_trim`` before a measured run), ``stats`` (this process's
  resident memory).

Errors are answered as ``(type, code, message)`` and raised again in the daemon as the
same kind of :class:`InferdError`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

from inferd.daemon.workers.channel import Channel, Gone
from inferd.ipc.errors import BackendError, ErrorCode, InferdError, ModelError
from inferd.ipc.libc import malloc_trim
from inferd.libbackends.contract import LoadedModel
from inferd.libbackends.registry import Registry
from inferd.libbackends.trust import StrictModes, UntrustedCode

log = logging.getLogger(__name__)

OOM_SCORE_ADJ = 500
"""Workers are the kernel OOM killer's first choice, never the daemon."""

ERRORS: dict[str, type[InferdError]] = {
    "ModelError": ModelError, "BackendError": BackendError, "InferdError": InferdError,
    "UntrustedCode": UntrustedCode,
}


def encode_error(e: BaseException) -> dict[str, Any]:
    if isinstance(e, InferdError):
        kind = type(e).__name__ if type(e).__name__ in ERRORS else "InferdError"
        return {"error": [kind, str(e.code), e.message]}
    return {"error": ["InferdError", str(ErrorCode.INTERNAL),
                      f"{type(e).__name__}: {e}"], "traceback": traceback.format_exc()}


def decode_error(error: list[str]) -> InferdError:
    kind, code, message = error
    return ERRORS.get(kind, InferdError)(message, ErrorCode(code))


class WorkerProcess:
    """The worker's state: its loaded models by handle."""

    def __init__(self, name: str, registry: Registry, customops: Any) -> None:
        self.name = name
        self.registry = registry
        self.customops = customops
        self.models: dict[int, LoadedModel] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._proc = psutil.Process()
        self._load_lock = threading.Lock()  # one load at a time: its RSS delta is its own
        self._graphs: dict[int, Any] = {}  # handle -> Activations, made at first use

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def serve(self, channel: Channel) -> None:
        """Answer ``channel``'s calls until the daemon closes it (closed here whatever
        happens: a caller waiting on it is never left hanging)."""
        try:
            self._serve(channel)
        finally:
            channel.close()

    def _serve(self, channel: Channel) -> None:
        while True:
            try:
                header, tensors, fds = channel.receive()
            except Gone:
                return
            except Exception as e:  # noqa: BLE001  a message it cannot read: its answer
                channel.send(encode_error(e))
                continue
            op = header.get("op")
            try:
                if op == "channel":
                    for fd in fds:
                        sock = socket.socket(fileno=fd)
                        threading.Thread(target=self.serve, args=(Channel(sock),),
                                         name="inferd-worker-channel", daemon=True).start()
                    channel.send({"ok": True})
                elif op == "run":
                    model = self.models[header["handle"]]
                    t0 = time.perf_counter()
                    outputs = model.run(tensors, header.get("outputs"))
                    took = time.perf_counter() - t0
                    del tensors
                    channel.send({"ok": True, "took": took}, outputs)
                elif op == "load":
                    channel.send(self._load(header))
                elif op == "unload":
                    model = self.models.pop(header["handle"], None)
                    self._graphs.pop(header["handle"], None)
                    if model is not None:
                        model.unload()
                    malloc_trim()
                    channel.send({"ok": True, "left": len(self.models)})
                elif op == "engine":  # a worker started again: its engine before a load
                    record = self.registry.records.get(header["backend"])
                    bring_in = getattr(record.backend, "import_engine", None) if record else None
                    if callable(bring_in):
                        bring_in()
                    channel.send({"ok": True})
                elif op == "peak":  # onnx's shape inference on a client's shapes: here
                    peak = self._graph(header).peak(header["shapes"], tensors)
                    channel.send({"ok": True, "peak": (peak.bytes, peak.unsized,
                                                       peak.tensors)})
                elif op == "trim":
                    malloc_trim()
                    channel.send({"ok": True})
                elif op == "stats":
                    channel.send({"ok": True, "rss": self.rss(), "pid": os.getpid()})
                else:
                    channel.send({"error": ["InferdError", str(ErrorCode.INTERNAL),
                                            f"unknown worker operation {op!r}"]})
            except Gone:
                return
            except Exception as e:  # noqa: BLE001  every failure is the call's answer
                tensors = {}
                channel.send(encode_error(e))

    def _graph(self, h: dict[str, Any]) -> Any:
        from inferd.daemon.activations import Activations

        graph = self._graphs.get(h["handle"])
        if graph is None:
            graph = self._graphs[h["handle"]] = Activations(Path(h["path"]))
        return graph

    def _load(self, h: dict[str, Any]) -> dict[str, Any]:
        from inferd.libbackends.customops.plan import load_planned

        record = self.registry.records.get(h["backend"])
        if record is None:
            raise BackendError(f"backend {h['backend']} is not registered in worker "
                               f"{self.name}")
        fallbacks = [b for b in self.registry.available() if b.id in h["fallbacks"]]
        with self._load_lock:
            malloc_trim()
            before = self.rss()
            engine = 0
            bring_in = getattr(record.backend, "import_engine", None)
            if callable(bring_in):
                bring_in()
                malloc_trim()
                engine = max(0, self.rss() - before)
                before += engine
            model = load_planned(record.backend, Path(h["path"]), h["options"],
                                 model=h["model"], model_dir=Path(h["model_dir"]),
                                 ops=self.customops, fallbacks=fallbacks,
                                 tables=h["tables"], probe_timeout_s=h["probe_timeout_s"],
                                 strict=StrictModes(h.get("strict_modes", True)))
            malloc_trim()
            added = max(0, self.rss() - before)
        with self._lock:
            handle = self._next
            self._next += 1
            self.models[handle] = model
        return {"ok": True, "handle": handle, "inputs": model.inputs,
                "outputs": model.outputs, "device": getattr(model, "device", ""),
                "describe": model.describe(), "batch_sizes": model.batch_sizes(),
                "reported": model.memory_bytes(), "added": added, "engine": engine,
                "pid": os.getpid()}


def worker_main(sock: socket.socket, name: str, registry: Registry, customops: Any) -> int:
    """A worker's life: serve its first channel (the daemon's control channel) until the
    daemon closes it."""
    try:
        with open(f"/proc/{os.getpid()}/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
    except OSError:
        pass
    try:
        os.setpgid(0, 0)  # not in the daemon's group: a terminal's ^C is the daemon's
    except OSError:
        pass
    WorkerProcess(name, registry, customops).serve(Channel(sock))
    return 0
