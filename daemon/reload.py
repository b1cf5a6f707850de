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
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from inferd.daemon.model_entry import State
from inferd.daemon.repository import ModelSpec
from inferd.ipc.errors import ErrorCode, InferdError

if TYPE_CHECKING:
    from inferd.daemon.models import ModelManager

log = logging.getLogger(__name__)


def reload_catalog(manager: ModelManager, config: Any) -> dict[str, list[str]]:
    """Apply ``config`` and the repository as it is now (see the module docstring).

    Returns:
        Model names by what happened: added, removed, changed ("name: version a -> b"),
        failed (a new version or a pinned model that did not load; the old one serves).
    """
    old = manager.catalog
    new = manager.use_config(config)
    summary: dict[str, list[str]] = {"added": sorted(new.keys() - old.keys()),
                                     "removed": sorted(old.keys() - new.keys()),
                                     "changed": [], "failed": []}
    installed, swaps = dict(new), []
    for name, spec in new.items():
        prev = old.get(name)
        if prev is None or prev.default == spec.default:
            continue
        if manager.version_state(name, prev.default) in (State.READY, State.LOADING):
            # Serve the old version until the new one is ready.
            installed[name] = replace(spec, default=prev.default, versions=tuple(
                sorted(set(spec.versions) | {prev.default})))
            swaps.append((name, prev.default, spec))
        else:
            summary["changed"].append(f"{name}: version {prev.default} -> {spec.default}")
    manager.install(installed)
    manager.forget(summary["removed"])
    for name in summary["removed"]:
        manager.retire(name, None, "removed from the repository")
    for name, old_version, spec in swaps:
        if _swap(manager, name, old_version, spec):
            summary["changed"].append(f"{name}: version {old_version} -> {spec.default}")
        else:
            summary["failed"].append(name)
    manager.retire_stale()
    manager.enforce_budget()
    summary["failed"] += manager.load_pinned()
    log.info("reload: %s", "; ".join(f"{k} {', '.join(v)}" for k, v in summary.items() if v)
             or "nothing changed")
    return summary


def _swap(manager: ModelManager, name: str, old_version: int, spec: ModelSpec) -> bool:
    """Load ``spec.default`` beside ``old_version``, make it the default, retire the old
    one. False (the old one kept as default) if the new version cannot load."""
    def make_default() -> None:
        manager.install({name: spec})
        manager.retire(name, old_version, f"replaced by version {spec.default}")

    try:
        with manager.hold(name, old_version):
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
