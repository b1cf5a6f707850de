"""The placement decisions the daemon measured, kept under its state directory so that a
restart does not measure again.

One decision per model version: the backend (and thread count) that served it fastest,
the figures that chose it and why other candidates were not chosen. It is valid for one
:class:`DecisionKey`: the model file's SHA-256, the candidate backends with their
versions, the CPU model and the cores the daemon may use, and the model.toml settings
that change what a candidate runs (its backend tables, ``threads``). When any of these
changes, the decision is measured again; ``inferctl reload --remeasure`` forgets it.

The file is ``<directory>/decisions.json``, written whole (a temporary file renamed over
it); ``[placement] directory`` names the directory, by default ``placement/`` in
``$STATE_DIRECTORY`` (systemd's ``StateDirectory=inferd/state``:
``/var/lib/inferd/state/placement``). Without
one, decisions live only as long as the process. A file that cannot be read or written
is logged once and the decisions stay in memory: measuring again is the only cost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "decisions.json"
FORMAT = 1
"""Version of the file's layout; a file of another format is ignored (and replaced)."""


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a model file (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model as the kernel names it (x86 ``model name``; on Arm the
    ``Hardware`` line or the implementer/part numbers), else the machine type."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Hardware", "Model"):
        if fields.get(key):
            return fields[key]
    parts = [f"{k} {fields[k]}" for k in ("CPU implementer", "CPU part") if fields.get(k)]
    return ", ".join(parts) or platform.machine() or "unknown"


@dataclass(frozen=True)
class DecisionKey:
    """What a decision is valid for (see the module docstring)."""

    model_sha256: str
    backends: tuple[str, ...]
    """``id version kind`` of each candidate, in the plan's order."""
    cpu: str
    cores: int
    settings: str
    """The model.toml settings that change what a candidate runs, as sorted JSON."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "backends": list(self.backends)}

    def differences(self, other: DecisionKey) -> list[str]:
        """What changed from ``other`` to this key, in words (for the journal)."""
        said = {"model_sha256": "the model file", "backends": "the backends",
                "cpu": "the CPU model", "cores": "the cores", "settings": "model.toml"}
        return [said[k] for k in said if getattr(self, k) != getattr(other, k)]


@dataclass(frozen=True)
class Decision:
    """Where a model runs fastest on this machine, and the figures that say so.

    Attributes:
        backend: the chosen backend id.
        kind: its device kind.
        threads: the engine's thread count chosen with it (None: the backend's own).
        times_ms: each candidate that ran correctly, by label (``"openvino"``,
            ``"openvino (2 threads)"``), with its milliseconds per run.
        rejected: each candidate that was not timed or cannot be chosen, with why.
        inputs: the input shapes it was measured on (``"x=1x3x48x192"``).
        measured_at: when (seconds since the epoch).
        note: how the threads were chosen (a graph's stage), or "".
    """

    backend: str
    kind: str
    threads: int | None = None
    times_ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    measured_at: float = 0.0
    note: str = ""

    @property
    def label(self) -> str:
        return candidate_label(self.backend, self.threads)

    def text(self) -> str:
        """``openvino, 0.38 ms vs onnxruntime 0.49 ms (measured)``."""
        others = [f"{label} {ms:.2f} ms" for label, ms in
                  sorted(self.times_ms.items(), key=lambda kv: kv[1]) if label != self.label]
        mine = self.times_ms.get(self.label)
        head = self.label + (f", {mine:.2f} ms" if mine is not None else "")
        tail = (" vs " + ", ".join(others)) if others else ""
        rejected = "".join(f"; not chosen: {label} ({why})"
                           for label, why in self.rejected.items())
        note = f"; {self.note}" if self.note else ""
        return f"{head}{tail} (measured){note}{rejected}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "inputs": list(self.inputs)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Decision:
        return cls(backend=str(raw["backend"]), kind=str(raw["kind"]),
                   threads=None if raw.get("threads") is None else int(raw["threads"]),
                   times_ms={str(k): float(v) for k, v in raw.get("times_ms", {}).items()},
                   rejected={str(k): str(v) for k, v in raw.get("rejected", {}).items()},
                   inputs=tuple(str(s) for s in raw.get("inputs", ())),
                   measured_at=float(raw.get("measured_at", 0.0)),
                   note=str(raw.get("note", "")))


def candidate_label(backend: str, threads: int | None) -> str:
    """How a candidate is named in figures: ``openvino`` or ``openvino (2 threads)``."""
    return backend if not threads or threads == 1 else f"{backend} ({threads} threads)"


class DecisionStore:
    """The decisions of this machine, by (model, version), kept in ``directory``.

    Args:
        directory: where ``decisions.json`` lives; None keeps decisions in memory only.
    """

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._warned = False
        if directory is not None:
            self._entries = self._read(directory / FILE_NAME)

    @property
    def path(self) -> Path | None:
        return self.directory / FILE_NAME if self.directory is not None else None

    @staticmethod
    def _name(model: str, version: int) -> str:
        return f"{model}/{version}"

    def _read(self, path: Path) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, ValueError) as e:
            log.warning("placement decisions in %s cannot be read (%s): measuring again",
                        path, getattr(e, "strerror", None) or e)
            return {}
        if not isinstance(raw, dict) or raw.get("format") != FORMAT \
                or not isinstance(raw.get("decisions"), dict):
            log.warning("placement decisions in %s are not of format %d: measuring again",
                        path, FORMAT)
            return {}
        return {k: v for k, v in raw["decisions"].items() if isinstance(v, dict)}

    def get(self, model: str, version: int, key: DecisionKey) -> Decision | None:
        """The decision for ``model`` ``version`` if it was made for ``key``; None if
        there is none or it was made for another key (logged: what changed)."""
        with self._lock:
            entry = self._entries.get(self._name(model, version))
        if entry is None:
            return None
        try:
            old = DecisionKey(**{**entry["key"], "backends": tuple(entry["key"]["backends"])})
            decision = Decision.from_json(entry["decision"])
        except (KeyError, TypeError, ValueError) as e:
            log.warning("model %s version %d: stored placement decision is unusable (%s): "
                        "measuring again", model, version, e, extra={"MODEL": model})
            return None
        if old != key:
            log.info("model %s version %d: placement measured again: %s changed since it "
                     "was measured", model, version, " and ".join(key.differences(old)),
                     extra={"MODEL": model})
            return None
        return decision

    def put(self, model: str, version: int, key: DecisionKey, decision: Decision) -> None:
        """Keep ``decision`` for ``key`` (and write the file, if there is a directory)."""
        with self._lock:
            self._entries[self._name(model, version)] = {"key": key.to_json(),
                                                          "decision": decision.to_json()}
            self._write()

    def forget(self, model: str | None = None) -> list[str]:
        """Drop the decisions of ``model`` (every version), or of every model; the
        ``model/version`` names dropped."""
        with self._lock:
            names = [n for n in self._entries
                     if model is None or n.rsplit("/", 1)[0] == model]
            for n in names:
                del self._entries[n]
            if names:
                self._write()
        return names

    def _write(self) -> None:
        """Write every decision (caller holds the lock); a failure is logged once."""
        path = self.path
        if path is None:
            return
        tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        body = json.dumps({"format": FORMAT, "written_at": time.time(),
                           "decisions": self._entries}, indent=1, sort_keys=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(body + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("placement decisions cannot be written to %s (%s): they are "
                            "kept until the daemon stops, and measured again after",
                            path, e.strerror)
            try:
                tmp.unlink()
            except OSError:
                pass
