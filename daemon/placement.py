"""Placement of a model on a backend and device, with fallback along its preference list.

The registry's plan (:meth:`inferd.libbackends.registry.Registry.plan`) lists every
(backend, device kind) the model's ``backends = [...]`` allows, best first. A load that
fails there (the device is absent, the engine refuses the file) is logged with the
engine's reason and the next entry is tried; the first that loads is the model's
placement: backend, device (``CPU``, ``GPU.0``, ``cuda:0``...) and why it was chosen,
shown by ``inferctl models -v`` and ``inferctl backends`` and said by the load's
journal line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.ipc.errors import BackendError, ErrorCode, InferdError
from inferd.libbackends.contract import DeviceKind, LoadedModel, LoadOptions
from inferd.libbackends.registry import Choice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlacement:
    """Where a loaded model runs and why."""

    backend: str
    kind: DeviceKind
    device: str
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "kind": str(self.kind), "device": self.device,
                "why": self.why}


def backend_options(config: Any, settings: Any, backend_id: str) -> dict[str, Any]:
    """The backend's own settings for one model: the config file's section named after
    the backend id (where the daemon has one, e.g. ``[openvino]``), overridden key by
    key by the model.toml table of that name (``settings``: the model's
    :class:`~inferd.daemon.model_settings.ModelSettings`)."""
    section = getattr(config, backend_id.replace("-", "_"), None)
    base = dict(vars(section)) if section is not None else {}
    return {**base, **settings.backend_options(backend_id)}


def place(model: str, plan: list[Choice], settings: Any, config: Any,
          load: Callable[[Choice, LoadOptions], LoadedModel]
          ) -> tuple[ModelPlacement, LoadedModel]:
    """Load ``model`` on the first entry of ``plan`` that loads.

    Args:
        model: the model's name, for messages.
        plan: the registry's plan, best first (never empty).
        settings: the model's checked model.toml (ModelSettings).
        config: the daemon's config (``[onnxruntime]`` threads, backend sections).
        load: loads on one choice with the given options.

    Returns:
        The placement and the loaded model.

    Raises:
        InferdError: the only choice failed (its own error), or every choice failed
            (the first one's message, then each other backend's reason; their code if
            they agree, else UNAVAILABLE).
    """
    ort = config.onnxruntime
    failures: list[tuple[Choice, InferdError]] = []
    for choice in plan:
        b = choice.backend
        try:
            options = LoadOptions(ort.intra_op_threads, ort.inter_op_threads,
                                  ort.allow_spinning,
                                  options=backend_options(config, settings, b.id),
                                  kind=choice.kind)
            loaded = load(choice, options)
        except Exception as e:  # noqa: BLE001  a plugin's failure: contained here, once
            err = e if isinstance(e, InferdError) else InferdError(
                f"backend {b.id} load() raised {type(e).__name__}: {e}")
            failures.append((choice, err))
            log.warning("model %s: backend %s (%s) failed to load it: %s", model, b.id,
                        choice.kind, err.message,
                        extra={"MODEL": model, "BACKEND": b.id, "CODE": str(err.code)})
            continue
        device = getattr(loaded, "device", "") or str(choice.kind).upper()
        why = choice.why
        skipped = [f"{c.backend.id} ({c.kind}): {e.message}" for c, e in failures]
        if skipped or choice.passed_over:
            why += "; passed over: " + "; ".join([*choice.passed_over, *skipped])
        return ModelPlacement(b.id, choice.kind, device, why), loaded
    first = failures[0][1]
    if len(failures) == 1:
        raise first
    codes = {e.code for _, e in failures}
    raise BackendError(f"{first.message}; the other choices failed too: " + "; ".join(
        f"{c.backend.id} ({c.kind}): {e.message}" for c, e in failures[1:]),
        codes.pop() if len(codes) == 1 else ErrorCode.UNAVAILABLE)
