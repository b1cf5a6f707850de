"""Out-of-process backends, the daemon's side: a proxy Backend and LoadedModel that
forward every call to a backend host process (:mod:`inferd.libbackends.host`).

A plugin whose dependencies cannot live in the daemon's interpreter returns a
:class:`HostedBackend` from its ``create_backend()``, naming the interpreter (for
example a separate virtual environment's ``bin/python``) and ``MODULE:FACTORY`` of the
real backend. Then:

- ``probe()`` and ``supports()`` each run in a short-lived host (like a native plugin's
  child probe): an interpreter that is missing, a host that crashes or hangs, is a probe
  that says so (the backend is registered ``unavailable`` with the reason).
- ``load()`` starts one host per loaded model and keeps it until ``unload()``: the model's
  memory is the host's, and a crash takes that model only. A host that crashes or hangs
  during ``run()`` is killed; the run fails with the reason (UNAVAILABLE for a crash,
  DEADLINE_EXCEEDED for a hang), and the next run starts a new host and loads the model
  again, at most ``max_restarts`` times.

Every host's stdout and stderr go to the daemon's log (DEBUG, with BACKEND), and their
last lines into the reason of any failure.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zmq
from numpy.typing import NDArray

import inferd.ipc
import inferd.libbackends
from inferd.ipc.errors import BackendError, ErrorCode, InferdError, ModelError
from inferd.ipc.protocol import decode_reply
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)
from inferd.libbackends.host import BOOTSTRAP, HOST_MAIN, encode_call

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class HostSpec:
    """How to start a backend host.

    Attributes:
        python: the host's interpreter (e.g. ``/opt/venv-rknn/bin/python``), Python 3.11+
            with numpy and pyzmq.
        target: ``MODULE:FACTORY`` (or ``/path/file.py:FACTORY``) creating the backend.
        sys_path: directories put first on the host's ``sys.path`` (vendored libraries).
        env: variables added to the host's environment.
        start_timeout_s: from start until the host says hello.
        call_timeout_s: probe, supports, unload.
        load_timeout_s: load (a conversion can take minutes).
        run_timeout_s: one run.
        max_restarts: new hosts a loaded model may get after its host died.
    """

    python: str
    target: str
    sys_path: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 30.0
    call_timeout_s: float = 30.0
    load_timeout_s: float = 600.0
    run_timeout_s: float = 60.0
    max_restarts: int = 3


class HostError(BackendError):
    """The host process is missing, crashed, hung or broke the framing."""


def _packages() -> dict[str, str]:
    """The daemon's own ``inferd.ipc`` and ``inferd.libbackends`` folders."""
    return {"inferd.ipc": str(Path(inferd.ipc.__file__).parent),
            "inferd.libbackends": str(Path(inferd.libbackends.__file__).parent)}


