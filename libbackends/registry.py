"""The backend registry: which backends this runtime has, every plugin candidate the
loader looked at (and where it stopped), and the choice of a backend for a model.

One registry per runtime object; no module-level state, so several runtimes in one
process each hold their own backends, even when they load the same plugin directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from inferd.ipc.errors import BackendError, ErrorCode
from inferd.libbackends.contract import API_VERSION, Backend, DeviceKind, Probe

log = logging.getLogger(__name__)

# Default preference when a model names none: the most specialised device first.
KIND_ORDER = (DeviceKind.NPU, DeviceKind.GPU, DeviceKind.CPU)


class Status(StrEnum):
    """Status of a backend in the registry."""

    REGISTERED = "registered"
    UNAVAILABLE = "unavailable"


class Stage(StrEnum):
    """The stages every plugin candidate goes through, in order."""

    FOUND = "found"
    OPENED = "opened"
    CONTRACT_CHECKED = "contract checked"
    PROBED = "probed"
    REGISTERED = "registered"


class Form(StrEnum):
    """What a candidate is."""

    PYTHON = "python"
    NATIVE = "native"
    BUILTIN = "built-in"


class CandidateStatus(StrEnum):
    """Outcome of one candidate."""

    REGISTERED = "registered"    # usable
    UNAVAILABLE = "unavailable"  # registered, but its probe says the device is absent
    FAILED = "failed"            # a stage failed; skipped (WARNING logged)
    SKIPPED = "skipped"          # a second name for a file already looked at
    IGNORED = "ignored"          # looks like a plugin but is not named like one


class CandidateError(Exception):
    """A candidate failed a stage; raised by the loader's stage functions."""

    def __init__(self, stage: Stage, reason: str, backend: str | None = None) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason
        self.backend = backend


@dataclass
class Candidate:
    """One thing the loader looked at: a file, a directory, or a built-in backend.

    ``stage`` is where it stopped: the stage that failed, or ``registered``.
    """

    path: str
    form: Form
    stage: Stage = Stage.FOUND
    status: CandidateStatus = CandidateStatus.FAILED
    reason: str = ""
    backend: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "form": str(self.form), "stage": str(self.stage),
                "status": str(self.status), "reason": self.reason, "backend": self.backend}


@dataclass
class BackendRecord:
    """One backend known to the registry, usable or not, and why."""

    backend: Backend
    source: str
    status: Status
    reason: str = ""
    devices: tuple[str, ...] = ()
    kinds: tuple[DeviceKind, ...] = ()

    def to_json(self) -> dict[str, Any]:
        b = self.backend
        return {"id": b.id, "version": b.version, "kind": str(b.kind),
                "kinds": [str(k) for k in self.kinds],
                "api_version": list(getattr(b, "api_version", API_VERSION)),
                "source": self.source,
                "status": str(self.status), "reason": self.reason,
                "devices": list(self.devices)}


@dataclass(frozen=True)
class Choice:
    """One way to place a model: a backend, the device kind asked of it, why it is in
    the plan (which preference entry named it) and what was passed over before it."""

    backend: Backend
    kind: DeviceKind
    why: str
    passed_over: tuple[str, ...] = ()


