"""A model's pipeline (steps, batching, cores) built from its ``model.toml``
(:mod:`inferd.daemon.model_settings` checks the keys), and thread placement.

The keys it uses::

    cpu_affinity = [0, 1]          # cores every thread of the model may run on
    max_batch = 8                  # dynamic batching: rows merged into one run (1 = off)
    max_delay_ms = 2.0             # how long the first request waits for company
    batching = "adaptive"          # or "fixed" (daemon/batching.py)
    stage_queue_size = 8           # bounded queue between two stages
    pre = [{ op = "image.resize", height = 48, width = 192 }, ...]
    post = [{ op = "softmax", input = "prob" }, ...]

A model with ``pre`` steps gets a ``inferd-<model>-pre`` thread, one with ``post`` steps
a ``inferd-<model>-post`` thread; the ``instances`` inference threads are
``inferd-<model>-infer-<i>``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.daemon.batching import BatchMode
from inferd.daemon.model_settings import ModelSettings
from inferd.daemon.processors import Context, ProcessorRegistry, Step, release
from inferd.daemon.repository import Repository
from inferd.daemon.units import PROCESS_CORES
from inferd.ipc.errors import ErrorCode, ModelError

log = logging.getLogger(__name__)

@dataclass
class PipelineSpec:
    """What a model's threads do besides inference, and where they run."""

    pre: list[tuple[str, Step]] = field(default_factory=list)
    post: list[tuple[str, Step]] = field(default_factory=list)
    cpu_affinity: list[int] | None = None
    max_batch: int = 1
    max_delay_ms: float = 0.0
    batching: BatchMode = BatchMode.ADAPTIVE
    stage_queue_size: int = 8
    warmup_shapes: dict[str, list[int]] = field(default_factory=dict)
    """model.toml's: the shapes its warm-up runs on (the batches' working memory is sized
    on them too, the batch axis set to each batch size)."""


def parse_spec(name: str, settings: ModelSettings, registry: ProcessorRegistry | None,
               model_path: Callable[[str], Path] | None = None,
               repo: Repository | None = None) -> PipelineSpec:
    """Build the pipeline of model ``name`` from its checked model.toml: its steps are
    built here (with the processors registry: in the processors worker when it has
    one; :func:`inferd.daemon.processors.release` lets go of them), the rest is copied.

    Raises:
        ModelError: a step that cannot be built, naming the model, the key and the step.
    """
    spec = PipelineSpec(cpu_affinity=settings.cpu_affinity, max_batch=settings.max_batch,
                        max_delay_ms=settings.max_delay_ms,
                        batching=BatchMode(settings.batching),
                        stage_queue_size=settings.stage_queue_size,
                        warmup_shapes=dict(settings.warmup_shapes))
    for key in ("pre", "post"):
        steps = getattr(settings, key)
        if steps and registry is None:
            raise ModelError(f"model {name}: '{key}' steps given but no processors",
                             ErrorCode.INTERNAL)
        built: list[tuple[str, Step]] = []
        for i, step in enumerate(steps):
            where = f"model {name}: {key}[{i}]"
            assert registry is not None
            try:
                built.append((f"{key}[{i}] {step.get('op', '?')}",
                              registry.build(step, Context(model_path, name, repo), where)))
            except BaseException:
                release(spec.pre + built)
                raise
        setattr(spec, key, built)
    return spec


@dataclass
class Pinning:
    """The cores one pipeline thread runs on, as read back from the kernel (the model's
    backend and device are its ModelPlacement: daemon/placement.py)."""

    thread: str
    stage: str
    native_id: int | None = None
    affinity: list[int] = field(default_factory=list)
    backend: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"thread": self.thread, "stage": self.stage, "native_id": self.native_id,
                "affinity": self.affinity, "backend": self.backend, "error": self.error}


def pin_current_thread(placement: Pinning, cores: list[int] | None, model: str) -> None:
    """Apply ``cores`` to the calling thread through its native id and record the
    affinity the kernel reports back."""
    tid = threading.get_native_id()
    placement.native_id = tid
    if not cores:
        unpin_current_thread()
    else:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError as e:
            placement.error = f"sched_setaffinity({cores}) failed: {e.strerror}"
            log.warning("model %s: thread %s: %s", model, placement.thread, placement.error,
                        extra={"MODEL": model})
    placement.affinity = sorted(os.sched_getaffinity(tid))


def unpin_current_thread() -> None:
    """Let the calling thread run on every core of the process again. A thread inherits
    the cores of the thread that starts it, and the I/O thread may be pinned
    (``[server] cpu_affinity``): threads it starts call this first."""
    try:
        os.sched_setaffinity(threading.get_native_id(), PROCESS_CORES)
    except OSError as e:  # e.g. a core went offline since start-up
        log.debug("cannot reset the affinity of thread %s: %s",
                  threading.current_thread().name, e.strerror)
