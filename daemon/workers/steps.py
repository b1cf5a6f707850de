"""Processor steps in the processors worker: the daemon runs no processor itself (issue
30, item 1), neither a built-in (OpenCV and pyclipper are native code that a client's
image reaches) nor a user's.

One worker, keyed :data:`PROCESSORS`, holds every step, started through the zygote and
supervised like an engine's worker: its death answers the calls in flight
``UNAVAILABLE`` ("processors (worker 4711) died of SIGSEGV while running processor
mine.crash"), is logged and counted (``inferd_worker_restarts_total{backend=
"processors"}``), and it is started again with backoff. The daemon holds a
:class:`RemoteStep` per step; its operations in the worker:

- ``build``: the step from its processor's name and parameters
  (:meth:`inferd.daemon.processors.ProcessorRegistry.build_here`), with a
  :class:`~inferd.daemon.processors.Context` whose ``model_path`` resolves names in the
  daemon's repository (same root, same link checks); answers a handle. The user files of
  ``[processors] directory`` are imported at the first step that is not built in.
- ``step``: one call of the step: values in, values out (below).
- ``release``: the step is dropped (a model unloaded, a graph retired); a worker with no
  step left ends after ``[workers] idle_exit_s`` as an engine's does.
- ``directory``: import the user files now (the daemon asks once at start, so that the
  skip and register lines come when they always did).

A step whose worker died is built again, in a new worker, on its next call.

**Values.** A step's values are any Python objects (lists of crops, dicts, strings,
scalars). They cross pickled by their sender, which is the daemon or the worker, never a
client: a client's tensors were decoded by the daemon first. Every numeric array in them,
however deep, travels as a channel tensor (in the datagram or the sender's arena, not
pickled); the pickle holds only a reference to it (``persistent_id``). An array the step
passes through unchanged (an input given back as it came, which it cannot have written:
inputs arrive read-only) is not sent back: the reply names the input, and the daemon
puts its own array there. The worker copies the inputs that came through the daemon's
arena (a step may keep a value past its call: the arena is written over by the next).

**What the daemon takes back.** The daemon reads a step's values under the allow-list
of :mod:`inferd.daemon.workers.pickles` (numbers, strings, bytes, None, numpy arrays, and
lists, tuples, dicts and sets of them): a taken-over worker cannot have the daemon call
a global while it reads them. The worker checks its own answer under the same list
first, so that a step returning anything else (an ``OrderedDict``, a ``Path``) fails its
call, naming the type, and the worker serves on; values the daemon refuses are
therefore not inferd's, and their worker is killed as one that broke its channel
(``processors (worker 4711) was killed for values the daemon refuses to read (global
os.system is not allowed) while running processor mine.step``), the call failing
``UNAVAILABLE`` and charged to its client as a death is.
"""

from __future__ import annotations

import io
import logging
import mmap
import pickle
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.daemon.processors import Context, HeldStep, ProcessorRegistry
from inferd.daemon.workers import pickles
from inferd.daemon.workers.channel import Channel
from inferd.ipc.errors import ErrorCode, InferdError, ModelError

if TYPE_CHECKING:
    from inferd.daemon.workers.pool import Worker, WorkerPool

log = logging.getLogger(__name__)

PROCESSORS = "processors"
"""The processors worker's key, and the name its deaths are counted under."""

_NUMERIC = frozenset("biufc")
_SKELETON = "values"


# ----------------------------------------------------------------- values


