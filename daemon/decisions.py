"""The placement decisions the daemon measured, kept under its state directory so that a
restart does not measure again.

One decision per model version: the backend (and thread count) that served it fastest,
the figures that chose it and why other candidates were not chosen. It is valid for one
:class:`DecisionKey`: the model file's SHA-256, the candidate backends with their
versions, the CPU model and the cores the daemon may use, and the model.toml settings
that change what a candidate runs (its backend tables, ``threads``). When any of these
changes, the decision is measured again; ``inferctl reload --remeasure`` forgets it.

The file is ``<directory>/decisions.json``, written whole as the metrics textfile is (a
temporary file created exclusively beside it, then renamed over it: never through a
planted link, :func:`inferd.ipc.runfiles.replace_file`); ``[placement] directory`` names
the directory, by default ``placement/`` in ``$STATE_DIRECTORY`` (systemd's
``StateDirectory=inferd/state``: ``/var/lib/inferd/state/placement``). Without one,
decisions live only as long as the process.

The file is read as untrusted bytes: opened without following a link and without
blocking, only if it is a regular file, at most :data:`MAX_BYTES`, and checked against
its schema (every field of every entry, its type included) before anything uses it. A
file that fails any of these is logged once, set aside as ``decisions.json.bad`` and
its models measured again: never a failed start, a hang, a balloon or a failed load. A
file that cannot be read or written is logged once and the decisions stay in memory:
measuring again is the only cost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inferd.ipc.runfiles import UnsafePath, check_directory, replace_file

log = logging.getLogger(__name__)

FILE_NAME = "decisions.json"
BAD_SUFFIX = ".bad"
"""A file that is not a decisions file is renamed ``decisions.json.bad`` (kept to look at)."""
FORMAT = 1
"""Version of the file's layout; a file of another format is set aside like a bad one."""
MAX_BYTES = 4 * 2**20
"""The largest file read (a decision takes about 700 bytes: room for some 6,000)."""


class BadFile(ValueError):
    """The decisions file is not one this daemon wrote: why, in words."""


def _field(raw: dict[str, Any], name: str, kinds: type | tuple[type, ...],
           default: Any = None, required: bool = False) -> Any:
    """``raw[name]`` if it is of ``kinds`` (never a bool for a number), else BadFile."""
    if name not in raw:
        if required:
            raise BadFile(f"{name!r} is missing")
        return default
    value = raw[name]
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple)
                                                else (kinds,)):
        raise BadFile(f"{name!r} is {value!r}, not a number")
    if not isinstance(value, kinds):
        raise BadFile(f"{name!r} is a {type(value).__name__}")
    return value


def _strings(raw: dict[str, Any], name: str) -> list[str]:
    value = _field(raw, name, list, [])
    if not all(isinstance(v, str) for v in value):
        raise BadFile(f"{name!r} holds something other than strings")
    return value


