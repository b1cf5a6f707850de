"""The model repository on disk: ``<repo>/<model>/<version>/model.onnx`` (or
``model.xml`` + ``model.bin``, ``model.rknn``, or ``model.ncnn.param``) and an optional
``<repo>/<model>/model.toml``. A model name never escapes the repository.

Versions policy (model.toml): by default the highest version is served and every version
on disk may be asked for by number; ``version = N`` serves N instead; ``keep_versions =
N`` offers only the latest N (the default is then the highest of them).

Each scan also takes the fingerprint of every version folder's files (:func:`contents`:
inode, size, times, and a content hash of files up to :data:`HASH_LIMIT`), so that a
reload notices a file replaced in place (daemon/reload.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.daemon.model_settings import SETTINGS_FILE, ModelSettings, read_settings
from inferd.ipc.errors import ErrorCode, ModelError

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_FILE = "model.onnx"
MODEL_FILES = (MODEL_FILE, "model.xml", "model.rknn", "model.ncnn.param")
"""What a version folder may hold, first found wins: ONNX (every backend), OpenVINO IR
(``model.xml`` + ``model.bin``, backend openvino), a compiled ``.rknn`` (backend rknn),
ncnn's ``model.ncnn.param`` + ``.bin`` + ``.json`` (backend ncnn). A backend may read a
sibling form itself (openvino prefers the IR beside model.onnx, ncnn its files)."""


def model_file(folder: Path) -> Path | None:
    """The model file of a version folder, or None if it holds none."""
    return next((folder / f for f in MODEL_FILES if (folder / f).is_file()), None)


HASH_LIMIT = 16 * 2**20
"""Files up to this size are hashed at each scan (a 10 MB model: about 15 ms); larger
ones are compared by inode, size and times only."""


@dataclass(frozen=True)
class FileId:
    """What one file of a version folder was at a scan. ``ctime_ns`` moves on every
    write (it cannot be set back, unlike the mtime); ``digest`` is None past
    :data:`HASH_LIMIT`."""

    name: str
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    digest: str | None

    def same_contents(self, other: FileId) -> bool:
        """Whether ``other`` holds what this held: by content hash when both have one
        (a chmod or an identical copy is no change), else by inode, size and times."""
        if self.digest is not None and other.digest is not None:
            return (self.name, self.size, self.digest) == (other.name, other.size,
                                                            other.digest)
        return self.same_file(other)

    def same_file(self, other: FileId) -> bool:
        """Whether ``other`` is this file untouched (inode, size and times)."""
        return ((self.name, self.inode, self.size, self.mtime_ns, self.ctime_ns)
                == (other.name, other.inode, other.size, other.mtime_ns, other.ctime_ns))


def contents(folder: Path, digests: bool = True) -> tuple[FileId, ...]:
    """The fingerprint of the regular files in a version folder, by name (``digests``:
    hash the files up to :data:`HASH_LIMIT`).

    Raises:
        OSError: a file cannot be read.
    """
    out = []
    for path in sorted(folder.iterdir()):
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # readable?
        with os.fdopen(fd, "rb") as f:
            digest = (hashlib.file_digest(f, "blake2b").hexdigest()
                      if digests and st.st_size <= HASH_LIMIT else None)
        out.append(FileId(path.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                          digest))
    return tuple(out)


def same_contents(a: tuple[FileId, ...], b: tuple[FileId, ...]) -> bool:
    """Whether two fingerprints of a version folder hold the same files."""
    return len(a) == len(b) and all(x.same_contents(y) for x, y in zip(a, b, strict=True))


def _unreadable(name: str, folder: Path, e: OSError) -> str:
    return f"model {name}: cannot read {folder}: {e.strerror or e}"


def check_name(name: Any) -> str:
    """Return ``name`` if it is a plain model name; raise ModelError otherwise.

    A plain name is 1-128 characters of letters, digits, ``.``, ``_`` and ``-``, starts
    with a letter or digit and contains no ``..``: no path separators, no absolute paths.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ModelError(f"invalid model name {name!r}: a model name is letters, digits, "
                         f"'.', '_' and '-', not a path", ErrorCode.INVALID_ARGUMENT)
    return name


