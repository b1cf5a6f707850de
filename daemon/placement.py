"""Placement of a model on a backend and device: the first of its plan that loads, then,
where several backends could run it on that device kind, the one measured fastest.

The registry's plan (:meth:`inferd.libbackends.registry.Registry.plan`) lists every
(backend, device kind) the model's ``backends = [...]`` allows, best first. A load that
fails there (the device is absent, the engine refuses the file) is logged with the
engine's reason and the next entry is tried; the first that loads serves the model.

With ``placement = "measured"`` (model.toml, else ``[placement] mode``; the default),
when the plan holds more than one backend of the kind that loaded, the placer
(:mod:`inferd.daemon.placer`) measures them while the model serves: each candidate is
loaded beside it (in a worker process of its own, where the daemon runs workers: then
run on the model's warm-up inputs, right after its load; in-process, on the inputs its
first requests brought, only those the serving engine answered), checked against the
reference backend (the plan's first) and timed (:mod:`inferd.daemon.measure`); the fastest
correct one takes over between two runs (:mod:`inferd.daemon.placed_model`). Within a
graph, the slowest stage is given the cores the others leave idle, where that measures
faster. The decision is kept under the state directory (:mod:`inferd.daemon.decisions`),
so the next load goes straight to the winner. ``placement = "first"`` keeps the first that loads.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from inferd.ipc.errors import BackendError, ErrorCode, InferdError
from inferd.libbackends.contract import DeviceKind, LoadedModel, LoadOptions
from inferd.libbackends.registry import Choice
from inferd.libbackends.trust import UntrustedCode

log = logging.getLogger(__name__)

class Load(Protocol):
    """Loads a model on one choice with the given options; ``rival=True``: a candidate
    being measured, loaded where its crash costs only itself (its own worker process,
    where the daemon runs workers)."""

    def __call__(self, choice: Choice, options: LoadOptions, /, *,
                 rival: bool = False) -> LoadedModel: ...


class Mode(StrEnum):
    """model.toml ``placement`` and ``[placement] mode``."""

    MEASURED = "measured"
    FIRST = "first"


class Status(StrEnum):
    """How the placement in force was reached (shown by ``inferctl models -v``)."""

    FIRST = "first"          # the first that loads; nothing else to measure, or "first"
    MEASURING = "measuring"  # the first that loads serves while the others are measured
    MEASURED = "measured"    # the measured winner serves
    KEPT = "kept"            # the winner of an earlier measurement (decisions.json)


class ModelPlacement:
    """Where a loaded model runs and why. Placement code changes it (:meth:`moved`,
    :meth:`settled`) when measuring moves the model; readers see one consistent state.
    """

    def __init__(self, backend: str, kind: DeviceKind, device: str, why: str,
                 threads: int | None = None, status: Status = Status.FIRST) -> None:
        self._lock = threading.Lock()
        self.backend, self.kind, self.device = backend, kind, device
        self.why, self.threads, self.status = why, threads, status

    def moved(self, backend: str, kind: DeviceKind, device: str, threads: int | None,
              why: str) -> None:
        """The measured winner now serves the model."""
        with self._lock:
            self.backend, self.kind, self.device = backend, kind, device
            self.threads, self.why, self.status = threads, why, Status.MEASURED

    def settled(self, status: Status, why: str) -> None:
        """The placement stays where it is, now for ``why``."""
        with self._lock:
            self.status, self.why = status, why

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {"backend": self.backend, "kind": str(self.kind), "device": self.device,
                    "why": self.why, "threads": self.threads, "status": str(self.status)}


class Room(Protocol):
    """What measuring needs of the cache's memory budget
    (:class:`~inferd.daemon.budget.MemoryBudget`)."""

    def measured(self, key: tuple[str, int]) -> int | None:
        """What the model version cost at its last load, if known."""

    def reserve(self, label: str, need: int, runs_here: bool = True
                ) -> AbstractContextManager[None]:
        """Count ``need`` bytes as used while the block runs; raise InferdError
        (RESOURCE_EXHAUSTED) at once if they do not fit (evicting nothing).
        ``runs_here``: what the block loads and runs is in the daemon's own process (a
        model's run measured meanwhile is then not measured alone)."""

    def recost(self, entry: Any, figures: Any) -> None:
        """``entry``'s engine changed: it counts ``figures`` (a LoadFigures) now."""

    def engines(self) -> dict[str, int]:
        """What importing each engine added (counted as the engine's, not a model's)."""

    def entries(self) -> list[Any]:
        """The cache's entries (each a ModelEntry: its loaded model, its contest)."""


