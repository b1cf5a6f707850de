"""Loading one model version: make room in the budget, choose the backend, load (through
the custom-op planner), warm up and measure. :meth:`ModelLoader.load` returns one
:class:`Loaded` result with everything the model's workers need, or raises; the manager
(:mod:`inferd.daemon.models`) makes the entry READY or FAILED from it.

Loads run one at a time (``ModelLoader._lock``), so a resident-memory delta is the
load's own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.daemon.streams import StreamModel
from inferd.daemon.activations import Activations
from inferd.daemon.budget import MemoryBudget, estimate_cost, format_bytes
from inferd.daemon.catalog import Catalog, Settings
from inferd.daemon.memory import METER, LoadFigures, MemoryMeter
from inferd.daemon.model_entry import ModelEntry
from inferd.daemon.pipeline import PipelineSpec, parse_spec
from inferd.daemon.placement import ModelPlacement, backend_options
from inferd.daemon.placer import Placer
from inferd.daemon.processors import ProcessorRegistry, release
from inferd.daemon.repository import ModelSpec
from inferd.daemon.warmup import warm_up
from inferd.daemon.workers.pool import MEASURING, LoadCall, WorkerModel, WorkerPool
from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.contract import DeviceKind, LoadedModel, LoadOptions
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.registry import Choice, Registry
from inferd.libbackends.trust import StrictModes

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """A loaded, warmed-up and measured model version, ready for its workers."""

    model: LoadedModel
    placement: ModelPlacement
    settings: Settings
    pipeline: PipelineSpec
    figures: LoadFigures
    graph: Activations | None
    """The model's graph, to estimate each run's working memory (None: not ONNX)."""
    meter: MemoryMeter
    """Measures the process the model's engine runs in (a worker's, or the daemon's)."""
    streams: StreamModel | None = None
    """Its model.toml [stream] table bound to the model (None: it has none)."""


