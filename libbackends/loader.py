"""The plugin loader: finds backend plugins at boot and registers every one it can.

Search path (strongest first, an override replaces the default): ``--backends-dir``
(the ``backends.paths`` command-line override), ``$INFERD_BACKENDS_PATH``
(colon-separated), ``backends.paths`` in the config file, ``/usr/lib/inferd/backends``.

Candidates are found by :mod:`inferd.libbackends.discovery`; every one goes found ->
opened -> contract checked -> probed -> registered. At the first stage that fails, one
WARNING line with PLUGIN_PATH, STAGE (and BACKEND when known) is logged, the candidate
is recorded in the registry's troubleshooting view, and the next candidate is tried.
Before anything of a plugin is opened, it must pass strict modes
(:mod:`inferd.libbackends.trust`: only root and the daemon's user can write it and the
folders above it up to its backends directory), else it fails at ``opened``. Every
plugin, native or Python, is first opened and probed in a child process (see
:mod:`inferd.libbackends.childprobe`): one that crashes, calls ``os._exit`` or hangs at
import or in its probe is reported with the stage and action it was in, and never
loaded into the daemon.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from inferd.ipc.errors import BackendError
from inferd.libbackends.contract import (
    API_VERSION, BACKEND_ID, REQUIRED_ATTRIBUTES, REQUIRED_METHODS, Backend, DeviceKind, Probe,
)
from inferd.libbackends.childprobe import ChildReport, EngineImportError, probe_in_children
from inferd.libbackends.discovery import _check_readable, discover
from inferd.libbackends.native import StageHook, _no_step, open_native, version_problem
from inferd.libbackends.searchpath import BACKENDS
from inferd.libbackends.registry import (
    Candidate, CandidateError, CandidateStatus, Form, Registry, Stage,
)
from inferd.libbackends.trust import STRICT, StrictModes, UntrustedCode

log = logging.getLogger(__name__)

FACTORY = "create_backend"
_module_numbers = itertools.count(1)


@dataclass(frozen=True)
class Builtin:
    """A backend that ships inside inferd: registered without a file when ``module``
    imports."""

    name: str
    module: str
    factory: Callable[[], Backend]


def _onnxruntime_cpu() -> Backend:
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend

    return OnnxRuntimeCpuBackend()


def _openvino() -> Backend:
    from inferd.libbackends.openvino_backend import OpenVinoBackend

    return OpenVinoBackend()


def _onnxruntime_gpu() -> Backend:
    from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend

    return OnnxRuntimeGpuBackend()


# Registered in this order when their module imports (the Debian packages ship each as
# a plugin instead: inferd-backend-onnxruntime, -onnxruntime-gpu, -openvino).
BUILTINS: tuple[Builtin, ...] = (
    Builtin("onnxruntime", "onnxruntime", _onnxruntime_cpu),
    Builtin("onnxruntime-gpu", "onnxruntime", _onnxruntime_gpu),
    Builtin("openvino", "openvino", _openvino),
)


# --------------------------------------------------------------------- search path

search_path = BACKENDS.choose
usable_dirs = BACKENDS.usable


# --------------------------------------------------------------------- the loader


class Loader:
    """Loads built-ins and plugins into one registry.

    Args:
        registry: where backends and candidates are recorded.
        probe_timeout_s: how long a native plugin's child process may take to open,
            check and probe it.
        builtins: the built-in backends to try first.
        settings: the config file's sections by name; a backend that has the optional
            ``configure()`` gets the one named after its id (``-`` read as ``_``:
            ``[ncnn]``, ``[onnxruntime_gpu]``) before its probe, ``{}`` if none.
        strict: who may have written a plugin for it to be opened (``[security]
            strict_modes``).
    """

    def __init__(self, registry: Registry, probe_timeout_s: float = 10.0,
                 builtins: Sequence[Builtin] = BUILTINS,
                 settings: Mapping[str, dict[str, Any]] | None = None,
                 strict: StrictModes = STRICT) -> None:
        self.registry = registry
        self.probe_timeout_s = probe_timeout_s
        self.builtins = builtins
        self.settings = settings or {}
        self.strict = strict

    def load(self, dirs: Sequence[Path]) -> None:
        """Register the built-ins, then every plugin found in ``dirs``."""
        for b in self.builtins:
            self._run(Candidate(f"built-in:{b.name}", Form.BUILTIN),
                      functools.partial(self._builtin, builtin=b))
        candidates = discover(dirs)
        unreadable: dict[str, CandidateError] = {}
        plugins = []
        for c in candidates:
            if c.status is CandidateStatus.FAILED and not c.reason:
                try:
                    self._trusted(Path(c.path))  # before any of it is opened
                    if not (c.form is Form.PYTHON and Path(c.path).is_dir()):
                        _check_readable(Path(c.path))  # before a child blocks on a FIFO
                    plugins.append(Path(c.path))
                except CandidateError as e:
                    unreadable[c.path] = e
        # Every plugin, native or Python, is first opened and probed in a child process:
        # one that crashes, exits or hangs there is reported and never loaded here.
        reports = probe_in_children(plugins, self.probe_timeout_s) if plugins else {}
        for c in candidates:
            if c.status in (CandidateStatus.SKIPPED, CandidateStatus.IGNORED):
                self.registry.candidates.append(c)
                log.info("backend candidate %s %s: %s", c.path, c.status, c.reason,
                         extra={"PLUGIN_PATH": c.path, "STAGE": str(c.stage)})
            elif c.reason:  # failed at found
                self._record_failure(c, CandidateError(Stage.FOUND, c.reason))
            elif c.path in unreadable:
                self._record_failure(c, unreadable[c.path])
            elif c.form is Form.NATIVE:
                self._run(c, lambda c: self._native(c, reports[Path(c.path)]))
            else:
                self._run(c, lambda c: self._python_probed(c, reports[Path(c.path)]))

    def _trusted(self, path: Path) -> None:
        """Raise CandidateError (opened) unless strict modes allow ``path`` (a package:
        every file in it), its root being the backends directory it was found in."""
        try:
            if path.is_dir():
                self.strict.check_tree(path, path.parent)
            else:
                self.strict.check(path, path.parent)
        except UntrustedCode as e:
            raise CandidateError(Stage.OPENED, e.message) from e
        except OSError as e:
            raise CandidateError(Stage.OPENED, f"cannot read it: {e.strerror}") from e

    # The one place where a plugin's failure is contained and logged.
    def _run(self, c: Candidate, stages: Callable[[Candidate], tuple[Backend, Probe]]) -> None:
        try:
            backend, probe = stages(c)
            c.backend = backend.id
            c.stage = Stage.REGISTERED
            try:
                self.registry.register(backend, c.path, probe)
            except BackendError as e:
                raise CandidateError(Stage.REGISTERED, e.message, backend.id) from e
        except CandidateError as e:
            self._record_failure(c, e)
            return
        except (Exception, SystemExit) as e:  # noqa: BLE001  a plugin's bug: contained here
            self._record_failure(c, CandidateError(c.stage, _exc(e)))
            return
        if probe.available:
            c.status = CandidateStatus.REGISTERED
        else:
            c.stage, c.status, c.reason = Stage.PROBED, CandidateStatus.UNAVAILABLE, \
                probe.reason or "probe() said unavailable without a reason"
            self._warn(c)
        self.registry.candidates.append(c)

    def _record_failure(self, c: Candidate, e: CandidateError) -> None:
        c.stage, c.status, c.reason = e.stage, CandidateStatus.FAILED, e.reason
        c.backend = e.backend or c.backend
        self._warn(c)
        self.registry.candidates.append(c)

    @staticmethod
    def _warn(c: Candidate) -> None:
        extra = {"PLUGIN_PATH": c.path, "STAGE": str(c.stage)}
        if c.backend:
            extra["BACKEND"] = c.backend
        log.warning("backend candidate %s %s at stage '%s': %s", c.path, c.status, c.stage,
                    c.reason, extra=extra)

    # ----------------------------------------------------------------- stages

    def _builtin(self, c: Candidate, builtin: Builtin) -> tuple[Backend, Probe]:
        b = builtin
        c.stage = Stage.OPENED
        # Found, not imported: the engine comes into the daemon with the first model
        # loaded on it, and its probe imports it in a child process.
        try:
            found = importlib.util.find_spec(b.module) is not None
        except (ImportError, ValueError) as e:
            raise CandidateError(Stage.OPENED, f"python module {b.module} cannot be "
                                               f"imported: {_exc(e)}") from e
        if not found:
            raise CandidateError(Stage.OPENED, f"python module {b.module} cannot be "
                                               f"imported: ModuleNotFoundError: No module "
                                               f"named '{b.module}'")
        c.stage = Stage.CONTRACT_CHECKED
        return self._checked(c, _call_factory(b.factory, f"built-in {b.name}"))

    def _python_probed(self, c: Candidate, report: ChildReport) -> tuple[Backend, Probe]:
        if report.not_started:
            log.warning("backend candidate %s: %s; loading the Python plugin without a probe "
                        "process first", c.path, report.reason,
                        extra={"PLUGIN_PATH": c.path, "STAGE": str(Stage.OPENED)})
            return self._python(c)
        if not report.ok:
            raise CandidateError(report.stage, report.reason, report.info.get("id"))
        return self._python(c)  # the child showed this does not crash, exit or hang

    def _python(self, c: Candidate, step: StageHook = _no_step) -> tuple[Backend, Probe]:
        """Import, create, check and probe a Python plugin (``step`` is told each action
        before it starts: the probe child reports them)."""
        c.stage = Stage.OPENED
        step("import", Stage.OPENED)
        module = _import_plugin(Path(c.path))
        c.stage = Stage.CONTRACT_CHECKED
        step(f"{FACTORY}()", Stage.CONTRACT_CHECKED)
        factory = getattr(module, FACTORY, None)
        if factory is None:
            public = [n for n in vars(module) if not n.startswith("_")][:8]
            raise CandidateError(Stage.CONTRACT_CHECKED,
                                 f"no factory function {FACTORY}() in the module "
                                 f"(it defines {', '.join(public) or 'nothing public'})")
        if not callable(factory):
            raise CandidateError(Stage.CONTRACT_CHECKED,
                                 f"{FACTORY} is a {type(factory).__name__}, not a function")
        return self._checked(c, _call_factory(factory, f"{FACTORY}()"), step)

    def _checked(self, c: Candidate, backend: Any, step: StageHook = _no_step
                 ) -> tuple[Backend, Probe]:
        check_contract(backend)
        c.backend = backend.id
        c.stage = Stage.PROBED
        configure = getattr(backend, "configure", None)
        step("probe()", Stage.PROBED)
        try:
            if callable(configure):
                configure(dict(self.settings.get(backend.id.replace("-", "_"), {})))
            probe = backend.probe()
        except EngineImportError as e:  # its engine's module, imported by a child:
            c.backend = None  # as if the module itself had not imported
            raise CandidateError(Stage.OPENED, str(e)) from e
        except Exception as e:
            raise CandidateError(Stage.PROBED, f"probe() raised {_exc(e)}", c.backend) from e
        if not isinstance(probe, Probe):
            raise CandidateError(Stage.PROBED, f"probe() returned a {type(probe).__name__}"
                                               f", not a Probe", c.backend)
        return backend, probe

    def _native(self, c: Candidate, report: ChildReport) -> tuple[Backend, Probe]:
        if not report.ok:
            raise CandidateError(report.stage, report.reason, report.info.get("id"))
        c.backend = report.info["id"]
        c.stage = Stage.OPENED
        _check_readable(Path(c.path))
        backend = open_native(Path(c.path))  # the child showed this does not crash
        c.stage = Stage.PROBED
        return backend, backend.probe()


def check_contract(backend: Any) -> None:
    """Check an object against the Backend contract once, at load.

    Raises:
        CandidateError (contract checked): exactly what is missing or wrong.
    """
    kind = type(backend).__name__
    missing = [f"method {m}()" for m in REQUIRED_METHODS
               if not callable(getattr(backend, m, None))]
    missing += [f"attribute {a}" for a in REQUIRED_ATTRIBUTES if not hasattr(backend, a)]
    if missing:
        raise CandidateError(Stage.CONTRACT_CHECKED,
                             f"the backend object ({kind}) lacks {', '.join(missing)}; the "
                             f"contract needs methods {', '.join(REQUIRED_METHODS)} and "
                             f"attributes {', '.join(REQUIRED_ATTRIBUTES)}")
    ident = backend.id
    if not isinstance(ident, str) or not BACKEND_ID.fullmatch(ident):
        raise CandidateError(Stage.CONTRACT_CHECKED, f"id {ident!r} is not 1-64 letters, "
                                                     f"digits, '.', '_' or '-'")
    if not isinstance(backend.version, str):
        raise CandidateError(Stage.CONTRACT_CHECKED,
                             f"version is a {type(backend.version).__name__}, not a str",
                             ident)
    if backend.kind not in set(DeviceKind):
        raise CandidateError(Stage.CONTRACT_CHECKED, f"kind {backend.kind!r} is not one "
                                                     f"of cpu, gpu, npu", ident)
    # A Backend subclass inherits api_version; a duck-typed object without it is taken
    # to be written against this daemon's version.
    api = getattr(backend, "api_version", API_VERSION)
    if not (isinstance(api, tuple) and len(api) == 2
            and all(isinstance(x, int) for x in api)):
        raise CandidateError(Stage.CONTRACT_CHECKED,
                             f"api_version {api!r} is not a (major, minor) tuple", ident)
    problem = version_problem(*api)
    if problem:
        raise CandidateError(Stage.CONTRACT_CHECKED, problem, ident)


def _import_plugin(path: Path) -> ModuleType:
    """Import a plugin file or package under a private, unique module name, so that
    every registry gets its own module and a plugin named like a real package (e.g.
    ``onnxruntime/``) never shadows it."""
    _check_readable(path / "__init__.py" if path.is_dir() else path)
    try:
        return import_file(path, _module_name(path))
    except ImportFailed as e:
        raise CandidateError(Stage.OPENED, str(e)) from e.__cause__


class ImportFailed(Exception):
    """A Python file could not be imported; the message says why."""


def import_file(path: Path, module_name: str) -> ModuleType:
    """Import the Python file ``path`` (or the package directory ``path``) as
    ``module_name``: the one importer of user code (backend plugins, processor files).

    Raises:
        ImportFailed: "python cannot import it" or "import raised <error>"; an
            exception or ``SystemExit`` of the file's own code is contained here.
    """
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(
            module_name, path / "__init__.py", submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportFailed("python cannot import it")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # packages need it for their relative imports
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[spec.name]
        raise ImportFailed(f"import raised {_exc(e)}") from e
    return module


def _module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.name.removesuffix(".py"))
    return f"inferd_plugin_{next(_module_numbers)}_{stem}"


def _call_factory(factory: Callable[[], Any], what: str) -> Any:
    try:
        return factory()
    except (Exception, SystemExit) as e:
        raise CandidateError(Stage.CONTRACT_CHECKED, f"{what} raised {_exc(e)}") from e


def _exc(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------- entry point


def load_backends(registry: Registry, config: Any,
                  env: Mapping[str, str] | None = None) -> None:
    """Fill ``registry`` the way the daemon does at boot.

    Args:
        registry: an empty registry of one runtime.
        config: the daemon configuration; ``backends.paths`` counts as the
            ``--backends-dir`` flag when ``config.overridden`` holds it.
        env: the environment (default ``os.environ``).
    """
    paths, source = BACKENDS.from_config(config, os.environ if env is None else env)
    dirs = BACKENDS.usable(paths, source)
    registry.search_path = [str(d) for d in dirs]
    registry.search_path_source = source
    log.info("searching backends in %s (from %s)",
             ":".join(registry.search_path) or "no usable directory", source)
    settings = {name: dict(vars(section)) for name, section in vars(config).items()
                if isinstance(section, SimpleNamespace)}
    Loader(registry, config.backends.probe_timeout_s, settings=settings,
           strict=StrictModes(config.security.strict_modes)).load(dirs)
    ok = [c for c in registry.candidates if c.status is CandidateStatus.REGISTERED]
    failed = [c for c in registry.candidates if c.status is not CandidateStatus.REGISTERED]
    log.info("backends: %d registered (%s), %d other candidates", len(ok),
             ", ".join(c.backend or c.path for c in ok) or "none", len(failed))
