"""Where custom ops are looked for, and loading a folder of them.

Search path, strongest first, an override replacing the default (as for backends):
``--customops-dir`` (the ``customops.paths`` command-line override),
``$INFERD_CUSTOMOPS_PATH`` (colon-separated), ``[customops] paths``,
``/usr/lib/inferd/customops``. A model's own ``<repository>/<model>/customops/`` is
loaded when the model loads, over the daemon's ops.

In a folder, ``*.py`` files are Python ops and ``libinferdcst_<name>.so`` native ops;
names starting with ``.`` or ``_`` are not looked at. Each op file must pass strict modes
(:mod:`inferd.libbackends.trust`) before it is opened, up to its custom-op directory (a
model's ops: up to the model repository): in a directory of the search path one that
fails is skipped with the reason; in a model's folder the model fails to load with it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inferd.libbackends.customops.contract import OpRegistry, Skipped
from inferd.libbackends.searchpath import CUSTOMOPS, list_folder
from inferd.libbackends.trust import STRICT, StrictModes, UntrustedCode

log = logging.getLogger(__name__)

MODEL_FOLDER = "customops"
NATIVE_NAME = re.compile(r"libinferdcst_(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)\.so")


search_path = CUSTOMOPS.choose
usable_dirs = CUSTOMOPS.usable


def _is_code(name: str) -> bool:
    return not name.startswith((".", "_")) and (name.endswith(".py")
                                                 or bool(NATIVE_NAME.fullmatch(name)))


def load_folders(dirs: Sequence[Path], registry: OpRegistry,
                 probe_timeout_s: float = 10.0, strict: StrictModes = STRICT,
                 root: Path | None = None) -> None:
    """Load every op of ``dirs`` into ``registry`` (Python files first, then native
    libraries, which are probed in child processes all at once); an op file that strict
    modes refuse (up to ``root``, by default its own folder) is skipped, never opened."""
    natives: list[Path] = []
    for d in dirs:
        for name in list_folder(d, "custom ops", log):
            path = d / name
            if name.startswith((".", "_")):
                continue
            if _is_code(name):
                try:
                    strict.check(path, d if root is None else root)
                except (UntrustedCode, OSError) as e:
                    reason = e.message if isinstance(e, UntrustedCode) else e.strerror
                    registry.skipped.append(Skipped(str(path), str(reason), "opened"))
                    log.warning("custom op file %s skipped at stage 'opened': %s", path,
                                reason, extra={"PLUGIN_PATH": str(path), "STAGE": "opened"})
                    continue
            if name.endswith(".py"):
                from inferd.libbackends.customops import pyops  # imports onnx

                pyops.load_file(path, registry)
            elif NATIVE_NAME.fullmatch(name):
                natives.append(path)
            elif name.endswith(".so"):
                reason = "a native custom op is named libinferdcst_<name>.so"
                registry.skipped.append(Skipped(str(path), reason, "found"))
                log.info("custom op candidate %s ignored: %s", path, reason,
                         extra={"PLUGIN_PATH": str(path)})
    if natives:
        from inferd.libbackends.customops import native

        native.load_libraries(natives, registry, probe_timeout_s)


def load_global(registry: OpRegistry, config: Any, env: Mapping[str, str] | None = None
                ) -> None:
    """Fill ``registry`` (the daemon's, empty) with the ops found the way the daemon does
    at boot."""
    paths, source = CUSTOMOPS.from_config(config, os.environ if env is None else env)
    dirs = CUSTOMOPS.usable(paths, source)
    registry.search_path = [str(d) for d in dirs]
    registry.search_path_source = source
    log.info("searching custom ops in %s (from %s)",
             ":".join(registry.search_path) or "no usable directory", source)
    load_folders(dirs, registry, config.backends.probe_timeout_s,
                 StrictModes(config.security.strict_modes))
    log.info("custom ops: %d registered (%s), %d skipped", len(registry.ops),
             ", ".join(registry.names()) or "none", len(registry.skipped))


def load_model_ops(model_dir: Path, parent: OpRegistry | None,
                   probe_timeout_s: float = 10.0, strict: StrictModes = STRICT
                   ) -> OpRegistry:
    """A model's own ops (``<model_dir>/customops/``) over ``parent``'s; ``parent``
    itself when the model has no such folder.

    Raises:
        UntrustedCode: strict modes refuse the folder or one of its op files (checked up
            to the repository, ``model_dir``'s parent): the model does not load, and
            nothing of the folder was opened.
    """
    folder = model_dir / MODEL_FOLDER
    if not folder.is_dir():
        return parent if parent is not None else OpRegistry()
    root = model_dir.parent
    for name in list_folder(folder, "custom ops", log):
        if _is_code(name):
            try:
                strict.check(folder / name, root)
            except FileNotFoundError:
                pass  # a dangling link: load_folders skips it with the reason
    registry = OpRegistry(parent=parent, search_path=[str(folder)],
                          search_path_source="the model's folder")
    load_folders([folder], registry, probe_timeout_s, strict, root)
    return registry
