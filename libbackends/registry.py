"""The backend registry: which backends this runtime has, their status, and the choice
of a backend for a model. One registry per runtime object; no module-level state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from inferd.ipc.errors import BackendError, ErrorCode
from inferd.libbackends.contract import Backend, DeviceKind

log = logging.getLogger(__name__)

# Default preference when a model names none: the most specialised device first.
KIND_ORDER = (DeviceKind.NPU, DeviceKind.GPU, DeviceKind.CPU)


class Status(StrEnum):
    REGISTERED = "registered"
    UNAVAILABLE = "unavailable"


@dataclass
class BackendRecord:
    """One backend known to the registry, usable or not, and why."""

    backend: Backend
    source: str
    status: Status
    reason: str = ""
    devices: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        b = self.backend
        return {"id": b.id, "version": b.version, "kind": str(b.kind),
                "api_version": list(b.api_version), "source": self.source,
                "status": str(self.status), "reason": self.reason,
                "devices": list(self.devices)}


@dataclass
class Registry:
    """Backends of one runtime, in registration order."""

    records: dict[str, BackendRecord] = field(default_factory=dict)

    def register(self, backend: Backend, source: str = "built-in") -> BackendRecord:
        """Probe ``backend`` and record it. Raises BackendError if its id is taken."""
        if backend.id in self.records:
            raise BackendError(f"backend id {backend.id!r} is already registered by "
                               f"{self.records[backend.id].source}")
        probe = backend.probe()
        status = Status.REGISTERED if probe.available else Status.UNAVAILABLE
        record = BackendRecord(backend, source, status, probe.reason, probe.devices)
        self.records[backend.id] = record
        if probe.available:
            log.info("backend %s %s registered (%s, devices %s)", backend.id,
                     backend.version, backend.kind, ", ".join(probe.devices) or "-",
                     extra={"BACKEND": backend.id})
        else:
            log.warning("backend %s is unavailable: %s", backend.id, probe.reason,
                        extra={"BACKEND": backend.id})
        return record

    def available(self) -> list[Backend]:
        return [r.backend for r in self.records.values() if r.status is Status.REGISTERED]

    def choose(self, model: str, path: Path, preference: list[str] | None = None) -> Backend:
        """The backend to run ``model``: the first entry of ``preference`` (backend ids
        or device kinds) that is available and supports the file; by default the most
        specialised available kind. Each skipped choice is logged with its reason.

        Raises:
            BackendError (UNAVAILABLE): no backend can run the model; the message lists
                every candidate and why it was passed over.
        """
        choices = preference or [str(k) for k in KIND_ORDER]
        reasons: list[str] = []
        for choice in choices:
            candidates = [r for r in self.records.values()
                          if r.backend.id == choice or str(r.backend.kind) == choice]
            if not candidates:
                if preference:  # only a choice someone made is worth a reason
                    reasons.append(f"{choice}: no such backend")
                continue
            for record in candidates:
                b = record.backend
                if record.status is not Status.REGISTERED:
                    reasons.append(f"{b.id}: {record.status} ({record.reason})")
                    continue
                ok, why = b.supports(path)
                if ok:
                    for r in reasons:
                        log.info("model %s: passed over %s", model, r,
                                 extra={"MODEL": model})
                    return b
                reasons.append(f"{b.id}: does not support the model ({why})")
        raise BackendError(f"model {model}: no backend can run it: {'; '.join(reasons)}",
                           ErrorCode.UNAVAILABLE)

    def describe(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records.values()]