class _Packer(pickle.Pickler):
    """Pickles values, their numeric arrays taken out as tensors (``tensors``) or named
    as the inputs they are (``inputs``: id -> key of an array received)."""

    def __init__(self, file: io.BytesIO, tensors: dict[str, Any],
                 inputs: dict[int, str] | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.inputs = inputs

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not np.ndarray:
            return None
        if self.inputs:
            key = self.inputs.get(id(obj))
            if key is not None:
                return ("in", key)
        if obj.dtype.kind not in _NUMERIC or not obj.dtype.isnative:
            return None  # strings, objects, records: pickled with the rest
        key = str(len(self.tensors))
        self.tensors[key] = obj
        return key


class _Unpacker(pickle.Unpickler):
    """Reads values the daemon sent (the worker's side: the daemon is trusted)."""

    def __init__(self, data: Any, tensors: dict[str, Any],
                 sent: dict[str, Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = tensors
        self.sent = sent

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is str and pid in self.tensors:
            return self.tensors[pid]
        if type(pid) is tuple and len(pid) == 2 and pid[0] == "in" and self.sent \
                and pid[1] in self.sent:
            return self.sent[pid[1]]
        raise pickle.UnpicklingError(f"a reference to {pid!r}, which is neither a tensor "
                                     f"of the message nor an input sent with the call")


class _CheckedUnpacker(pickles.Unpickler, _Unpacker):
    """Reads values a worker sent: globals under the daemon's allow-list."""


class _Checker(pickles.Unpickler):
    """Reads the values a worker is about to send as the daemon will (references to
    tensors left out): whether the daemon takes them."""

    def persistent_load(self, pid: Any) -> Any:
        return None


def pack(values: Any, inputs: dict[int, str] | None = None) -> dict[str, Any]:
    """``values`` as channel tensors: the numeric arrays, and the rest pickled (a uint8
    tensor: it travels inline or through the arena by its size, as any tensor)."""
    tensors: dict[str, Any] = {}
    buf = io.BytesIO()
    _Packer(buf, tensors, inputs).dump(values)
    tensors[_SKELETON] = np.frombuffer(buf.getbuffer(), np.uint8)
    return tensors


def unpack(tensors: dict[str, Any], sent: dict[str, Any] | None = None,
           trusted: bool = False) -> Any:
    """The values :func:`pack` made; ``sent``: the tensors this end packed for the call
    (what an answer's references to inputs name). ``trusted``: they come from the daemon
    (the worker's side); else from a worker, read under the daemon's allow-list.

    Raises:
        pickles.Refused: (not ``trusted``) a global the daemon does not take.
        pickle.UnpicklingError: a reference to no tensor; what a malformed pickle
            raises.
    """
    skeleton = tensors.pop(_SKELETON)
    data = memoryview(skeleton).cast("B")
    cls = _Unpacker if trusted else _CheckedUnpacker
    return cls(data, tensors, sent).load()


def check_values(tensors: dict[str, Any]) -> None:
    """Raise :class:`pickles.Refused` if the daemon would refuse the values of
    ``tensors`` (:func:`pack`'s)."""
    _Checker(io.BytesIO(memoryview(tensors[_SKELETON]).cast("B"))).load()


# ----------------------------------------------------------------- the worker's side


class StepHost:
    """The processors worker's steps by handle (one per worker process)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._registry: Any = None
        self._directory: str | None = None
        self._steps: dict[int, Any] = {}
        self._next = 1
        self._lock = threading.Lock()

    def _processors(self, header: dict[str, Any], user: bool) -> Any:
        """The registry of this worker: the built-ins, and the user files once ``user``
        (imported here only, never in the daemon or the zygote)."""
        from inferd.libbackends.trust import StrictModes

        with self._lock:
            if self._registry is None:
                self._registry = ProcessorRegistry(StrictModes(header["strict"]))
            if user and self._directory is None and header.get("directory"):
                self._directory = header["directory"]
                self._registry.load_directory(self._directory)
            return self._registry

    def serve(self, op: str, header: dict[str, Any], tensors: dict[str, Any],
              channel: Channel) -> None:
        """Answer one of the step operations on ``channel``."""
        if op == "step":
            step = self._steps.get(header["handle"])
            if step is None:
                raise InferdError(f"no step {header['handle']} in worker {self.name}",
                                  ErrorCode.INTERNAL)
            received = _kept(tensors)
            values = unpack(dict(received), trusted=True)
            inputs = {id(a): k for k, a in received.items()}
            try:
                out = step(values)
            except InferdError:
                raise
            except BaseException as e:  # noqa: BLE001  a step's own failure: its answer
                channel.send(_unexpected(e))
                return
            del values
            answer = pack(out, inputs)
            try:
                check_values(answer)
            except pickles.Refused as e:  # the step's own type: its call fails, here
                raise ModelError(f"returned a value the daemon does not take from a "
                                 f"worker: {e} (it takes numbers, strings, bytes, None, "
                                 f"numpy arrays, and lists, tuples, dicts and sets of "
                                 f"them)", ErrorCode.INTERNAL) from None
            channel.send({"ok": True}, answer)
        elif op == "build":
            registry = self._processors(header, not _builtin(header["op_name"]))
            from inferd.daemon.repository import Repository

            repo = (Repository(Path(header["repo"][0]), header["repo"][1])
                    if header["repo"] else None)
            context = Context(None if repo is None else _ModelPath(repo),
                              header["owner"], repo)
            try:
                step = registry.build_here(header["op_name"], header["params"], context,
                                           header["where"])
            except InferdError:
                raise
            except BaseException as e:  # noqa: BLE001  as in the daemon: unexpected
                channel.send(_unexpected(e))
                return
            with self._lock:
                handle = self._next
                self._next += 1
                self._steps[handle] = step
            channel.send({"ok": True, "handle": handle})
        elif op == "release":
            with self._lock:
                self._steps.pop(header["handle"], None)
                left = len(self._steps)
            channel.send({"ok": True, "left": left})
        elif op == "directory":
            registry = self._processors(header, True)
            channel.send({"ok": True, "names": registry.names()})


STEP_OPS = frozenset({"step", "build", "release", "directory"})
"""The operations :class:`StepHost` answers."""


def _kept(tensors: dict[str, Any]) -> dict[str, Any]:
    """A call's tensors as the step may keep them: those in the daemon's arena (which
    the next call on the channel writes over) copied out, every one read-only (so that
    one given back is the daemon's own, unchanged)."""
    out = {}
    for k, a in tensors.items():
        if isinstance(a.base, mmap.mmap):  # the arena (inline ones view their own bytes)
            a = a.copy()
            a.flags.writeable = False
        out[k] = a
    return out


class _ModelPath:
    def __init__(self, repo: Any) -> None:
        self._repo = repo

    def __call__(self, name: str) -> Path:
        return Path(self._repo.resolve(name).path)


def _builtin(name: str) -> bool:
    from inferd.daemon.processors import BUILTINS, _import_builtins

    _import_builtins()
    return name in BUILTINS


def _unexpected(e: BaseException) -> dict[str, Any]:
    """The answer for an exception inferd did not expect of a step (not an InferdError):
    raised again in the daemon as one of the same name (``failure`` logs it with the
    worker's traceback and makes it INTERNAL, as it did in-process)."""
    return {"ok": True, "unexpected": [type(e).__name__, str(e), traceback.format_exc()]}


# ----------------------------------------------------------------- the daemon's side


class InWorker:
    """Something a worker holds for the daemon under a handle (a model:
    :class:`~inferd.daemon.workers.pool.WorkerModel`; a processor step:
    :class:`RemoteStep`; here, below the pool, which imports this module): made there by
    one call, made again in a new worker at its first use after
    the worker died, let go of once. Its worker and its handle are one tuple
    (``_at``), read together: a caller that finds the new worker alive while another
    thread makes it again there never sends the dead worker's handle, which may name
    something else in the new one.

    A subclass sets ``pool`` and calls :meth:`_make` from its ``_remake``, and says in
    :meth:`_gone` what a use after :meth:`_let_go` is told.
    """

    pool: WorkerPool
    _at: tuple[Worker, int]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False

    @property
    def worker(self) -> Worker:
        return self._at[0]

    def _make(self, key: str, backend: str, header: dict[str, Any], what: str,
              timeout: float, limit: str = "workers.kill_after_s",
              check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Make it in ``key``'s worker (started if there is none) by the call
        ``header``; ``check`` may refuse the reply. Returns the reply."""
        w = self.pool.worker(key, backend)
        try:
            reply, _ = self.pool.call(w, header, what, timeout=timeout, key=limit)
            if check is not None:
                check(reply)
        except BaseException:
            self.pool.loaded(w, False)
            raise
        self.pool.loaded(w, True)
        self._at = (w, int(reply["handle"]))
        return reply

    def _remake(self) -> None:
        raise NotImplementedError

    def _gone(self) -> str:
        raise NotImplementedError

    def _live(self) -> tuple[Worker, int]:
        """The worker and the handle there, made again in a new worker if it died."""
        at = self._at
        if not at[0].alive:
            with self._lock:
                if self._closed:
                    raise ModelError(self._gone(), ErrorCode.UNAVAILABLE)
                if self._at is at:  # the first use after a death makes it again
                    self._remake()
                at = self._at
        return at

    def _let_go(self, op: str, label: str, name: str) -> None:
        """Have the worker drop it (the call ``op``), once; a failure is logged
        (``label: op in worker N failed``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            w, handle = self._at
        if not w.alive:
            return
        try:
            self.pool.call(w, {"op": op, "handle": handle}, f"the {op} of {name}",
                           timeout=30.0, key="a 30 s limit")
        except InferdError as e:
            log.warning("%s: %s in worker %d failed: %s", label, op, w.pid, e.message)
            return
        self.pool.unloaded(w)


class WorkerTraceback(Exception):
    """Where an unexpected exception was raised in the processors worker (its traceback
    as text: the cause of the exception raised again in the daemon)."""


class StepException(Exception):
    """An exception a step raised in the processors worker, raised again in the daemon
    under the worker's exception's name."""


_KINDS: dict[str, type[StepException]] = {}


def raise_unexpected(kind: str, text: str, where: str) -> None:
    cls = _KINDS.get(kind)
    if cls is None:
        cls = type(kind, (StepException,), {"__module__": "builtins"}) \
            if kind.isidentifier() else StepException
        if len(_KINDS) < 256:
            _KINDS[kind] = cls
    raise cls(text) from WorkerTraceback(f"in the processors worker:\n{where}")


def _expected(reply: dict[str, Any]) -> None:
    """Raise again, in the daemon, what a step raised in the worker that inferd did not
    expect of it (a reply of :func:`_unexpected`)."""
    if "unexpected" in reply:
        raise_unexpected(*reply["unexpected"])


class RemoteSteps:
    """Builds every processor step in the processors worker
    (:class:`inferd.daemon.processors.RemoteBuilder`).

    Args:
        pool: the worker pool.
        directory: ``[processors] directory`` (the user files the worker imports).
        strict: ``[security] strict_modes`` for those files.
        timeout_s: a build or a step running longer has the worker killed
            (``[workers] kill_after_s``).
    """

    def __init__(self, pool: Any, directory: str, strict: bool, timeout_s: float) -> None:
        self.pool = pool
        self.directory = directory
        self.strict = strict
        self.timeout_s = timeout_s
        self.on_memory: Callable[[str, int], None] | None = None
        """Told what the processors worker holds after its first step (its PSS, heap
        trimmed, its channels' arenas left out: they are the transport's, sized by the
        biggest message; 0 once it ended): the cache budget counts it as it counts an
        engine's import, since the steps' code and libraries (OpenCV) left the daemon
        for it."""
        self._counted: int | None = None  # the pid of the worker counted
        self._count_lock = threading.Lock()

    def counted(self, w: Any) -> None:
        """After a step on ``w``: count what it holds, once per worker."""
        if self.on_memory is None or self._counted == w.pid:
            return
        with self._count_lock:
            if self._counted == w.pid:
                return
            self._counted = w.pid
        try:
            reply, _ = self.pool.call(w, {"op": "stats", "trim": True, "own": True}, "stats",
                                      timeout=5.0, key="a 5 s limit")
        except InferdError:
            return
        held = int(reply.get("pss") or 0)
        if held:
            self.on_memory(PROCESSORS, held)
            log.info("processors worker (pid %d) holds %.1f MiB (PSS) after its first "
                     "step: counted in the cache budget while it runs", w.pid,
                     held / 2**20, extra={"BACKEND": PROCESSORS, "WORKER_PID": w.pid})
        w.on_end.append(lambda: self._ended(w.pid))

    def _ended(self, pid: int) -> None:
        with self._count_lock:
            if self._counted != pid:
                return
            self._counted = None
        if self.on_memory is not None:
            self.on_memory(PROCESSORS, 0)

    def header(self) -> dict[str, Any]:
        return {"directory": self.directory, "strict": self.strict}

    def build(self, op: str, params: dict[str, Any], context: Context,
              where: str) -> RemoteStep:
        repo = context.repo
        spec = {**self.header(), "op_name": op, "params": params, "owner": context.owner,
                "where": where,
                "repo": (str(repo.root), bool(repo.allow_external_links)) if repo else None}
        return RemoteStep(self, spec)

    def start(self) -> None:
        """Have a processors worker import the user files now, in the background, if
        there are any: their log lines (registered, skipped) come at start as they did
        when the daemon imported them; the worker ends after ``idle_exit_s`` if no step
        is built meanwhile."""
        root = Path(self.directory)
        try:
            if not root.is_dir():
                log.info("processors directory %s does not exist; no user processors",
                         root)
                return
            if not any(root.glob("*.py")):
                return
        except OSError:
            return
        threading.Thread(target=self._import, name="inferd-processors-import",
                         daemon=True).start()

    def _import(self) -> None:
        try:
            w = self.pool.worker(PROCESSORS, PROCESSORS)
        except InferdError:
            return  # stopping
        try:
            self.pool.call(w, {"op": "directory", **self.header()},
                           "the import of the processors directory",
                           timeout=self.timeout_s)
        except InferdError as e:
            log.warning("processors directory %s: importing it in the processors worker "
                        "failed: %s", self.directory, e.message,
                        extra={"PLUGIN_PATH": self.directory})
        finally:
            self.pool.loaded(w, False)


class RemoteStep(InWorker, HeldStep):
    """A step built in the processors worker, called from the daemon like any step."""

    def __init__(self, steps: RemoteSteps, spec: dict[str, Any]) -> None:
        super().__init__()
        self._steps = steps
        self.pool = steps.pool
        self._spec = spec
        self.what = f"processor {spec['op_name']}"
        self._remake()

    def _remake(self) -> None:
        self._make(PROCESSORS, PROCESSORS, {"op": "build", **self._spec},
                   f"the build of {self.what}", self._steps.timeout_s,
                   check=_expected)

    def _gone(self) -> str:
        return f"{self.what} was released"

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        tensors = pack(values)
        sent = {k: a for k, a in tensors.items() if k != _SKELETON}
        w, handle = self._live()
        reply, out = self.pool.call(w, {"op": "step", "handle": handle}, self.what,
                                    tensors, timeout=self._steps.timeout_s, lend=True)
        self._steps.counted(w)
        _expected(reply)
        try:
            return unpack(out, sent)  # type: ignore[no-any-return]
        except Exception as e:  # noqa: BLE001  whatever a worker's bytes make of the read
            # the worker checked its answer under the same list (StepHost.serve): what
            # the daemon refuses is not inferd's, and the worker is not trusted again
            why = str(e) if isinstance(e, pickles.Refused) else f"{type(e).__name__}: {e}"
            self.pool.kill(w, f"was killed for values the daemon refuses to read ({why})")
            raise self.pool.death(w, self.what) from None

    def release(self) -> None:
        self._let_go("release", self.what, self.what)
