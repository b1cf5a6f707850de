"""The model repository on disk: ``<repo>/<model>/<version>/model.onnx`` and an optional
``<repo>/<model>/model.toml``. A model name never escapes the repository."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.ipc.errors import ErrorCode, ModelError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_FILE = "model.onnx"
SETTINGS_FILE = "model.toml"


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
    """One version of one model as found on disk, with its model.toml settings."""

    name: str
    version: int
    path: Path
    settings: dict[str, Any] = field(default_factory=dict)


class Repository:
    """Read-only view of a model repository directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        """Model names present (directories holding at least one version), sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if _NAME.fullmatch(p.name) and self.versions(p.name))

    def versions(self, name: str) -> list[int]:
        """Versions of ``name`` that hold a model file, ascending."""
        base = self.root / check_name(name)
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir()
                      if p.name.isdigit() and int(p.name) > 0 and (p / MODEL_FILE).is_file())

    def settings(self, name: str) -> dict[str, Any]:
        """The parsed ``model.toml`` of ``name`` ({} if absent)."""
        path = self.root / check_name(name) / SETTINGS_FILE
        try:
            with open(path, "rb") as f:
                return tomllib.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ModelError(f"model {name}: cannot read {path}: {e}",
                             ErrorCode.INTERNAL) from e

    def resolve(self, name: str, version: int | None = None) -> ModelSource:
        """The model source to load: the requested version, or the highest one.

        Raises:
            ModelError: invalid name (INVALID_ARGUMENT), unknown model or version
                (NOT_FOUND, listing what exists).
        """
        versions = self.versions(name)
        if not versions:
            raise ModelError(f"model {name!r} not found in {self.root}; available: "
                             f"{', '.join(self.names()) or 'none'}", ErrorCode.NOT_FOUND)
        if version is None:
            version = versions[-1]
        elif version not in versions:
            raise ModelError(f"model {name!r} has no version {version}; available: "
                             f"{', '.join(map(str, versions))}", ErrorCode.NOT_FOUND)
        path = self.root / name / str(version) / MODEL_FILE
        return ModelSource(name, version, path, self.settings(name))