@dataclass
class Registry:
    """Backends of one runtime, in registration order, plus the loader's findings."""

    records: dict[str, BackendRecord] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    search_path: list[str] = field(default_factory=list)
    search_path_source: str = ""

    def register(self, backend: Backend, source: str = "built-in",
                 probe: Probe | None = None) -> BackendRecord:
        """Record ``backend`` with its probe result (probing it if none is given).

        Raises:
            BackendError: its id is already taken; the message names who took it.
        """
        taken = self.records.get(backend.id)
        if taken is not None:
            raise BackendError(f"id {backend.id!r} already registered by {taken.source}")
        if probe is None:
            probe = backend.probe()
        status = Status.REGISTERED if probe.available else Status.UNAVAILABLE
        kinds = tuple(DeviceKind(k) for k in probe.kinds) or (backend.kind,)
        record = BackendRecord(backend, source, status, probe.reason, tuple(probe.devices),
                               kinds)
        self.records[backend.id] = record
        if probe.available:
            log.info("backend %s %s registered from %s (%s, devices %s)", backend.id,
                     backend.version, source, ", ".join(map(str, kinds)),
                     ", ".join(probe.devices) or "-", extra={"BACKEND": backend.id})
        return record

    def available(self) -> list[Backend]:
        return [r.backend for r in self.records.values() if r.status is Status.REGISTERED]

    def choose(self, model: str, path: Path, preference: list[str] | None = None) -> Backend:
        """The backend to run ``model``: the first of :meth:`plan`.

        Raises:
            BackendError (UNAVAILABLE): no backend can run the model (see :meth:`plan`).
        """
        first = self.plan(model, path, preference)[0]
        log.info("model %s: backend %s chosen (%s)", model, first.backend.id, first.why,
                 extra={"MODEL": model, "BACKEND": first.backend.id})
        return first.backend

    def plan(self, model: str, path: Path, preference: list[str] | None = None
             ) -> list[Choice]:
        """Every (backend, device kind) that may run ``model``, best first: for each
        entry of ``preference`` (backend ids or device kinds; by default the most
        specialised kind first), the registered backends it names that drive that kind
        and whose ``supports()`` accepts the file. The daemon loads the first and falls
        back along the rest when a load fails. Each choice passed over here is logged
        (INFO) with its reason.

        Raises:
            BackendError (UNAVAILABLE): no backend can run the model; the message lists
                every candidate and why it was passed over.
        """
        choices = preference or [str(k) for k in KIND_ORDER]
        reasons: list[str] = []
        plan: list[Choice] = []
        for n, choice in enumerate(choices):
            matches = [r for r in self.records.values()
                       if r.backend.id == choice or choice in r.kinds
                       or str(r.backend.kind) == choice]
            if not matches and not (preference and choice in set(DeviceKind)):
                if preference:  # only a choice someone made is worth a reason
                    known = ", ".join(self.records) or "none"
                    self._skip(model, choice, f"no such backend id or kind "
                                              f"(backends: {known})", reasons)
                continue
            kind_notes = "; ".join(  # why the other backends found no device of this kind
                f"{r.backend.id}: {r.reason}" for r in self.records.values()
                if r not in matches and r.status is Status.REGISTERED and r.reason
            ) if preference and choice in set(DeviceKind) else ""
            where = f"entry {n + 1} ({choice!r}) of " + (
                f"model.toml backends = {choices}" if preference
                else f"the default preference {choices}")
            for record in matches:
                b = record.backend
                if record.status is not Status.REGISTERED:
                    self._skip(model, b.id, f"{record.status} ({record.reason})", reasons)
                    continue
                if b.id == choice:  # the id alone: its most specialised kind found
                    kind = next(k for k in KIND_ORDER if k in record.kinds)
                elif choice in record.kinds:
                    kind = DeviceKind(choice)
                else:
                    self._skip(model, b.id, f"{record.status}, but no {choice} device "
                                            f"found (it found "
                                            f"{', '.join(map(str, record.kinds))})", reasons)
                    continue
                if any(c.backend is b and c.kind is kind for c in plan):
                    continue
                try:
                    ok, why = b.supports(path)
                except Exception as e:  # noqa: BLE001  a plugin's bug must not break a choice
                    ok, why = False, f"supports() raised {type(e).__name__}: {e}"
                if ok:
                    plan.append(Choice(b, kind, where, tuple(reasons)))
                else:
                    self._skip(model, b.id, f"does not support the model ({why})", reasons)
            if (kind_notes or not matches) and not any(c.kind == choice for c in plan):
                # a device kind no backend found: the registered backends' probe notes
                # say why (ncnn: "gpu placement off: no Vulkan driver answered")
                self._skip(model, choice, f"no backend found a {choice} device"
                                          f"{f' ({kind_notes})' if kind_notes else ''}",
                           reasons)
        if not plan:
            raise BackendError(f"model {model}: no backend can run it (preference "
                               f"{choices}): {'; '.join(reasons) or 'no backends registered'}",
                               ErrorCode.UNAVAILABLE)
        return plan

    @staticmethod
    def _skip(model: str, choice: str, why: str, reasons: list[str]) -> None:
        log.info("model %s: passed over backend %s: %s", model, choice, why,
                 extra={"MODEL": model, "BACKEND": choice})
        reasons.append(f"{choice}: {why}")

    def describe(self) -> list[dict[str, Any]]:
        """Every backend (registered or unavailable), as JSON."""
        return [r.to_json() for r in self.records.values()]

    def view(self) -> dict[str, Any]:
        """The troubleshooting view answered to the ``backends`` op."""
        return {"backends": self.describe(),
                "candidates": [c.to_json() for c in self.candidates],
                "search_path": list(self.search_path),
                "search_path_source": self.search_path_source}
