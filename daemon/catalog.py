"""The model catalog: what the repository offers, as of the last scan.

One :class:`~inferd.daemon.repository.ModelSpec` per model name, each with its checked
model.toml (:class:`~inferd.daemon.model_settings.ModelSettings`, read once per scan);
which models are pinned (``[models] preload`` and model.toml ``pin = true``); the
settings in force for a model (its model.toml over the daemon's configuration). A reload
installs a new scan (:meth:`Catalog.install`, :meth:`Catalog.forget`).

A model directory created while the daemon runs is found by the first request that
names it (:meth:`Catalog.spec` looks it up on disk once before answering NOT_FOUND); a
changed model.toml or a new version takes a reload (``inferctl reload`` or SIGHUP).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.daemon.graph import graph_names
from inferd.daemon.repository import ModelSpec, Repository, check_name
from inferd.ipc.errors import ErrorCode, ModelError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """The settings in force for one model: its model.toml over the configuration."""

    instances: int
    queue_size: int
    backends: list[str] | None
    keep_alive: float


class Catalog:
    """The repository's models by name. Lookups are lock-free dict reads (the I/O
    thread makes one per request); changes take the catalog's lock.

    Args:
        repo: the model repository.
        config: returns the daemon configuration in force: read from the one place
            that holds it (the runtime's), never copied here.
    """

    def __init__(self, repo: Repository, config: Callable[[], Any]) -> None:
        self.repo = repo
        self._config = config
        self._specs: dict[str, ModelSpec] = repo.scan()
        self._lock = threading.Lock()

    @property
    def config(self) -> Any:
        """The configuration in force (read through the getter it was given)."""
        return self._config()

    # ----------------------------------------------------------------- lookup

    def get(self, name: str) -> ModelSpec | None:
        """The spec of ``name``, or None if the catalog does not offer it."""
        return self._specs.get(name)

    def knows(self, name: str | None) -> bool:
        """Whether ``name`` is in the catalog (a dict lookup, no filesystem access)."""
        return name in self._specs

    def snapshot(self) -> dict[str, ModelSpec]:
        """A copy of the catalog."""
        return dict(self._specs)

    def spec(self, name: str) -> ModelSpec:
        """The servable spec of ``name``.

        Raises:
            ModelError: invalid name (INVALID_ARGUMENT); unknown model (NOT_FOUND,
                listing what exists, graphs too); unusable model.toml (INTERNAL).
        """
        check_name(name)
        spec = self._specs.get(name)
        if spec is None:
            spec = self._found_since_scan(name)
        if spec is None:
            raise ModelError(f"model {name!r} not found in {self.repo.root}; available: "
                             f"{', '.join(self.available()) or 'none'}",
                             ErrorCode.NOT_FOUND)
        if spec.error:
            raise ModelError(spec.error, ErrorCode.INTERNAL)
        return spec

    def _found_since_scan(self, name: str) -> ModelSpec | None:
        """A model directory added since the last scan: offered from now on."""
        spec = self.repo.spec(name)
        if spec is None:
            return None
        with self._lock:
            spec = self._specs.setdefault(name, spec)
        log.info("model %s found in %s (added since the last scan)", name, self.repo.root,
                 extra={"MODEL": name})
        return spec

    def available(self) -> list[str]:
        """What a request may name: the catalog's models and the repository's graphs."""
        return sorted(set(self._specs) | {g for g in graph_names(self.repo)
                                          if g not in self._specs})

    def servable(self, name: str, version: int) -> bool:
        spec = self._specs.get(name)
        return spec is not None and version in spec.versions

    def settings(self, spec: ModelSpec) -> Settings:
        """The settings in force for ``spec``: model.toml, else the configuration."""
        s, cfg = spec.settings, self.config
        return Settings(
            instances=s.instances if s.instances is not None else cfg.models.instances,
            queue_size=s.queue_size if s.queue_size is not None else cfg.models.queue_size,
            backends=s.backends,
            keep_alive=s.keep_alive if s.keep_alive is not None else cfg.cache.keep_alive)

    def model_path(self, name: str) -> Path:
        """The file of ``name``'s highest version (processors read metadata from it)."""
        return self.repo.resolve(name).path

    # ----------------------------------------------------------------- pins

    def pinned(self, name: str, version: int) -> bool:
        """Whether ``version`` of ``name`` is pinned: the default version of a model in
        ``models.preload`` or with ``pin = true``."""
        spec = self._specs.get(name)
        return (spec is not None and spec.default == version
                and (spec.settings.pin or name in self.config.models.preload))

    def pinned_names(self, config: Any = None) -> list[str]:
        """Models to keep loaded: ``models.preload`` first (but the graphs it names:
        :meth:`preloaded_graphs`), then model.toml pins (by the configuration in force,
        or by ``config``: the one before a reload)."""
        graphs = set(self.preloaded_graphs(config))
        names = [n for n in (config or self.config).models.preload if n not in graphs]
        names += [n for n, s in sorted(self._specs.items())
                  if s.settings.pin and n not in names]
        return names

    def preloaded_graphs(self, config: Any = None) -> list[str]:
        """The graphs ``models.preload`` names (a name that is a graph of the repository
        and no model): loaded, with their models, before the daemon reports ready."""
        preload = (config or self.config).models.preload
        if not preload:
            return []
        graphs = set(graph_names(self.repo))
        return [n for n in preload if n in graphs and n not in self._specs]

    # ----------------------------------------------------------------- changes

    def rescan(self) -> dict[str, ModelSpec]:
        """The repository's models as of now, from the repository the configuration in
        force names (a reload: it may name another)."""
        config = self.config
        root = Path(config.models.repository).resolve()
        if root != self.repo.root:
            self.repo = Repository(root)
        self.repo.allow_external_links = config.models.allow_external_links
        return self.repo.scan()

    def install(self, specs: dict[str, ModelSpec]) -> None:
        """Offer ``specs`` (by name, over what was offered)."""
        with self._lock:
            self._specs.update(specs)

    def forget(self, names: list[str]) -> None:
        """Stop offering ``names``: new requests for them get NOT_FOUND."""
        with self._lock:
            for name in names:
                self._specs.pop(name, None)
