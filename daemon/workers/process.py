"""A worker process: where engines load and run, so that an engine or a custom op that
aborts, segfaults or exits costs the requests it was running, not the daemon.

Forked by the zygote (:mod:`inferd.daemon.workers.zygote`) with the daemon's registered
backends and custom ops already in memory. It serves its first channel and every channel
the daemon adds over it (``channel``), one thread each, so that calls from the daemon's
threads run side by side as they did in-process. Operations:

- ``load``: ``load_planned`` (the model's own custom ops, a partitioned plan) on the
  backend named; answers a handle, the model's tensors, ``describe()``, its batch sizes
  and what the load added to this process's resident memory. A model with
  ``cpu_affinity`` (``cores``) loads on a thread kept to those cores, so that the engine
  threads it starts inherit them, and every thread that runs it keeps to them (set again
  only when a thread goes from one model's cores to another's).
- ``threads``: the threads whose last run was a model's, with the cores the kernel
  allows each (``inferctl models --verbose``).
- ``run``: the inputs are read in place from the daemon's arena, or from a client's
  shared-memory region the daemon named (``refs``; its descriptor passed with the call
  the first time, ``maps``: mapped read-only unless outputs go there, kept until
  ``forget``); the outputs go back through this end's arena, or are written into the
  client's region where the daemon says (``into``: the slot, placed by
  :meth:`inferd.ipc.protocol.Slot.place`'s rule). Either way the engine writes the big
  ones there itself once a run of the same shapes has shown what they are
  (:class:`OutputsInArena`): nothing copies them.
- ``forget``: unmap regions their clients released.
- ``engine``: import the backend's engine (a worker started again after a death, so
  that the next request pays only its model's load).
- ``peak``: a run's peak of activations for the input shapes a client chose (onnx's
  shape inference, native code, runs here, not in the daemon).
- ``unload``, ``trim`` (``malloc_trim`` before a measured run), ``stats`` (this process's
  resident memory).
- ``build``, ``step``, ``release``, ``directory``: processor steps, in the processors
  worker (:mod:`inferd.daemon.workers.steps`).

Errors are answered as ``(type, code, message)`` and raised again in the daemon as the
same kind of :class:`InferdError`.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from inferd.daemon.workers.channel import INLINE_BYTES, Channel, Gone, dtype_code, dtype_of
from inferd.daemon.workers.steps import STEP_OPS, StepHost
from inferd.ipc.dtypes import PACKED, STRING, dtype_name
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
        # clients' shared-memory regions the daemon handed over: id -> (mapping, writable)
        self._regions: dict[int, tuple[mmap.mmap, bool]] = {}
        self._regions_lock = threading.Lock()
        self._outputs = OutputsInArena()
        # model.toml cpu_affinity: the cores each model's runs (and its load, whose
        # engine threads inherit them) are pinned to; each thread's last model
        self._cores: dict[int, frozenset[int]] = {}
        self._last: dict[int, int] = {}  # native thread id -> handle
        self._everywhere = frozenset(os.sched_getaffinity(0))
        self._pinned = threading.local()
        self.steps = StepHost(name)

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
            unmapped: list[int] = []
            try:
                if "maps" in header:
                    self._map(header["maps"], fds)
                if "refs" in header:
                    tensors = self._referenced(header, tensors, unmapped)
                if op == "run":  # first: the one on every request
                    handle = header["handle"]
                    model = self.models[handle]
                    if getattr(self._pinned, "handle", None) != handle:
                        self._pin_for(handle)
                    wanted = header.get("outputs")
                    t0 = time.perf_counter()
                    outputs = self._outputs.run(
                        handle, model, tensors, wanted,
                        self._slot(header) if "into" in header else _arena(channel))
                    took = time.perf_counter() - t0
                    del tensors
                    reply: dict[str, Any] = {"ok": True, "took": took}
                    if "into" in header:
                        outputs = self._place(header, outputs, reply)
                    channel.send(reply, outputs)
                    del outputs  # may view a region: not kept until the next call
                elif op in STEP_OPS:  # processor steps (the processors worker)
                    self.steps.serve(op, header, tensors, channel)
                elif op == "channel":
                    for fd in fds:
                        sock = socket.socket(fileno=fd)
                        threading.Thread(target=self.serve,
                                         args=(Channel(sock, trusted=True),),
                                         name="inferd-worker-channel", daemon=True).start()
                    channel.send({"ok": True})
                elif op == "forget":
                    self._forget(header["regions"])
                    channel.send({"ok": True})
                elif op == "load":
                    channel.send(self._load(header))
                elif op == "threads":
                    channel.send({"ok": True, "threads": self._threads(header["handle"])})
                elif op == "unload":
                    self._cores.pop(header["handle"], None)
                    for tid in [t for t, h in self._last.items() if h == header["handle"]]:
                        self._last.pop(tid, None)
                    model = self.models.pop(header["handle"], None)
                    self._graphs.pop(header["handle"], None)
                    self._outputs.forget(header["handle"])
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
                    if header.get("trim"):  # what it holds, not what its heap kept
                        malloc_trim()
                    channel.send({"ok": True, "rss": self.rss(),
                                  "pss": _pss(header.get("own", False)),
                                  "pid": os.getpid()})
                else:
                    channel.send({"error": ["InferdError", str(ErrorCode.INTERNAL),
                                            f"unknown worker operation {op!r}"]})
            except Gone:
                return
            except Exception as e:  # noqa: BLE001  every failure is the call's answer
                tensors = {}
                error = encode_error(e)
                if unmapped:
                    error["unmapped"] = unmapped
                channel.send(error)

    # ----------------------------------------------------------------- pinning

    def _pin(self, cores: frozenset[int]) -> None:
        """Keep the calling thread to ``cores`` (a syscall only when they change)."""
        if getattr(self._pinned, "cores", self._everywhere) == cores:
            return
        try:
            os.sched_setaffinity(0, cores)
        except OSError as e:  # a core offline since: the model runs where it can
            log.warning("worker %s: cannot pin a thread to cores %s: %s", self.name,
                        sorted(cores), e.strerror)
        self._pinned.cores = cores

    def _pin_for(self, handle: int) -> None:
        """The calling thread runs ``handle`` from now on: on its model's cores (every
        core of the worker for a model without ``cpu_affinity``); the thread is noted as
        one of the model's."""
        self._pin(self._cores.get(handle, self._everywhere))
        self._pinned.handle = handle
        self._last[threading.get_native_id()] = handle

    def _threads(self, handle: int) -> list[tuple[int, list[int]]]:
        """The threads whose last run was ``handle``'s, each with the cores the kernel
        allows it now."""
        out = []
        for tid, last in sorted(self._last.items()):
            if last != handle:
                continue
            try:
                out.append((tid, sorted(os.sched_getaffinity(tid))))
            except OSError:  # ended (its channel closed)
                self._last.pop(tid, None)
        return out

    # ----------------------------------------------------------------- shared memory

    def _map(self, maps: list[tuple[int, int, bool]], fds: list[int]) -> None:
        """Map the regions passed with this call (``fds``, in the order of ``maps``); the
        passed descriptors are closed (a mapping keeps its own): one descriptor and one
        mapping per region. A region it cannot map is left out (the call names it in
        ``unmapped``)."""
        try:
            for (rid, size, writable), fd in zip(maps, fds):
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                try:
                    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
                except (OSError, ValueError) as e:
                    log.warning("worker %s: cannot map shared-memory region %d: %s",
                                self.name, rid, e)
                    continue
                with self._regions_lock:
                    old = self._regions.get(rid)
                    if old is not None and old[1] and not writable:
                        old, mm = (mm, writable), old[0]  # the writable one stays
                    self._regions[rid] = (mm, writable or bool(old and old[1]))
                if old is not None:
                    _unmap(old[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _referenced(self, header: dict[str, Any], tensors: dict[str, Any],
                    unmapped: list[int]) -> dict[str, Any]:
        """The call's tensors, those in regions read in place, in the daemon's order."""
        refs = header["refs"]
        with self._regions_lock:
            regions = {rid: self._regions.get(rid) for rid, *_ in refs.values()}
        for name, (rid, offset, code, shape, nbytes) in refs.items():
            region = regions[rid]
            if region is None:
                unmapped.append(rid)
                continue
            dtype = dtype_of(code)
            count = nbytes // dtype.itemsize if dtype.itemsize else 0
            tensors[name] = np.frombuffer(region[0], dtype, count, offset).reshape(shape)
        if unmapped:
            raise InferdError(f"shared-memory regions {sorted(set(unmapped))} are not "
                              f"mapped in worker {self.name}", ErrorCode.UNAVAILABLE)
        return {name: tensors[name] for name in header["order"]}

    def _place(self, header: dict[str, Any], outputs: dict[str, Any],
               reply: dict[str, Any]) -> dict[str, Any]:
        """Write the numeric outputs into the client's slot (``into``: region, first free
        offset, end) in the order the reply lists them, each at the next 64-byte boundary
        as :meth:`inferd.ipc.protocol.Slot.place` puts it; those written are named in
        ``reply["placed"]``, the others (strings, packed types, what does not fit: the
        daemon says so) go back through the channel."""
        from inferd.ipc.protocol import SHM_ALIGN

        rid, at, end = header["into"]
        with self._regions_lock:
            region = self._regions.get(rid)
        wanted = header.get("outputs")
        order = [n for n in wanted if n in outputs] if wanted else list(outputs)
        reply["order"] = order
        if region is None or not region[1]:
            return outputs
        mm = region[0]
        base = _address(mm)
        placed: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        full = False
        for name in order:
            a = np.asarray(outputs[name])
            kind = dtype_name(a) if not full else STRING
            if kind == STRING or kind in PACKED or full:
                rest[name] = a
                continue
            start = at + -at % SHM_ALIGN
            if start + a.nbytes > end:
                full = True
                rest[name] = a
                continue
            at = start + a.nbytes
            if not a.nbytes:
                rest[name] = a
                continue
            if a.__array_interface__["data"][0] != base + start:  # else written there
                np.frombuffer(mm, a.dtype, a.size, start).reshape(a.shape)[...] = a
            placed[name] = (start, dtype_code(a), a.shape, a.nbytes)
        for name, a in outputs.items():
            if name not in placed and name not in rest:
                rest[name] = a
        reply["placed"] = placed
        return rest

    def _slot(self, header: dict[str, Any]) -> Reserve:
        """Room for a run's big outputs in the client's slot (``into``), at the offsets
        :meth:`_place` gives them, so that the engine writes them there and
        :meth:`_place` copies only the small ones. An output that would not fit, and
        every one after it, gets no room (``_place`` sends them back through the
        channel)."""
        from inferd.ipc.protocol import SHM_ALIGN

        rid, at, end = header["into"]
        with self._regions_lock:
            region = self._regions.get(rid)
        wanted = header.get("outputs")

        def reserve(layout: list[Out]) -> dict[str, Any]:
            if region is None or not region[1]:
                return {}
            order = [o for n in wanted for o in layout if o[0] == n] if wanted else layout
            views: dict[str, Any] = {}
            cursor = at
            for name, dtype, shape, nbytes in order:
                if dtype is None:  # strings, packed types: back through the channel
                    continue
                start = cursor + -cursor % SHM_ALIGN
                if start + nbytes > end:
                    break
                cursor = start + nbytes
                if nbytes >= INLINE_BYTES:
                    views[name] = np.ndarray(shape, dtype, region[0], start)
            return views
        return reserve

    def _forget(self, rids: list[int]) -> None:
        with self._regions_lock:
            gone = [self._regions.pop(rid, None) for rid in rids]
        for region in gone:
            if region is not None:
                _unmap(region[0])

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
        cores = frozenset(h.get("cores") or ()) or self._everywhere
        with self._load_lock:
            # loaded on the model's cores: the engine's own threads, started now or at
            # its first run, inherit them (as a pinned infer thread's do in-process)
            self._pin(cores)
            self._pinned.handle = None
            malloc_trim()
            before = self.rss()
            engine = 0
            bring_in = getattr(record.backend, "import_engine", None)
            if callable(bring_in):
                bring_in()
                malloc_trim()
                grew = max(0, self.rss() - before)
                before += grew
                # imported now: the engine counts the worker as it stands (its share of
                # the interpreter it was forked with, 20-25 MiB, and the engine), which
                # no model's load counts
                engine = _pss() if grew else 0
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
            if cores != self._everywhere:
                self._cores[handle] = cores
        return {"ok": True, "handle": handle, "inputs": model.inputs,
                "outputs": model.outputs, "device": getattr(model, "device", ""),
                "describe": model.describe(), "batch_sizes": model.batch_sizes(),
                "reported": model.memory_bytes(), "added": added, "engine": engine,
                "pid": os.getpid()}


Out = tuple[str, "np.dtype[Any] | None", tuple[int, ...], int]
"""One output as a run gave it: name, dtype (None: a string or packed type, which no
engine writes into place), shape, bytes."""
Reserve = Callable[[list[Out]], dict[str, Any]]
"""Room for a run's outputs, given the outputs an earlier run of the same signature gave
(in their order): writable arrays by name, for those that get room."""


class OutputsInArena:
    """Runs whose big outputs the engine writes straight where they go
    (:meth:`LoadedModel.run_into <inferd.libbackends.contract.LoadedModel.run_into>`):
    the channel's arena, so that the reply carries them without a copy (issue 30, item
    2), or the client's shared-memory slot when it asked its outputs there
    (``outputs_into``), so that nothing copies them into it.

    The shapes an engine's outputs will have are known only from a run: a model's
    outputs are remembered per input signature (names, dtypes, shapes, outputs asked),
    and the next run with that signature has room reserved for them. A model whose
    outputs come back elsewhere (an engine that does not bind, outputs of another
    shape: onnxruntime refuses the bound run and runs it plainly) is not asked again."""

    MAX_SIGNATURES = 64
    """Signatures remembered per model (past it, forgotten all at once)."""

    def __init__(self) -> None:
        self._layouts: dict[int, dict[Any, list[Out]]] = {}
        self._plain: set[int] = set()  # models that do not write where asked
        self._lock = threading.Lock()

    def run(self, handle: int, model: LoadedModel, tensors: dict[str, Any],
            wanted: list[str] | None, reserve: Reserve) -> dict[str, Any]:
        """``model``'s run on ``tensors``, its big outputs written where ``reserve``
        makes room for them."""
        if handle in self._plain:
            return model.run(tensors, wanted)
        key = (tuple((n, a.dtype.str, a.shape) for n, a in tensors.items()
                     if isinstance(a, np.ndarray)),
               None if wanted is None else tuple(wanted))
        seen = self._layouts.get(handle)  # read without the lock: dict reads are atomic
        layout = seen.get(key) if seen is not None else None
        into = reserve(layout) if layout else {}
        if not into:
            outputs = model.run(tensors, wanted)
            if layout is None:
                with self._lock:
                    seen = self._layouts.setdefault(handle, {})
                    if len(seen) >= self.MAX_SIGNATURES:
                        seen.clear()
                    seen[key] = [_out(n, a) for n, a in outputs.items()]
            return outputs
        outputs = model.run_into(tensors, wanted, into)
        if any(outputs.get(n) is not a for n, a in into.items()):
            with self._lock:  # written elsewhere: this model runs plainly from now on
                self._plain.add(handle)
        return outputs

    def forget(self, handle: int) -> None:
        with self._lock:
            self._layouts.pop(handle, None)
            self._plain.discard(handle)


def _out(name: str, a: Any) -> Out:
    """An output as :data:`Out` describes it: an engine may write it into place only if
    it is a numeric array of this machine's byte order."""
    if (isinstance(a, np.ndarray) and a.dtype.kind in "biuf" and a.dtype.isnative
            and dtype_name(a) not in PACKED):
        return (name, a.dtype, a.shape, a.nbytes)
    return (name, None, getattr(a, "shape", ()), 0)


def _arena(channel: Channel) -> Reserve:
    """Room for a run's big outputs in ``channel``'s arena (:meth:`Channel.reserve`)."""
    def reserve(layout: list[Out]) -> dict[str, Any]:
        big = [(name, dtype, shape) for name, dtype, shape, nbytes in layout
               if dtype is not None and nbytes >= INLINE_BYTES]
        return channel.reserve(big) if big else {}
    return reserve


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` is mapped in this process."""
    return int(np.frombuffer(mm, np.uint8, 1).__array_interface__["data"][0])


def _pss(own: bool = False) -> int:
    """This process's proportional set size (the pages it shares with the zygote, the
    daemon and the other workers counted in part), 0 if it cannot be read. ``own``:
    without the channels' arenas and mapped regions (memfds: the transport's, sized by
    the biggest message each channel carried, not what the process keeps for itself)."""
    try:
        if not own:
            with open("/proc/self/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        return int(line.split()[1]) * 1024
            return 0
        total, memfd = 0, False
        with open("/proc/self/smaps", "rb") as f:
            for line in f:
                if line[:1].isalnum() and b"-" in line.split(b" ", 1)[0]:  # a mapping
                    memfd = b"/memfd:" in line
                elif line.startswith(b"Pss:") and not memfd:
                    total += int(line.split()[1]) * 1024
        return total
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # arrays of a run still view it: unmapped with the last of them


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
    WorkerProcess(name, registry, customops).serve(Channel(sock, trusted=True))
    return 0
