"""Where plugins are searched for: one rule for backends and custom operators.

The search path is, strongest first (an override replaces the default): the
command-line flag (``--backends-dir``, ``--customops-dir``; given to the config as an
override), the environment variable (colon-separated), the config file's ``paths`` key,
then the install directory. Directories that are not absolute, do not exist or are not
directories are logged (WARNING; INFO for a missing default) and skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.ipc import defs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchPath:
    """The search rule for one kind of plugin.

    Attributes:
        what: the plugins' name in log lines (``"backends"``).
        flag: the command-line flag (``"--backends-dir"``).
        env: the environment variable (``"INFERD_BACKENDS_PATH"``).
        key: the config key, ``section.key`` (``"backends.paths"``).
        default: the install directory.
    """

    what: str
    flag: str
    env: str
    key: str
    default: str

    def choose(self, cli: Sequence[str] | None, env: Mapping[str, str],
               configured: Sequence[str]) -> tuple[list[str], str]:
        """The directories to search, as given, and where they came from."""
        if cli:
            return list(cli), self.flag
        if env.get(self.env):
            return [p for p in env[self.env].split(":") if p], f"${self.env}"
        if configured:
            return list(configured), self.key
        return [self.default], "default"

    def from_config(self, config: Any, env: Mapping[str, str]) -> tuple[list[str], str]:
        """:meth:`choose` for the daemon's configuration: the config key counts as the
        flag when ``config.overridden`` says the command line set it."""
        section, name = self.key.split(".")
        configured = list(getattr(getattr(config, section), name))
        from_cli = self.key in getattr(config, "overridden", ())
        return self.choose(configured if from_cli else None, env,
                           [] if from_cli else configured)

    def usable(self, paths: Sequence[str], source: str) -> list[Path]:
        """The absolute, existing directories of ``paths``, each once; the rest is
        logged and ignored."""
        dirs: list[Path] = []
        for raw in paths:
            path = Path(raw)
            problem = ("is not an absolute path" if not path.is_absolute() else
                       "does not exist" if not path.exists() else
                       "is not a directory" if not path.is_dir() else "")
            if not problem:
                if path.resolve() not in dirs:
                    dirs.append(path.resolve())
                continue
            level = logging.INFO if source == "default" else logging.WARNING
            log.log(level, "%s directory %s (from %s) %s: ignored", self.what, raw, source,
                    problem, extra={"PLUGIN_PATH": raw})
        return dirs


BACKENDS = SearchPath("backends", "--backends-dir", defs.BACKENDS_PATH_ENV, "backends.paths",
                      defs.BACKENDS_DIR)
CUSTOMOPS = SearchPath("custom ops", "--customops-dir", defs.CUSTOMOPS_PATH_ENV,
                       "customops.paths", defs.CUSTOMOPS_DIR)


def list_folder(d: Path, what: str, logger: logging.Logger) -> list[str]:
    """The names in plugin folder ``d``, sorted; none, with a WARNING on ``logger``
    naming ``what`` and the reason, when the folder cannot be listed."""
    try:
        return sorted(os.listdir(d))
    except OSError as e:
        logger.warning("%s directory %s cannot be listed: %s", what, d, e.strerror,
                       extra={"PLUGIN_PATH": str(d)})
        return []