@dataclass(frozen=True)
class ModelSource:
    """One version of one model as found on disk."""

    name: str
    version: int
    path: Path


@dataclass(frozen=True)
class ModelSpec:
    """What the repository offers under one name, as of the last scan.

    Attributes:
        versions: versions a request may name, ascending.
        default: the version served when a request names none.
        settings: its checked model.toml (defaults if absent or unusable).
        error: why the model cannot be served (a bad model.toml, a folder or file
            that cannot be read), else None.
        files: each version's fingerprint (:func:`contents`), by version.
    """

    name: str
    versions: tuple[int, ...]
    default: int
    settings: ModelSettings = field(default_factory=ModelSettings)
    error: str | None = None
    files: dict[int, tuple[FileId, ...]] = field(default_factory=dict, compare=False)


def _version_policy(name: str, on_disk: list[int], settings: ModelSettings
                    ) -> tuple[tuple[int, ...], int]:
    keep, pinned = settings.keep_versions, settings.version
    versions = on_disk[-keep:] if keep else on_disk
    if pinned is None:
        return tuple(versions), versions[-1]
    if pinned not in on_disk:
        raise ModelError(f"model {name}: model.toml pins version {pinned}, which is not "
                         f"in the repository (it has {', '.join(map(str, on_disk))})",
                         ErrorCode.INTERNAL)
    return tuple(sorted(set(versions) | {pinned})), pinned