class ModelLoader:
    """Loads model versions for the cache.

    Args:
        catalog: what the repository offers, each model's settings, the configuration
            (``[onnxruntime]``, ``[cache]``, the backend sections).
        registry: the backends to choose from.
        budget: the cache's memory budget (the engines imported are counted there).
        make_room: the cache's eviction for a load
            (:meth:`~inferd.daemon.models.ModelManager.make_room`).
        processors: the pre/post-processing steps model.toml may name.
        customops: the daemon's custom ops (None: none).
        placer: places each load (daemon/placer.py); it loads the rivals it measures
            later, on its own thread, through the same load function, which holds
            ``_lock`` then too.
        workers: the worker processes the engines load in (None: in the daemon).
    """

    def __init__(self, catalog: Catalog, registry: Registry, budget: MemoryBudget,
                 make_room: Callable[..., int],
                 processors: ProcessorRegistry | None, customops: OpRegistry | None,
                 placer: Placer, workers: WorkerPool | None = None) -> None:
        self.catalog = catalog
        self.registry = registry
        self.budget = budget
        self.make_room = make_room
        self.processors = processors
        self.customops = customops
        self.placer = placer
        self.workers = workers
        # one load at a time, a rival being measured too: its RSS delta is its own
        self._lock = threading.RLock()

    def load(self, entry: ModelEntry) -> Loaded:
        """Make room, load, warm up and measure ``entry``'s version (LOADING); the
        entry itself is left as it is.

        Raises:
            InferdError: anything that stops it (the model is unloaded again first).
        """
        with self._lock:
            return self._load(entry)

    def _engine(self, name: str, bring_in: Callable[[], Any]) -> int:
        """Import engine ``name`` (once) before a model's load is measured: what it adds
        to the daemon counts in the budget as the engine's while the daemon runs, not as
        the first model's that brought it in. Returns the bytes it added now."""
        if self.budget.engine(name) is not None:
            return 0
        METER.trim()
        before = METER.rss()
        bring_in()
        METER.trim()
        added = max(0, METER.rss() - before)
        self.budget.engine_imported(name, added)
        log.info("engine %s imported: %s resident, counted in the cache budget from now "
                 "on", name, format_bytes(added), extra={"BACKEND": name})
        return added

    def _load(self, entry: ModelEntry) -> Loaded:
        spec = self.catalog.get(entry.name)
        if spec is None or entry.version not in spec.versions:
            raise ModelError(f"model {entry.label} is no longer in the repository",
                             ErrorCode.NOT_FOUND)
        if spec.error:
            raise ModelError(spec.error, ErrorCode.INTERNAL)
        settings = self.catalog.settings(spec)
        # model.toml's steps (daemon/pipeline.py): a bad one fails the load here, before
        # anything is loaded
        pipeline = parse_spec(entry.name, spec.settings, self.processors,
                              self.catalog.model_path, self.catalog.repo)
        try:
            return self._load_model(entry, spec, settings, pipeline)
        except BaseException:
            release(pipeline.pre + pipeline.post)  # held in the processors worker
            raise

    def _load_model(self, entry: ModelEntry, spec: ModelSpec, settings: Settings,
                    pipeline: PipelineSpec) -> Loaded:
        repo = self.catalog.repo
        source = repo.resolve(entry.name, entry.version)
        plan = self.registry.plan(entry.name, source.path, settings.backends)
        known = entry.memory.total()
        if known:
            need = known
            self.make_room(entry, need, "measured at its last load")
        else:
            # Only a guess: if it does not fit, room for the file itself will do; the
            # measured cost is checked against the budget once loaded.
            size = source.path.stat().st_size
            need = self.make_room(entry, estimate_cost(size), "estimated from its "
                                         "file size", floor=size)
        entry.reserve(need)
        config = self.catalog.config
        METER.trim()
        before = METER.rss()
        engines = [0]  # what importing engines added during this load: not the model's
        fallbacks = self.registry.available()
        # a fallback backend's sub-graphs get the same options it would get as the
        # model's own backend: its config section under its model.toml table
        tables = {b.id: backend_options(config, spec.settings, b.id) for b in fallbacks}

        isolation = spec.settings.isolation or config.workers.isolation
        if isolation != "in-process" and self.workers is None:
            log.warning("model %s: isolation = %r ignored: the daemon runs no worker "
                        "processes ([workers] isolation = \"in-process\")", entry.label,
                        isolation, extra={"MODEL": entry.name})

        isolated = self.workers is not None and isolation != "in-process"

        def load_on(choice: Choice, options: LoadOptions, *,
                    rival: bool = False) -> LoadedModel:
            with self._lock:  # held already for the first load; taken for a rival
                if isolated:
                    return self._in_worker(entry, choice, options, source.path, tables,
                                           [b.id for b in fallbacks], isolation, rival,
                                           tuple(spec.settings.cpu_affinity or ()))
                # the planner reads ONNX graphs: onnx comes in with the first model
                engines[0] += self._engine("onnx", _import_planner)
                bring_in = getattr(choice.backend, "import_engine", None)
                if callable(bring_in):
                    engines[0] += self._engine(choice.backend.id, bring_in)
                from inferd.libbackends.customops.plan import load_planned

                return load_planned(choice.backend, source.path, options,
                                    model=entry.label, model_dir=repo.root / entry.name,
                                    ops=self.customops, fallbacks=fallbacks, tables=tables,
                                    probe_timeout_s=config.backends.probe_timeout_s,
                                    strict=StrictModes(config.security.strict_modes))
        # Where it is known to run best, else the first entry of the plan that loads
        # (daemon/placer.py, which measures the plan's rivals later); custom ops and
        # nodes the backend lacks make a partitioned plan (libbackends/customops).
        # A model in worker processes has its rivals measured each in a worker of its
        # own, on its warm-up inputs, right after this load (before READY for a preload)
        placement, model = self.placer.place(entry, source.path, plan, spec.settings,
                                             config, load_on, repo.root, isolated)
        try:
            warm_up(entry.label, model, source.path, spec.settings, config.cache.warmup_dim)
            # a [stream] table that does not fit the model fails its load
            streams = (StreamModel.prepare(entry.label, spec.settings.stream, model.inputs,
                                           model.outputs, source.path.parent)
                       if spec.settings.stream is not None else None)
            rss = METER.rss() - before - engines[0]
            # Read after the load is measured: parsing the file leaves freed heap behind
            # (trimmed here), and what stays (a skeleton without weights, 0.2-2 MiB) is
            # not the engine's. A model in a worker has its graph read there: onnx's
            # shape inference on shapes a client chose runs where a crash costs little.
            graph = (_EngineGraph(model) if isinstance(model.engine, WorkerModel)
                     else _graph(entry, source.path))
            METER.trim()
            device_memory = placement.kind is not DeviceKind.CPU
            engine = model.engine
            figures = (LoadFigures.of(engine.added, engine.reported, device_memory)
                       if isinstance(engine, WorkerModel)  # measured in its worker
                       else LoadFigures.of(rss, model.memory_bytes(), device_memory))
            # plus the working memory measured at earlier loads
            total = figures.cost + entry.memory.working.peak
            entry.reserve(total)
            self.make_room(entry, total, "measured")
        except BaseException:
            model.unload()
            METER.trim()
            raise
        meter = METER.for_engine(lambda: model.engine)
        return Loaded(model, placement, settings,
                      pipeline, figures, graph, meter, streams)


    def _in_worker(self, entry: ModelEntry, choice: Choice, options: LoadOptions,
                   path: Path, tables: dict[str, Any], fallbacks: list[str],
                   isolation: str, rival: bool = False,
                   cores: tuple[int, ...] = ()) -> LoadedModel:
        """Load on ``choice`` in its worker process: the backend's worker, or the model's
        own where it brings custom ops or ``isolation`` is "model"; a ``rival`` (a
        candidate being measured) in a worker of its own, so that its crash costs only
        that worker and the candidate. ``cores``: model.toml's ``cpu_affinity``, kept to
        by its load and runs in the worker."""
        assert self.workers is not None
        config = self.catalog.config
        model_dir = self.catalog.repo.root / entry.name
        backend = choice.backend.id
        own = isolation == "model" or (model_dir / "customops").is_dir()
        call = LoadCall(backend, path, options, entry.label, model_dir, tuple(fallbacks),
                        tables, config.backends.probe_timeout_s,
                        key=(f"{entry.label}@{backend}{MEASURING}" if rival
                             else f"{entry.label}@{backend}" if own else backend),
                        strict_modes=config.security.strict_modes, cores=cores)
        model = WorkerModel(self.workers, call, config.workers.load_kill_after_s)
        # the engine as the worker that serves holds it (a measuring worker ends with its
        # candidate: counted by the candidate's reservation)
        if not rival and model.engine_bytes and self.budget.engine(backend) is None:
            self.budget.engine_imported(backend, model.engine_bytes)
            log.info("engine %s imported in worker %d: the worker holds %s with it (PSS), "
                     "counted in the cache budget from now on", backend, model.pid,
                     format_bytes(model.engine_bytes), extra={"BACKEND": backend})
        return model


class _EngineGraph:
    """The activations of a model whose engine runs in a worker, computed there (in the
    worker the model runs in now: placement may move it)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def peak(self, shapes: Any, values: Any = None) -> Any:
        engine = self._model.engine
        if not isinstance(engine, WorkerModel):
            raise ValueError("the model left its worker")
        return engine.peak(shapes, dict(values or {}))


def _import_planner() -> None:
    import inferd.libbackends.customops.plan  # noqa: F401  (and onnx with it)


def _graph(entry: ModelEntry, path: Path) -> Activations | None:
    """The activations of the model file, or None (logged) if it cannot be read as
    ONNX (its working memory is then known from measured runs only)."""
    if path.suffix != ".onnx":
        return None
    try:
        return Activations(path)
    except Exception as e:  # noqa: BLE001  onnx's parse errors have no common base
        log.info("model %s: its graph cannot be read for memory estimates (%s); its "
                 "working memory is measured only", entry.label, e,
                 extra={"MODEL": entry.name})
        return None