def bootstrap_command(python: str, sys_path: tuple[str, ...], entry: str,
                      *args: str) -> list[str]:
    """The command that runs ``entry`` (``module:function``) with ``args`` in another
    interpreter, on this daemon's own inferd code (see host.BOOTSTRAP)."""
    boot = json.dumps({"packages": _packages(), "sys_path": list(sys_path)})
    return [python, "-I", "-c", BOOTSTRAP, boot, entry, *args]


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class HostProcess:
    """One running host: its process, its socket, and one call at a time."""

    def __init__(self, spec: HostSpec, backend_id: str, purpose: str) -> None:
        self.spec = spec
        self.backend_id = backend_id
        self.purpose = purpose
        self.hello: dict[str, Any] = {}
        self._tail: collections.deque[str] = collections.deque(maxlen=12)
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="inferd-host-")
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _start(self) -> None:
        python = self.spec.python
        if not os.path.isfile(python) or not os.access(python, os.X_OK):
            raise HostError(f"backend {self.backend_id}: host interpreter {python} "
                            f"{'is not executable' if os.path.exists(python) else 'not found'}")
        endpoint = f"ipc://{self._dir}/host.sock"
        self._sock.bind(endpoint)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(self.spec.env)
        self._proc = subprocess.Popen(
            bootstrap_command(python, self.spec.sys_path, HOST_MAIN, endpoint,
                              self.spec.target),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, close_fds=True)
        assert self._proc.stdout is not None
        threading.Thread(target=self._drain, args=(self._proc.stdout,), daemon=True,
                         name=f"inferd-host-{self.backend_id}-{self._proc.pid}").start()
        frames = self._receive("start", self.spec.start_timeout_s)
        self.hello = json.loads(bytes(frames[0]))
        if "error" in self.hello:
            self._proc.wait(5)
            raise HostError(f"backend {self.backend_id}: host cannot create the backend: "
                            f"{self.hello['error']}{self._last_lines()}")
        log.debug("backend %s: host pid %s (%s, Python %s) started for %s",
                  self.backend_id, self._proc.pid, self.hello.get("executable"),
                  self.hello.get("python"), self.purpose, extra={"BACKEND": self.backend_id})

    def _drain(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail.append(line)
                log.debug("backend %s host[%s]: %s", self.backend_id, self.pid, line,
                          extra={"BACKEND": self.backend_id})
        stream.close()

    def _last_lines(self) -> str:
        time.sleep(0.05)  # let the drain thread catch the host's last words
        lines = [ln for ln in self._tail if ln.strip()][-4:]
        return f"; its last output: {' | '.join(lines)}" if lines else ""

    def _receive(self, what: str, timeout: float) -> list[Any]:
        """Wait for one message, watching the process; kill it on a timeout."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self._sock.poll(100):
                return self._sock.recv_multipart(copy=False)
            code = self._proc.poll()
            if code is not None:
                raise HostError(f"backend {self.backend_id}: host (pid {self._proc.pid}) "
                                f"{_signal_name(code)} during {what}{self._last_lines()}")
            if time.monotonic() > deadline:
                self.kill()
                raise HostError(f"backend {self.backend_id}: host (pid {self._proc.pid}) "
                                f"hung: no answer within {timeout:g} s to {what}; killed"
                                f"{self._last_lines()}", ErrorCode.DEADLINE_EXCEEDED)

    def call(self, op: str, params: dict[str, Any] | None = None,
             tensors: dict[str, NDArray[Any]] | None = None,
             timeout: float | None = None) -> tuple[Any, dict[str, NDArray[Any]]]:
        """One request and its reply: (result, output tensors). Raises the host's coded
        error, or HostError for a dead or hung host."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc else None
                raise HostError(f"backend {self.backend_id}: host is not running"
                                + (f" (it {_signal_name(code)})" if code is not None else ""))
            self._sock.send_multipart(encode_call(op, params, tensors), copy=False)
            frames = self._receive(op, timeout or self.spec.call_timeout_s)
        reply = decode_reply(frames)
        if reply.error is not None:
            code, message = reply.error
            cls = ModelError if code in (ErrorCode.INVALID_ARGUMENT,
                                         ErrorCode.NOT_FOUND) else BackendError
            raise cls(message, code)
        return reply.result, reply.outputs

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        """Ask the host to exit, kill it if it does not, and clean up."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self.call("exit", timeout=5.0)
                self._proc.wait(5)
            except (InferdError, subprocess.TimeoutExpired):
                self.kill()
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def rss_bytes(self) -> int | None:
        try:
            pages = int(Path(f"/proc/{self.pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")


def _specs(raw: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in raw)


class HostedModel(LoadedModel):
    """A model loaded in its own host process; runs one at a time."""

    def __init__(self, backend: HostedBackend, path: Path, options: LoadOptions) -> None:
        self._backend = backend
        self._path = path
        self._options = options
        self._lock = threading.Lock()
        self._restarts = 0
        self._dead: str | None = None
        self._host: HostProcess | None = None
        self._handle = 0
        self._open()

    def _open(self) -> None:
        spec = self._backend.spec
        host = HostProcess(spec, self._backend.id, f"model {self._path}")
        try:
            result, _ = host.call("load", {"path": str(self._path),
                                           "options": dataclasses.asdict(self._options)},
                                  timeout=spec.load_timeout_s)
        except BaseException:
            host.close()
            raise
        self._host, self._handle = host, int(result["handle"])
        self.inputs = _specs(result["inputs"])
        self.outputs = _specs(result["outputs"])
        self.device = str(result.get("device") or "")  # as the hosted model names it

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        spec = self._backend.spec
        with self._lock:
            if self._dead is not None:
                self._revive()
            assert self._host is not None
            try:
                _, out = self._host.call("run", {"handle": self._handle, "outputs": outputs},
                                         inputs, timeout=spec.run_timeout_s)
            except HostError as e:
                self._dead = e.message
                self._host.close()
                log.warning("%s (model %s)", e.message, self._path,
                            extra={"BACKEND": self._backend.id, "MODEL": str(self._path)})
                raise HostError(f"{e.message} (model {self._path}; the next run starts "
                                f"a new host)", e.code) from None
        # The arrays are views of the reply's frames; they stay valid as long as they live.
        return out

    def _revive(self) -> None:
        if self._restarts >= self._backend.spec.max_restarts:
            raise HostError(f"backend {self._backend.id}: the host of model {self._path} "
                            f"died {self._restarts + 1} times (last: {self._dead}); not "
                            f"restarted again: unload the model and load it again")
        self._restarts += 1
        log.warning("backend %s: starting a new host for model %s (restart %d of %d)",
                    self._backend.id, self._path, self._restarts,
                    self._backend.spec.max_restarts, extra={"BACKEND": self._backend.id})
        self._open()
        self._dead = None

    def unload(self) -> None:
        with self._lock:
            if self._host is not None:
                if self._dead is None:
                    try:
                        self._host.call("unload", {"handle": self._handle})
                    except InferdError as e:
                        log.warning("backend %s: unload of %s failed: %s", self._backend.id,
                                    self._path, e.message, extra={"BACKEND": self._backend.id})
                self._host.close()
                self._host = None

    def memory_bytes(self) -> int | None:
        """The host process's resident memory: everything in it is this model's."""
        host = self._host
        return host.rss_bytes() if host is not None else None

    @property
    def host_pid(self) -> int | None:
        """The pid of the host process now serving this model (for tests and logs)."""
        host = self._host
        return host.pid if host is not None else None


class HostedBackend(Backend):
    """A backend that lives in another interpreter; see the module docstring.

    Args:
        backend_id, kind, version: what the daemon registers before any host runs
            (the host's own version, once probed, replaces ``version``).
        spec: how to start the host.
    """

    def __init__(self, backend_id: str, kind: DeviceKind, version: str,
                 spec: HostSpec) -> None:
        self.id = backend_id
        self.kind = kind
        self.version = version
        self.spec = spec

    def _short(self, op: str, params: dict[str, Any]) -> Any:
        host = HostProcess(self.spec, self.id, op)
        try:
            result, _ = host.call(op, params)
            if host.hello.get("version"):
                self.version = host.hello["version"]
            return result
        finally:
            host.close()

    def probe(self) -> Probe:
        try:
            r = self._short("probe", {})
        except InferdError as e:
            return Probe(False, e.message)
        return Probe(bool(r["available"]), str(r["reason"]), tuple(r["devices"]))

    def supports(self, model_path: Path) -> tuple[bool, str]:
        try:
            ok, why = self._short("supports", {"path": str(model_path)})
        except InferdError as e:
            return False, e.message
        return bool(ok), str(why)

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        return HostedModel(self, model_path, options)
