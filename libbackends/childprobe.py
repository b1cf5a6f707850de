"""Probing plugins in child processes, so that a crash or a hang never reaches the daemon.

:func:`probe_in_children` runs each plugin's open, contract check and ``probe()`` in a
short-lived child process (this module's ``__main__``: ``python -m
inferd.libbackends.childprobe PATH PARENT_PID``) with a timeout. The child reports each
action on stdout before it starts it, so a plugin that segfaults, aborts, exits or hangs
is reported with the stage and the call it was in. Native plugins are opened through
:func:`inferd.libbackends.native.open_native`, Python plugins through the loader's own
import; the custom-op loader runs its own child with :func:`child_setup` and
:func:`report`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.libbackends.native import StageHook, open_native
from inferd.libbackends.registry import CandidateError, Stage

_REPORT = "INFERD-PROBE "  # prefix of the child's report lines on stdout
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class ChildReport:
    """What a child process found out about one native plugin."""

    ok: bool
    stage: Stage
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    not_started: bool = False  # the child process itself could not be started


STARTUP_ALLOWANCE_S = 60.0
"""How long a child may take to start Python before its plugin's time begins."""


@dataclass
class _Child:
    path: Path
    proc: subprocess.Popen[bytes]
    deadline: float
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    started: bool = False
    timed_out: bool = False


def probe_in_children(paths: Iterable[Path], timeout_s: float,
                      module: str = "inferd.libbackends.childprobe") -> dict[Path, ChildReport]:
    """Open, check and probe each plugin in its own child process, all at once.

    ``module`` is run as the child (``python -m module PATH PARENT_PID``) and reports on
    stdout in this module's protocol (the custom-op loader uses its own child).

    Each plugin has ``timeout_s`` from the moment its child is ready to dlopen it (the
    interpreter's own start-up, slow on a busy device, does not count, up to
    STARTUP_ALLOWANCE_S). A child that crashes, exits or runs out of time is reported
    failed at the stage it was in when it stopped.
    """
    sel = selectors.DefaultSelector()
    children: list[_Child] = []
    now = time.monotonic()
    unstarted: dict[Path, ChildReport] = {}
    for path in paths:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, str(path), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)  # its own process group: killed whole on a hang
        except OSError as e:  # the interpreter cannot be run (a dropped uid, no fds)
            unstarted[path] = ChildReport(False, Stage.OPENED, f"cannot start the probe "
                                          f"process ({sys.executable}): {e.strerror}",
                                          not_started=True)
            continue
        child = _Child(path, proc, now + STARTUP_ALLOWANCE_S + timeout_s)
        children.append(child)
        for stream, buf in ((proc.stdout, child.out), (proc.stderr, child.err)):
            assert stream is not None
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ, (child, buf))
    while sel.get_map():
        now = time.monotonic()
        for child in children:
            if not child.timed_out and child.proc.poll() is None and now >= child.deadline:
                child.timed_out = True
                os.killpg(child.proc.pid, signal.SIGKILL)
        waiting = [c.deadline for c in children if not c.timed_out and c.proc.poll() is None]
        for key, _ in sel.select(timeout=max(0.01, min(waiting, default=now + 1) - now)):
            child, buf = key.data
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                continue
            buf += data
            if not child.started and buf is child.out and _REPORT.encode() in buf:
                child.started = True  # the plugin's time starts now
                child.deadline = time.monotonic() + timeout_s
    sel.close()
    reports = dict(unstarted)
    for child in children:
        rc = child.proc.wait()
        reports[child.path] = _interpret(bytes(child.out), bytes(child.err), rc,
                                         child.timed_out, timeout_s)
    return reports


def _interpret(out: bytes, err: bytes, rc: int, timed_out: bool,
               timeout_s: float) -> ChildReport:
    lines = [json.loads(line[len(_REPORT):]) for line in out.decode(errors="replace")
             .splitlines() if line.startswith(_REPORT)]
    doing, stage = "starting the probe process", Stage.OPENED
    for msg in lines:
        if "failed" in msg:
            info = {"id": msg["id"]} if msg.get("id") else {}
            return ChildReport(False, Stage(msg["failed"]), msg["reason"], info)
        if msg.get("ok"):
            return ChildReport(True, Stage.PROBED, info=msg)
        doing, stage = msg["doing"], Stage(msg["stage"])
    tail = err.decode(errors="replace").strip().splitlines()[-3:]
    detail = f" ({' | '.join(tail)})" if tail else ""
    if timed_out:
        return ChildReport(False, stage, f"hung: no answer within {timeout_s:g} s "
                                         f"while calling {doing}")
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return ChildReport(False, stage, f"crashed with {name} while calling {doing}"
                                         f"{detail}")
    return ChildReport(False, stage, f"probe process exited with status {rc} while "
                                     f"calling {doing}{detail}")