def backend_options(config: Any, settings: Any, backend_id: str) -> dict[str, Any]:
    """The backend's own settings for one model: the config file's section named after
    the backend id (where the daemon has one, e.g. ``[openvino]``), overridden key by
    key by the model.toml table of that name (``settings``: the model's
    :class:`~inferd.daemon.model_settings.ModelSettings`)."""
    section = getattr(config, backend_id.replace("-", "_"), None)
    base = dict(vars(section)) if section is not None else {}
    return {**base, **settings.backend_options(backend_id)}


def load_options(choice: Choice, settings: Any, config: Any,
                 threads: int | None) -> LoadOptions:
    """What one load on ``choice`` is asked: the ``[onnxruntime]`` thread settings, the
    backend's own options, the device kind, and ``threads`` when the placement chose
    the model's engine threads (model.toml ``threads``, or measured)."""
    ort = config.onnxruntime
    return LoadOptions(threads or ort.intra_op_threads, ort.inter_op_threads,
                       ort.allow_spinning,
                       options=backend_options(config, settings, choice.backend.id),
                       kind=choice.kind, threads=threads)


def place(model: str, plan: list[Choice], settings: Any, config: Any, load: Load,
          threads: int | None = None, rival: bool = False
          ) -> tuple[ModelPlacement, LoadedModel]:
    """Load ``model`` on the first entry of ``plan`` that loads.

    Args:
        model: the model's name, for messages.
        plan: the registry's plan, best first (never empty).
        settings: the model's checked model.toml (ModelSettings).
        config: the daemon's config (``[onnxruntime]`` threads, backend sections).
        load: loads on one choice with the given options.
        threads: the engine threads to ask for (None: each backend's own setting).
        rival: a candidate being measured (``load`` is asked for an isolated one).

    Returns:
        The placement and the loaded model.

    Raises:
        InferdError: the only choice failed (its own error), or every choice failed
            (the first one's message, then each other backend's reason; their code if
            they agree, else UNAVAILABLE).
    """
    failures: list[tuple[Choice, InferdError]] = []
    for choice in plan:
        b = choice.backend
        try:
            options = load_options(choice, settings, config, threads)
            loaded = load(choice, options, rival=True) if rival else load(choice, options)
        except UntrustedCode:
            raise  # the model's own code, refused whatever the backend: not a fallback
        except Exception as e:  # noqa: BLE001  a plugin's failure: contained here, once
            err = e if isinstance(e, InferdError) else InferdError(
                f"backend {b.id} load() raised {type(e).__name__}: {e}")
            failures.append((choice, err))
            log.warning("model %s: backend %s (%s) failed to load it: %s", model, b.id,
                        choice.kind, err.message,
                        extra={"MODEL": model, "BACKEND": b.id, "CODE": str(err.code)})
            continue
        device = getattr(loaded, "device", "") or str(choice.kind).upper()
        why = choice.why
        skipped = [f"{c.backend.id} ({c.kind}): {e.message}" for c, e in failures]
        if skipped or choice.passed_over:
            why += "; passed over: " + "; ".join([*choice.passed_over, *skipped])
        return ModelPlacement(b.id, choice.kind, device, why, threads), loaded
    first = failures[0][1]
    if len(failures) == 1:
        raise first
    codes = {e.code for _, e in failures}
    raise BackendError(f"{first.message}; the other choices failed too: " + "; ".join(
        f"{c.backend.id} ({c.kind}): {e.message}" for c, e in failures[1:]),
        codes.pop() if len(codes) == 1 else ErrorCode.UNAVAILABLE)


def rivals(plan: list[Choice], kind: DeviceKind) -> list[Choice]:
    """The plan's entries of ``kind``, one per backend, in plan order: what measuring
    compares (another device kind is a choice the preference list made, not a race)."""
    out: list[Choice] = []
    for c in plan:
        if c.kind is kind and all(o.backend.id != c.backend.id for o in out):
            out.append(c)
    return out


def set_threads(settings: Any) -> int | None:
    """The engine threads model.toml fixes: ``threads``, else None."""
    return getattr(settings, "threads", None)


def threads_fixed(settings: Any, backend_ids: list[str]) -> bool:
    """Whether model.toml fixes the model's threads (``threads``, or a thread key in a
    candidate's own table): then measuring does not choose them."""
    if set_threads(settings) is not None:
        return True
    keys = ("threads", "intra_op_threads")
    return any(k in settings.backend_options(b) for b in backend_ids for k in keys)


def state_directory(config: Any) -> Path | None:
    """Where decisions are kept: ``[placement] directory``, else ``placement/`` in
    ``$STATE_DIRECTORY`` (set by the unit's ``StateDirectory=inferd/state``), else None
    (kept in memory only: a daemon run by hand measures again at each start)."""
    configured = config.placement.directory
    if configured:
        return Path(configured)
    env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(env) / "placement" if env else None