class Repository:
    """Read-only view of a model repository directory.

    Every path is resolved before it is used: a model directory, version directory or
    file that is a symbolic link to a place outside the repository is refused (logged
    once, never read) unless ``allow_external_links`` (``[models]
    allow_external_links``) is set.
    """

    def __init__(self, root: Path, allow_external_links: bool = False) -> None:
        self.root = root
        self.allow_external_links = allow_external_links
        self._real_root = root.resolve()
        self._warned: set[str] = set()

    def problem(self) -> str | None:
        """Why the repository cannot offer any model (missing, not a directory,
        unreadable), or None."""
        try:
            if not self.root.exists():
                return f"model repository {self.root} does not exist"
            if not self.root.is_dir():
                return f"model repository {self.root} is not a directory"
            next(iter(self.root.iterdir()), None)
        except OSError as e:
            return f"model repository {self.root} cannot be read: {e.strerror}"
        return None

    def inside(self, path: Path, name: str) -> bool:
        """Whether ``path`` resolves to a place inside the repository (or outside links
        are allowed); a refusal is logged once per path, without reading the file."""
        if self.allow_external_links:
            return True
        try:
            real = path.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            real = None
        if real is not None and real.is_relative_to(self._real_root):
            return True
        if str(path) not in self._warned:
            if len(self._warned) > 4096:
                self._warned.clear()
            self._warned.add(str(path))
            log.warning("model %s: %s is a link to %s outside the repository %s; refused "
                        "(set [models] allow_external_links = true to serve it)", name, path,
                        real or "a loop", self._real_root, extra={"MODEL": name})
        return False

    def checked(self, path: Path, name: str) -> Path:
        """``path`` if it stays inside the repository; raises ModelError otherwise."""
        if not self.inside(path, name):
            raise ModelError(f"model {name}: {path.name} is a link to a place outside the "
                             f"model repository; refused ([models] allow_external_links)",
                             ErrorCode.NOT_FOUND)
        return path

    def names(self) -> list[str]:
        """Model names present (directories holding at least one version, or that
        cannot be read: those fail as models of their own), sorted."""
        try:
            if not self.root.is_dir():
                return []
            found = [p.name for p in self.root.iterdir() if _NAME.fullmatch(p.name)]
        except OSError:  # problem() says why
            return []
        return sorted(n for n in found if any(self.listing(n)))

    def versions(self, name: str) -> list[int]:
        """Versions of ``name`` that hold a model file, ascending (none if one of its
        folders cannot be read: :meth:`listing` says why)."""
        versions, problem = self.listing(name)
        return [] if problem else versions

    def listing(self, name: str) -> tuple[list[int], str | None]:
        """Versions of ``name`` that hold a model file, ascending, and why its folder or
        one of its version folders cannot be read (None if all can)."""
        base = self.root / check_name(name)
        try:
            if not base.is_dir() or not self.inside(base, name):
                return [], None
            children = list(base.iterdir())
        except OSError as e:
            return [], _unreadable(name, base, e)
        versions = []
        for p in children:
            if not (p.name.isdigit() and int(p.name) > 0):
                continue
            try:
                f = model_file(p)
            except OSError as e:
                return [], _unreadable(name, p, e)
            if f is not None and self.inside(f, name):
                versions.append(int(p.name))
        return sorted(versions), None

    def _settings_link_check(self, name: str) -> None:
        """Refuse (without reading it) a model.toml that is a link out of the repository."""
        path = self.root / check_name(name) / SETTINGS_FILE
        if (path.exists() or path.is_symlink()) and not self.inside(path, name):
            raise ModelError(f"model {name}: {SETTINGS_FILE} is a link to a place outside "
                             f"the model repository; refused, not read ([models] "
                             f"allow_external_links)", ErrorCode.INTERNAL)

    def spec(self, name: str) -> ModelSpec | None:
        """What ``name`` offers now, or None if it has no version on disk. Its
        model.toml is read and checked here, once per scan. A bad model.toml, or a
        model or version folder that cannot be read, gives a spec with ``error`` set
        (and is logged) rather than an exception, so one bad model fails only itself:
        the others, and reloads, go on."""
        on_disk, problem = self.listing(name)
        if problem is None and not on_disk:
            return None
        files: dict[int, tuple[FileId, ...]] = {}
        for version in on_disk:
            folder = self.root / name / str(version)
            try:
                files[version] = contents(folder)
            except OSError as e:
                problem = problem or _unreadable(name, Path(e.filename or folder), e)
        try:
            if problem is not None:
                raise ModelError(problem, ErrorCode.INTERNAL)
            self._settings_link_check(name)
            settings = read_settings(name, self.root / name)
            versions, default = _version_policy(name, on_disk, settings)
        except ModelError as e:
            log.error("model %s cannot be served: %s", name, e.message,
                      extra={"MODEL": name})
            return ModelSpec(name, tuple(on_disk), on_disk[-1] if on_disk else 0,
                             ModelSettings(), e.message, files)
        return ModelSpec(name, versions, default, settings, files=files)

    def scan(self) -> dict[str, ModelSpec]:
        """Every model on disk, by name."""
        specs = {}
        for name in self.names():
            spec = self.spec(name)
            if spec is not None:
                specs[name] = spec
        return specs

    def unchanged(self, spec: ModelSpec, version: int) -> bool:
        """Whether the files of ``version`` are untouched since the scan that made
        ``spec`` (inode, size and times; no hashing)."""
        before = spec.files.get(version)
        try:
            now = contents(self.root / spec.name / str(version), digests=False)
        except OSError:
            return False
        return (before is not None and len(before) == len(now)
                and all(a.same_file(b) for a, b in zip(before, now, strict=True)))

    def resolve(self, name: str, version: int | None = None) -> ModelSource:
        """The model source to load: the requested version, or the highest one.

        Raises:
            ModelError: invalid name (INVALID_ARGUMENT), unknown model or version
                (NOT_FOUND, listing what exists), a folder that cannot be read
                (INTERNAL, naming it).
        """
        versions, problem = self.listing(name)
        if problem is not None:
            raise ModelError(problem, ErrorCode.INTERNAL)
        if not versions:
            raise ModelError(f"model {name!r} not found in {self.root}; available: "
                             f"{', '.join(self.names()) or 'none'}", ErrorCode.NOT_FOUND)
        if version is None:
            version = versions[-1]
        elif version not in versions:
            raise ModelError(f"model {name!r} has no version {version}; available: "
                             f"{', '.join(map(str, versions))}", ErrorCode.NOT_FOUND)
        folder = self.root / name / str(version)
        return ModelSource(name, version, model_file(folder) or folder / MODEL_FILE)