def child_json(code: str, module_file: str, timeout_s: float,
               env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a child interpreter that imports the same copy of a module as
    this process, and return the JSON value its last line of output holds.

    Args:
        code: Python source that prints one JSON value as its last line.
        module_file: the ``__file__`` of the module the code imports (a Debian add-on's
            is vendored, not on the child's default path): its package's parent
            directory goes first on the child's ``PYTHONPATH``.
        timeout_s: how long the child may take.
        env: the child's environment (default: this process's).

    Raises:
        RuntimeError: the child could not start, ran out of time, failed, or printed
            no JSON; the message says which, with the end of its stderr.
    """
    where = str(Path(module_file).resolve().parent.parent)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (where, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the process listing them took over {timeout_s:.0f} s") from e
    except OSError as e:
        raise RuntimeError(f"cannot start {sys.executable}: {e.strerror}") from e
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        how = (f"was killed by {signal.Signals(-proc.returncode).name}"
               if proc.returncode < 0 else f"exited with status {proc.returncode}")
        raise RuntimeError(f"the process listing them {how}: {tail or 'no message'}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise RuntimeError(f"the process listing them printed {lines[-1][:200]!r}") from None


class EngineImportError(ImportError):
    """An engine's module is installed but does not import (the loader reports it at
    the candidate's stage ``opened``)."""


def engine_facts(module: str, code: str, timeout_s: float) -> Any:
    """What ``code`` prints (Python that uses the engine ``module``, imported before it
    runs, and prints one JSON value as its last line), run in a child process
    (:func:`child_json`) that finds the same copy of the module, without importing it
    here: an engine comes into the daemon only when a model is loaded on it, and one
    whose import crashes or hangs is reported, never fatal.

    Raises:
        EngineImportError: the module is not installed, or its import raised.
        RuntimeError: the child failed otherwise (the reason).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise EngineImportError(f"python module {module} cannot be imported: "
                                f"ModuleNotFoundError: No module named '{module}'")
    child = (f"import json, sys\ntry:\n    import {module}\nexcept Exception as e:\n"
             f"    print(json.dumps({{'import_error': f'{{type(e).__name__}}: {{e}}'}}))\n"
             f"    sys.exit(0)\n{code}")
    facts = child_json(child, spec.origin, timeout_s)
    if isinstance(facts, dict) and "import_error" in facts:
        raise EngineImportError(f"python module {module} cannot be imported: "
                                f"{facts['import_error']}")
    return facts


def child_setup(parent: int) -> bool:
    """In a probe child: no core dumps, die with the daemon; False if it is gone."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is expected, not a core
    # Die with the daemon: a hung plugin must not outlive a daemon killed during boot.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def report(msg: dict[str, Any]) -> None:
    """In a probe child: one report line for :func:`probe_in_children`."""
    sys.stdout.write(_REPORT + json.dumps(msg) + "\n")
    sys.stdout.flush()


def _child_main(path: str, parent: int) -> int:
    if not child_setup(parent):  # the daemon is already gone
        return 1

    def step(what: str, stage: Stage) -> None:
        report({"doing": what, "stage": str(stage)})

    if not path.endswith(".so"):
        return _python_child(path, report, step)
    try:
        backend = open_native(Path(path), step)
        step("probe()", Stage.PROBED)
        probe = backend.probe()
    except CandidateError as e:
        report({"failed": str(e.stage), "reason": e.reason})
        return 0
    report({"ok": True, "id": backend.id, "version": backend.version,
            "kind": str(backend.kind), "available": probe.available,
            "reason": probe.reason, "devices": list(probe.devices)})
    return 0


def _python_child(path: str, report: Callable[[dict[str, Any]], None],
                  step: StageHook) -> int:
    """The child's part for a Python plugin: the loader's own import, factory, contract
    check and probe, with each action reported before it starts."""
    from inferd.libbackends.loader import Loader, _exc
    from inferd.libbackends.registry import Candidate, Form, Registry

    c = Candidate(path, Form.PYTHON)
    try:
        backend, probe = Loader(Registry(), builtins=())._python(c, step)
    except CandidateError as e:
        report({"failed": str(e.stage), "reason": e.reason, "id": e.backend})
        return 0
    except (Exception, SystemExit) as e:  # noqa: BLE001  the parent records it as it would
        report({"failed": str(c.stage), "reason": _exc(e), "id": c.backend})
        return 0
    report({"ok": True, "id": backend.id, "version": backend.version,
            "kind": str(backend.kind), "available": probe.available,
            "reason": probe.reason, "devices": list(probe.devices)})
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
