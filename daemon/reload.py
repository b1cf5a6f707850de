"""Reload of the model cache (SIGHUP, ``inferctl reload``): a new configuration and a
fresh look at the repository, applied without failing a request.

- New models become available at once.
- Removed models stop being offered (NOT_FOUND from then on); what they had queued is
  served, then they are unloaded.
- A model whose default version changed, and which is loaded, gets the new version
  loaded beside the old one; the old one keeps serving until the new one is ready, then
  the new one becomes the default and the old one is drained. If both do not fit in the
  budget, the old one is drained first and requests wait in the new one's queue.
- Versions no longer offered are drained; the budget is enforced again (it may have
  shrunk); pinned models that are not loaded are loaded.
- A loaded version whose files changed in place (truncated, overwritten, swapped by a
  rename: inode, size, times, content hash) is drained and loaded again from the files
  as they are now; requests that arrive meanwhile wait in its queue. Reported under
  "changed" ("ocr-cls: version 1 changed on disk, loaded again").
- A changed model.toml or pin is reported under "changed". A loaded model keeps the
  threads, steps and backend it was loaded with until its next load (``inferctl unload``
  then a request, or ``inferctl load``); its keep-alive changes at once.

It works through the manager's public methods only (:class:`Cache` says which).

:class:`ReloadRuns` coalesces the requests for a reload: those that arrive while one is
waiting to run join it, so a burst of SIGHUPs and ``inferctl reload`` costs the run in
progress and one more, and each request is answered with the run that covered it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol

from inferd.daemon.catalog import Catalog
from inferd.daemon.model_entry import ModelEntry, State
from inferd.daemon.model_settings import SETTINGS_FILE
from inferd.daemon.repository import ModelSpec, same_contents
from inferd.ipc.errors import ErrorCode, InferdError

log = logging.getLogger(__name__)

Answer = Callable[[Any, BaseException | None], None]
"""Called with a run's result (or None) and what it raised (or None)."""


class ReloadRuns:
    """Reload requests, coalesced: at most one run in progress and one waiting; a
    request that arrives while one waits joins it (it starts after the request came,
    so it sees every change made before).

    Args:
        run: the reload itself (``Runtime.reload``).
        submit: queues a call on the control thread.
    """

    def __init__(self, run: Callable[[], Any],
                 submit: Callable[[Callable[[], None]], Any]) -> None:
        self._run = run
        self._submit = submit
        self._lock = threading.Lock()
        self._waiting: list[Answer | None] | None = None  # the next run's requests
        self.runs = 0
        self.requests = 0

    def request(self, answer: Answer | None = None) -> None:
        """Ask for a reload; ``answer`` gets the outcome of the run that covers it (a
        SIGHUP has no one to tell: None)."""
        with self._lock:
            self.requests += 1
            if self._waiting is not None:
                self._waiting.append(answer)
                return
            self._waiting = [answer]
        self._submit(self._one_run)

    def _one_run(self) -> None:
        with self._lock:
            answers, self._waiting = self._waiting or [], None
            self.runs += 1
        if len(answers) > 1:
            log.info("reload: %d requests for it arrived while the last one ran; one run "
                     "serves them", len(answers))
        result: Any = None
        error: BaseException | None = None
        try:
            result = self._run()
        except Exception as e:  # the run logs its own failure; each request is told
            error = e
        for answer in answers:
            if answer is not None:
                answer(result, error)


class Cache(Protocol):
    """What a reload needs of the model manager (:class:`~inferd.daemon.models.ModelManager`)."""

    catalog: Catalog

    def version_state(self, name: str, version: int) -> State: ...
    def enforce(self) -> None: ...
    def kept(self, name: str, version: int) -> AbstractContextManager[None]: ...
    def refresh_keep_alives(self) -> None: ...
    def unload(self, name: str, version: int | None = None, timeout: float | None = None,
               reason: str = ...) -> ModelEntry: ...
    def retire_stale(self) -> None: ...
    def load_pinned(self, before_each: Callable[[int, int, str], None] | None = None
                    ) -> list[str]: ...
    def load(self, name: str, version: int | None = None) -> ModelEntry: ...
    def load_after(self, name: str, version: int, first: Any) -> ModelEntry: ...