def _table(raw: dict[str, Any], name: str, kinds: type | tuple[type, ...],
           what: str) -> dict[str, Any]:
    value = _field(raw, name, dict, {})
    if not all(isinstance(v, kinds) and not isinstance(v, bool) for v in value.values()):
        raise BadFile(f"{name!r} holds a value that is not {what}")
    return value


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

    @classmethod
    def from_json(cls, raw: Any) -> DecisionKey:
        """The key ``to_json`` wrote.

        Raises:
            BadFile: ``raw`` is not such a key (a field missing or of another type).
        """
        if not isinstance(raw, dict):
            raise BadFile("a key is not a table")
        unknown = set(raw) - {"model_sha256", "backends", "cpu", "cores", "settings"}
        if unknown:
            raise BadFile(f"a key has unknown fields {sorted(unknown)}")
        if "backends" not in raw:
            raise BadFile("'backends' is missing")
        return cls(model_sha256=_field(raw, "model_sha256", str, required=True),
                   backends=tuple(_strings(raw, "backends")),
                   cpu=_field(raw, "cpu", str, required=True),
                   cores=_field(raw, "cores", int, required=True),
                   settings=_field(raw, "settings", str, required=True))

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
    def from_json(cls, raw: Any) -> Decision:
        """The decision ``to_json`` wrote.

        Raises:
            BadFile: ``raw`` is not such a decision (a field missing or of another type).
        """
        if not isinstance(raw, dict):
            raise BadFile("a decision is not a table")
        threads = _field(raw, "threads", (int, type(None)))
        return cls(backend=_field(raw, "backend", str, required=True),
                   kind=_field(raw, "kind", str, required=True), threads=threads,
                   times_ms={k: float(v) for k, v in
                             _table(raw, "times_ms", (int, float), "a number").items()},
                   rejected=_table(raw, "rejected", str, "a string"),
                   inputs=tuple(_strings(raw, "inputs")),
                   measured_at=float(_field(raw, "measured_at", (int, float), 0.0)),
                   note=_field(raw, "note", str, ""))


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
        self._entries: dict[str, tuple[DecisionKey, Decision]] = {}
        self._warned = False
        if directory is not None:
            self._entries = self._load(directory / FILE_NAME)

    @property
    def path(self) -> Path | None:
        return self.directory / FILE_NAME if self.directory is not None else None

    @staticmethod
    def _name(model: str, version: int) -> str:
        return f"{model}/{version}"

    def _load(self, path: Path) -> dict[str, tuple[DecisionKey, Decision]]:
        """The decisions in ``path``; none if it is absent, cannot be read (logged) or
        is not a decisions file (logged, and set aside as ``decisions.json.bad``)."""
        try:
            return parse(read_bounded(path))
        except FileNotFoundError:
            return {}
        except BadFile as e:
            aside = path.with_name(path.name + BAD_SUFFIX)
            try:
                os.replace(path, aside)  # a link or a FIFO is renamed, not followed
                where = f"set aside as {aside}"
            except OSError as moved:
                where = f"not set aside ({moved.strerror})"
            log.warning("placement decisions in %s are not a decisions file (%s): %s, "
                        "every model is measured again", path, e, where)
        except OSError as e:
            log.warning("placement decisions in %s cannot be read (%s): measuring again",
                        path, e.strerror)
        return {}

    def get(self, model: str, version: int, key: DecisionKey) -> Decision | None:
        """The decision for ``model`` ``version`` if it was made for ``key``; None if
        there is none or it was made for another key (logged: what changed)."""
        with self._lock:
            entry = self._entries.get(self._name(model, version))
        if entry is None:
            return None
        old, decision = entry
        if old != key:
            log.info("model %s version %d: placement measured again: %s changed since it "
                     "was measured", model, version, " and ".join(key.differences(old)),
                     extra={"MODEL": model})
            return None
        return decision

    def put(self, model: str, version: int, key: DecisionKey, decision: Decision) -> None:
        """Keep ``decision`` for ``key`` (and write the file, if there is a directory)."""
        with self._lock:
            self._entries[self._name(model, version)] = (key, decision)
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
        body = json.dumps({"format": FORMAT, "written_at": time.time(),
                           "decisions": {name: {"key": key.to_json(),
                                                "decision": decision.to_json()}
                                         for name, (key, decision) in self._entries.items()}},
                          indent=1, sort_keys=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            check_directory(path)
            replace_file(path, body + "\n")
        except (OSError, UnsafePath) as e:
            if not self._warned:
                self._warned = True
                log.warning("placement decisions cannot be written to %s (%s): they are "
                            "kept until the daemon stops, and measured again after",
                            path, e.message if isinstance(e, UnsafePath) else e.strerror)


def read_bounded(path: Path, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file ``path``, read without following a link or
    blocking on a FIFO or device, and at most ``limit`` of them.

    Raises:
        FileNotFoundError: there is no such file.
        BadFile: it is a symbolic link, not a regular file, or larger than ``limit``.
        OSError: it cannot be read.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.path.islink(path):  # ELOOP: O_NOFOLLOW met a link
            raise BadFile("it is a symbolic link (not followed)") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile("it is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # the size may change after fstat: read to the bound only
            chunk = os.read(fd, min(2**20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise BadFile(f"it is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse(data: bytes) -> dict[str, tuple[DecisionKey, Decision]]:
    """The decisions in a file's bytes, by ``model/version``, every field checked.

    Raises:
        BadFile: it is not JSON (nested too deep included), not of :data:`FORMAT`, or an
            entry is not a key and a decision of the right types.
    """
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        kind = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise BadFile(f"not JSON: {kind}") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise BadFile(f"not of format {FORMAT}")
    decisions = raw.get("decisions")
    if not isinstance(decisions, dict):
        raise BadFile("'decisions' is not a table")
    out: dict[str, tuple[DecisionKey, Decision]] = {}
    for name, entry in decisions.items():
        if not isinstance(entry, dict):
            raise BadFile(f"{name}: not a table")
        try:
            out[name] = (DecisionKey.from_json(entry.get("key")),
                         Decision.from_json(entry.get("decision")))
        except BadFile as e:
            raise BadFile(f"{name}: {e}") from e
    return out
