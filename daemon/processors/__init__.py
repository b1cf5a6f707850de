"""Processors: the steps that run before and after inference, and the processor nodes of
graphs.

A processor is built once from its parameters and then called with a dict of named
values (numpy arrays or, inside a graph, any Python object) and returns a dict of named
values. Built-in processors are registered explicitly in :data:`BUILTINS`; user
processors are Python files in a processors directory (``[processors] directory``,
default ``/usr/lib/inferd/processors``), each exporting ``PROCESSORS = {name: factory}``
where ``factory(**params)`` returns the step callable. A user file that strict modes
refuse (:mod:`inferd.libbackends.trust`: writable or owned by a user other than root and
the daemon's, it or a folder up to the processors directory), that cannot be imported or
that breaks the contract is logged (one WARNING line: path, stage, reason) and skipped;
the daemon starts without it.

**Where they run.** With worker processes (``[workers] isolation`` other than
"in-process") no processor runs in the daemon: every step, built-in or user, is built
and run in the processors worker (:mod:`inferd.daemon.workers.steps`), where OpenCV,
pyclipper and the user's code can crash at the cost of the requests that were in it.
The daemon holds a :class:`HeldStep` per step, which the registry's ``remote`` builder
makes, and imports neither the built-ins nor the user files: the user files are imported
by the processors worker only (at start, so that their log lines come when they always
did, and again in each new processors worker at the first step that is not built in).
With ``isolation = "in-process"`` the steps are built and run in the daemon.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.libbackends.loader import ImportFailed, import_file
from inferd.libbackends.trust import STRICT, StrictModes, UntrustedCode

if TYPE_CHECKING:
    from inferd.daemon.repository import Repository

log = logging.getLogger(__name__)

Values = dict[str, Any]
Step = Callable[[Values], Values]
Factory = Callable[..., Step]


@dataclass(frozen=True)
class Context:
    """What a processor may need besides its parameters at build time.

    Args:
        model_path: returns the path of a model's file in the repository by name
            (processors that read a model's metadata, such as the CTC dictionary).
        owner: the model or graph the step belongs to (for messages).
        repo: the model repository ``model_path`` reads (a step built in the
            processors worker resolves model names there, with the same checks).
    """

    model_path: Callable[[str], Path] | None = None
    owner: str = ""
    repo: Repository | None = None


class HeldStep:
    """A step that holds something outside the daemon until :meth:`release` (a step
    built in the processors worker: its handle there)."""

    def __call__(self, values: Values) -> Values:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


class RemoteBuilder(Protocol):
    """Builds steps elsewhere (:class:`inferd.daemon.workers.steps.RemoteSteps`)."""

    def build(self, op: str, params: dict[str, Any], context: Context,
              where: str) -> HeldStep: ...


def release(steps: list[tuple[str, Step]] | list[Step | None]) -> None:
    """Let go of what ``steps`` (a pipeline's named steps, or graph nodes' steps) hold
    outside the daemon; steps built in the daemon hold nothing."""
    for item in steps:
        step = item[1] if isinstance(item, tuple) else item
        if isinstance(step, HeldStep):
            step.release()


class LazyModule:
    """An optional module imported on its first use, not at daemon start (OpenCV alone
    adds ~30 MiB of resident memory to a daemon that may never run an image step).

    ``available`` says whether it can be imported; using an attribute of a module that is
    not installed raises ModelError (UNSUPPORTED) naming the Debian package.
    """

    def __init__(self, name: str, package: str) -> None:
        self._name = name
        self._package = package
        self._module: Any = None
        self._tried = False

    def _load(self) -> Any:
        if not self._tried:
            try:
                self._module = importlib.import_module(self._name)
            except ImportError:
                self._module = None
            self._tried = True
        return self._module

    @property
    def available(self) -> bool:
        return self._load() is not None

    def __getattr__(self, attr: str) -> Any:
        module = self._load()
        if module is None:
            raise ModelError(f"{self._name} is not installed (Debian: {self._package})",
                             ErrorCode.UNSUPPORTED)
        return getattr(module, attr)


cv2 = LazyModule("cv2", "python3-opencv")
pyclipper = LazyModule("pyclipper", "python3-pyclipper")


BUILTINS: dict[str, Factory] = {}
"""name -> factory(context, **params); filled by :func:`register_builtin` in builtin.py
and ocr.py."""


def register_builtin(name: str) -> Callable[[Factory], Factory]:
    """Register a built-in processor factory under ``name`` (explicit, no scanning)."""
    def register(factory: Factory) -> Factory:
        if name in BUILTINS:
            raise RuntimeError(f"built-in processor {name!r} registered twice")
        BUILTINS[name] = factory
        return factory
    return register


class ProcessorRegistry:
    """Built-in processors plus the user processors found in a directory.

    Args:
        strict: who may have written a user file for it to be imported (``[security]
            strict_modes``).
        remote: builds every step in the processors worker (None: here); the
            registry then imports neither the built-ins nor a user file.
    """

    def __init__(self, strict: StrictModes = STRICT,
                 remote: RemoteBuilder | None = None) -> None:
        if remote is None:
            _import_builtins()
        self._user: dict[str, tuple[Callable[..., Step], Path]] = {}
        self._strict = strict
        self.remote = remote

    def names(self) -> list[str]:
        return sorted(set(BUILTINS) | set(self._user))

    def load_directory(self, directory: str | Path) -> list[str]:
        """Load every ``*.py`` file in ``directory``; returns the names registered.

        A missing directory is not an error (nothing to load); every failing file is
        logged once and skipped.
        """
        root = Path(directory)
        if not root.is_dir():
            log.info("processors directory %s does not exist; no user processors", root)
            return []
        added: list[str] = []
        for path in sorted(root.glob("*.py")):
            added += self._load_file(path, root)
        return added

    def _load_file(self, path: Path, root: Path) -> list[str]:
        def skip(stage: str, reason: str) -> list[str]:
            log.warning("processor file %s skipped at %s: %s", path, stage, reason,
                        extra={"PLUGIN_PATH": str(path), "STAGE": stage})
            return []

        try:
            self._strict.check(path, root)
        except UntrustedCode as e:
            return skip("import", e.message)
        except OSError as e:
            return skip("import", f"cannot read it: {e.strerror}")
        try:
            module = import_file(path, f"inferd_user_processors.{path.stem}")
        except ImportFailed as e:  # contained: a user file must not stop the daemon
            return skip("import", str(e).removeprefix("import raised "))
        table = getattr(module, "PROCESSORS", None)
        if not isinstance(table, Mapping):
            return skip("contract", "it defines no PROCESSORS dict (name -> factory)")
        bad = [n for n, f in table.items() if not isinstance(n, str) or not callable(f)]
        if bad:
            return skip("contract", f"PROCESSORS entries {bad!r} are not name -> callable")
        clash = [n for n in table if n in BUILTINS or n in self._user]
        if clash:
            return skip("register", f"names {clash} are already registered")
        for name, factory in table.items():
            self._user[name] = (factory, path)
        log.info("processor file %s: registered %s", path, ", ".join(table),
                 extra={"PLUGIN_PATH": str(path)})
        return list(table)

    def build(self, spec: Any, context: Context, where: str) -> Step:
        """Build one step from its table (``{op = "name", ...params}``).

        Raises:
            ModelError (INVALID_ARGUMENT): unknown name (listing those available), or
                parameters the processor refuses.
        """
        if not isinstance(spec, Mapping) or not isinstance(spec.get("op"), str):
            raise ModelError(f"{where}: a step is a table with 'op' = processor name, got "
                             f"{spec!r}", ErrorCode.INVALID_ARGUMENT)
        params = {k: v for k, v in spec.items() if k != "op"}
        name = spec["op"]
        if self.remote is not None:
            return self.remote.build(name, params, context, where)
        return self.build_here(name, params, context, where)

    def builtin(self, name: str) -> bool:
        """Whether ``name`` is a built-in processor (no user file is needed for it)."""
        return name in BUILTINS

    def build_here(self, name: str, params: dict[str, Any], context: Context,
                   where: str) -> Step:
        """:meth:`build` in this process, whatever ``remote`` says (the processors
        worker's way)."""
        try:
            if name in BUILTINS:
                return BUILTINS[name](context, **params)
            if name in self._user:
                return _wrap_user(name, self._user[name][0](**params))
        except ModelError as e:
            raise ModelError(f"{where}: processor {name}: {e.message}", e.code) from e
        except (TypeError, ValueError, KeyError) as e:
            raise ModelError(f"{where}: processor {name} refused its parameters {params}: "
                             f"{e}", ErrorCode.INVALID_ARGUMENT) from e
        raise ModelError(f"{where}: unknown processor {name!r}; available: "
                         f"{', '.join(self.names())}", ErrorCode.INVALID_ARGUMENT)


def _wrap_user(name: str, step: Any) -> Step:
    if not callable(step):
        raise ModelError(f"user processor {name}: its factory returned {type(step).__name__},"
                         f" not a callable", ErrorCode.INVALID_ARGUMENT)

    def run(values: Values) -> Values:
        out = step(values)
        if not isinstance(out, dict):
            raise ModelError(f"user processor {name} returned {type(out).__name__}, not a "
                             f"dict of named values", ErrorCode.INTERNAL)
        return out
    return run


def run_steps(steps: list[tuple[str, Step]], values: Values, owner: str) -> Values:
    """Run ``steps`` in order; a failure names the owner and the step."""
    for name, step in steps:
        try:
            values = step(values)
        except InferdError as e:  # its code kept (a processors worker's death: UNAVAILABLE)
            raise ModelError(f"{owner}: step {name}: {e.message}", e.code) from e
        except Exception as e:
            raise ModelError(f"{owner}: step {name} failed: {type(e).__name__}: {e}",
                             ErrorCode.INVALID_ARGUMENT) from e
    return values


def _import_builtins() -> None:
    # Imported for their registrations; kept out of module import so that a broken
    # optional dependency (cv2) only matters to the OCR steps.
    from inferd.daemon.processors import builtin, ocr  # noqa: F401