def reload_catalog(manager: Cache, previous: Any) -> dict[str, list[str]]:
    """Apply the configuration now in force (the runtime's, which the catalog reads)
    and the repository as it is now (see the module docstring); ``previous`` is the
    configuration before the reload (what was pinned).

    Returns:
        Model names by what happened: added, removed, changed ("name: version a -> b"),
        failed (a new version or a pinned model that did not load; the old one serves).
    """
    catalog = manager.catalog
    old, old_pins = catalog.snapshot(), set(catalog.pinned_names(previous))
    new = catalog.rescan()
    summary: dict[str, list[str]] = {"added": sorted(new.keys() - old.keys()),
                                     "removed": sorted(old.keys() - new.keys()),
                                     "changed": [], "failed": []}
    installed, swaps = dict(new), []
    for name, spec in new.items():
        prev = old.get(name)
        if prev is None:
            continue
        if prev.settings != spec.settings or SETTINGS_FILE in f"{prev.error}{spec.error}":
            summary["changed"].append(f"{name}: model.toml changed"
                                      + (f" ({spec.error})" if spec.error else ""))
        elif prev.error != spec.error:  # a folder that cannot be read (or now can)
            summary["changed"].append(f"{name}: cannot be served ({spec.error})"
                                      if spec.error else f"{name}: can be served again")
        if prev.default == spec.default or spec.error:
            continue  # an unservable model: what it has loaded is retired below
        if manager.version_state(name, prev.default) in (State.READY, State.LOADING):
            # Serve the old version until the new one is ready.
            installed[name] = replace(spec, default=prev.default, versions=tuple(
                sorted(set(spec.versions) | {prev.default})))
            swaps.append((name, prev.default, spec))
        else:
            summary["changed"].append(f"{name}: version {prev.default} -> {spec.default}")
    catalog.install(installed)
    manager.refresh_keep_alives()
    catalog.forget(summary["removed"])
    pins = set(catalog.pinned_names())
    summary["changed"] += [f"{n}: now pinned" for n in sorted(pins - old_pins) if n in new]
    summary["changed"] += [f"{n}: no longer pinned" for n in sorted(old_pins - pins)
                           if n in new]
    for name in summary["removed"]:
        manager.unload(name, None, reason="removed from the repository")
    for name, old_version, spec in swaps:
        if _swap(manager, name, old_version, spec):
            summary["changed"].append(f"{name}: version {old_version} -> {spec.default}")
        else:
            summary["failed"].append(name)
    _reload_changed_files(manager, old, new, summary)
    manager.retire_stale()
    try:  # the budget may have shrunk
        manager.enforce()
    except InferdError as e:
        log.warning("cache is over its budget and cannot evict more: %s", e.message)
    summary["failed"] = list(dict.fromkeys(summary["failed"] + manager.load_pinned()))
    log.info("reload: %s", "; ".join(f"{k} {', '.join(v)}" for k, v in summary.items() if v)
             or "nothing changed")
    return summary


def _reload_changed_files(manager: Cache, old: dict[str, ModelSpec],
                          new: dict[str, ModelSpec], summary: dict[str, list[str]]) -> None:
    """Load again each loaded version whose files changed on disk since the last scan
    (truncated, overwritten, swapped by a rename): it is drained (what it has queued
    and running finishes on the old copy, new requests wait in its queue) and loaded
    from the files as they are now. A version not loaded is only reported."""
    for name, spec in sorted(new.items()):
        prev = old.get(name)
        if prev is None or spec.error:
            continue
        for version, files in sorted(spec.files.items()):
            before = prev.files.get(version)
            if before is None or version not in spec.versions or same_contents(before,
                                                                               files):
                continue
            if manager.version_state(name, version) not in (State.READY, State.LOADING):
                summary["changed"].append(f"{name}: version {version} changed on disk")
                continue
            log.info("model %s version %d: its files changed on disk; loading it again",
                     name, version, extra={"MODEL": name})
            manager.unload(name, version, reason="its files changed on disk")
            try:
                manager.load(name, version)
            except InferdError as e:
                log.error("model %s version %d changed on disk and failed to load again: "
                          "%s", name, version, e.message, extra={"MODEL": name})
                summary["failed"].append(name)
                continue
            summary["changed"].append(f"{name}: version {version} changed on disk, "
                                      f"loaded again")


def _swap(manager: Cache, name: str, old_version: int, spec: ModelSpec) -> bool:
    """Load ``spec.default`` beside ``old_version``, make it the default, retire the old
    one. False (the old one kept as default) if the new version cannot load."""
    def make_default() -> None:
        manager.catalog.install({name: spec})
        manager.unload(name, old_version, reason=f"replaced by version {spec.default}")

    try:
        with manager.kept(name, old_version):
            manager.load(name, spec.default)
    except InferdError as e:
        if e.code is not ErrorCode.RESOURCE_EXHAUSTED:
            log.error("model %s: version %d failed to load, still serving version %d: %s",
                      name, spec.default, old_version, e.message, extra={"MODEL": name})
            return False
        log.info("model %s: versions %d and %d do not fit together; draining %d before "
                 "loading %d", name, old_version, spec.default, old_version, spec.default,
                 extra={"MODEL": name})
        try:
            manager.load_after(name, spec.default, make_default)
        except InferdError:
            return False
        return True
    make_default()
    return True
