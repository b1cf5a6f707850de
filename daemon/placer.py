"""Measured placement: the loader's one call (:meth:`Placer.place`), and the background
thread (``inferd-placement``) that measures a model's rival backends once it serves and
moves it onto the fastest (see :mod:`inferd.daemon.placement` for the rules).

The cost is bounded: a model is measured once per machine (the decision is kept,
:mod:`inferd.daemon.decisions`), after its first load, while the first candidate
serves; each measurement stops at ``[placement] time_limit_s``; the candidates being
measured are counted in the cache's memory budget, and measuring waits
(``RETRY_S``) rather than evict a model or load past the budget.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.daemon import measure
from inferd.daemon.budget import estimate_cost
from inferd.daemon.memory import METER, LoadFigures, model_cost
from inferd.daemon.decisions import (
    Decision, DecisionKey, DecisionStore, candidate_label, cpu_model, file_sha256,
)
from inferd.daemon.placed_model import Inputs, PlacedModel
from inferd.daemon.placement import (
    Load, Mode, ModelPlacement, Room, Status, backend_options, place, rivals,
    set_threads, state_directory, threads_fixed,
)
from inferd.daemon.units import PROCESS_CORES
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import DeviceKind, LoadedModel
from inferd.libbackends.registry import Choice

log = logging.getLogger("inferd.daemon.placement")

SAMPLES = 6
"""Runs whose inputs a model keeps to be measured on (its first requests)."""
SETTLE_S = 2.0
"""After its first request, how long a model waits for more runs to measure on."""
RETRY_S = 30.0
"""How long measuring waits before it tries again when the cache is short of memory."""
GRAPH_FILE = "graph.toml"


def graphs_of(repo_root: Path, model: str) -> list[tuple[str, list[str]]]:
    """The graphs of the repository whose nodes call ``model``, each with every model
    it calls (read from each ``graph.toml``; an unreadable one is skipped: loading the
    graph reports it)."""
    found = []
    for path in sorted(Path(repo_root).glob(f"*/{GRAPH_FILE}")):
        try:
            nodes = tomllib.loads(path.read_text(encoding="utf-8")).get("nodes", [])
            members = sorted({n["model"] for n in nodes
                              if isinstance(n, dict) and isinstance(n.get("model"), str)})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError):
            continue
        if model in members:
            found.append((path.parent.name, members))
    return found


@dataclass
class Job:
    """One model version whose rivals are (to be) measured."""

    entry: Any
    """The cache entry (a ModelEntry): what the budget recosts after a move."""
    path: Path
    plan: list[Choice]
    """The rivals, reference (the plan's first of this kind) first."""
    settings: Any
    load: Load
    key: DecisionKey
    model: PlacedModel
    placement: ModelPlacement
    graphs: list[tuple[str, list[str]]] = field(default_factory=list)
    not_before: float = 0.0

    @property
    def name(self) -> str:
        return str(self.entry.name)

    @property
    def version(self) -> int:
        return int(self.entry.version)

    @property
    def label(self) -> str:
        return str(self.entry.label)


class Placer:
    """Places models and measures the ones with rivals (see the module docstring).

    Args:
        config: the daemon configuration (``[placement]``, ``[cache] warmup_dim``);
            replaced on reload with :meth:`use_config`.
        room: the cache's memory budget, which counts a candidate being measured.
        store: where decisions are kept (default: from ``[placement] directory``).
    """

    def __init__(self, config: Any, room: Room, store: DecisionStore | None = None) -> None:
        self.config = config
        self._room = room
        self.store = store if store is not None else DecisionStore(state_directory(config))
        self._cond = threading.Condition()
        self._queue: list[Job] = []
        self._jobs: dict[tuple[str, int], Job] = {}  # placed models that have rivals
        self._models: dict[tuple[str, int], PlacedModel] = {}  # every placed model
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._cpu = cpu_model()

    def use_config(self, config: Any) -> None:
        """Measure by ``config`` from now on (a reload)."""
        self.config = config

    # ----------------------------------------------------------------- the loader's call

    def place(self, entry: Any, path: Path, plan: list[Choice], settings: Any,
              config: Any, load: Load, repo_root: Path) -> tuple[ModelPlacement, PlacedModel]:
        """Load ``entry``'s version (a ModelEntry; file ``path``) where it is known to
        run best (a kept decision's winner), else on the plan's first that loads; where
        the plan has rivals of the kind that loaded and ``placement = "measured"``,
        measure them in the background. ``load`` is called again later, on the
        placement thread, for each rival; the budget recosts ``entry`` after a move.

        Raises:
            InferdError: as :func:`inferd.daemon.placement.place`.
        """
        name, version = entry.name, entry.version
        mode = Mode(settings.placement or config.placement.mode)
        threads = set_threads(settings)
        decision = key = None
        order = plan
        first = rivals(plan, plan[0].kind)
        if mode is Mode.MEASURED and len(first) > 1:
            key = self._key(path, first, settings, config, repo_root, name)
            decision = self.store.get(name, version, key)
            if decision is not None:
                won = (decision.backend, decision.kind)
                order = sorted(plan, key=lambda c: (c.backend.id, str(c.kind)) != won)
                threads = decision.threads if threads is None else threads
        placement, engine = place(name, order, settings, config, load, threads)
        model = PlacedModel(engine, on_sample=self._wake, on_unload=self._closed)
        with self._cond:
            self._models[(name, version)] = model
        found = rivals(plan, placement.kind)
        if mode is Mode.FIRST or len(found) < 2:
            if len(found) > 1:
                placement.settled(Status.FIRST, f'{placement.why}; placement = "first"')
            return placement, model
        if found != first or key is None:
            key = self._key(path, found, settings, config, repo_root, name)
        job = Job(entry, path, found, settings, load, key, model, placement,
                  graphs_of(repo_root, name))
        if decision is not None and placement.backend == decision.backend:
            # measured before: nothing to do unless `inferctl reload --remeasure`
            placement.settled(Status.KEPT, f"{decision.text()}; {self._kept(decision)}")
            self._submit(job, queued=False)
            return placement, model
        model.resample(SAMPLES)
        placement.settled(Status.MEASURING, f"{placement.why}; measuring "
                          f"{', '.join(c.backend.id for c in found)} in the background")
        self._submit(job)
        return placement, model

    def _key(self, path: Path, found: list[Choice], settings: Any, config: Any,
             repo_root: Path, name: str) -> DecisionKey:
        ids = [c.backend.id for c in found]
        relevant = {"threads": set_threads(settings),
                    "options": {b: backend_options(config, settings, b) for b in ids},
                    "onnxruntime": vars(config.onnxruntime),
                    "graphs": [g for g, _ in graphs_of(repo_root, name)]}
        return DecisionKey(file_sha256(path),
                           tuple(f"{c.backend.id} {c.backend.version} {c.kind}"
                                 for c in found),
                           self._cpu, len(PROCESS_CORES),
                           json.dumps(relevant, sort_keys=True, default=str))

    def _kept(self, decision: Decision) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(decision.measured_at))
        where = f" ({self.store.path})" if self.store.path is not None else ""
        return f"kept from the measurement of {when}{where}"

    # ----------------------------------------------------------------- the thread

    def _submit(self, job: Job, queued: bool = True) -> None:
        """Know ``job`` (for :meth:`remeasure`) and, if ``queued``, measure it."""
        with self._cond:
            self._jobs[(job.name, job.version)] = job
            if not queued:
                return
            self._queue.append(job)
            self._start()
            self._cond.notify_all()

    def _start(self) -> None:
        """Start the placement thread if it is not running (caller holds ``_cond``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="inferd-placement",
                                            daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _closed(self, model: PlacedModel) -> None:
        """A placed model was unloaded: forget it (a measurement of it in progress
        will not switch it: :meth:`PlacedModel.switch` refuses)."""
        with self._cond:
            for k in [k for k, m in self._models.items() if m is model]:
                del self._models[k]
                job = self._jobs.pop(k, None)
                if job is not None and job in self._queue:
                    self._queue.remove(job)

    def _ready(self, job: Job, now: float) -> bool:
        if now < job.not_before:
            return False
        first = job.model.first_sample_at
        return first is not None and (job.model.sampled or now - first >= SETTLE_S)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping.is_set():
                        return
                    now = time.monotonic()
                    job = next((j for j in self._queue if self._ready(j, now)), None)
                    if job is not None:
                        self._queue.remove(job)
                        break
                    # a job waits for samples or a retry time: look again soon
                    self._cond.wait(0.5 if self._queue else None)
            try:
                self._measure(job)
            except Exception:  # noqa: BLE001  measuring must never take serving down
                log.exception("model %s: measuring its placement failed; it stays on %s",
                              job.label, job.placement.backend, extra={"MODEL": job.name})
                job.placement.settled(Status.FIRST, "measuring failed (see the journal); "
                                      "the first of the plan that loads serves")

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop measuring (one in progress stops at its next run); True if the thread
        ended within ``timeout``."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def remeasure(self, names: list[str] | None = None) -> list[str]:
        """Forget the decisions of ``names`` (None: every model) and measure the loaded
        ones with rivals again; the labels of those that will be measured."""
        for name in names if names is not None else [None]:
            self.store.forget(name)
        again = []
        with self._cond:
            for job in self._jobs.values():
                if (names is not None and job.name not in names) or job in self._queue:
                    continue
                job.not_before = 0.0
                job.model.resample(SAMPLES)
                job.placement.settled(Status.MEASURING, f"{job.placement.why}; measuring "
                                      f"again (inferctl reload --remeasure)")
                self._queue.append(job)
                again.append(job.label)
            if again:
                self._start()
            self._cond.notify_all()
        return again

    # ----------------------------------------------------------------- measuring

    def _measure(self, job: Job) -> None:
        """Measure ``job``'s rivals, keep the decision, move the model to the winner."""
        cfg = self.config.placement
        deadline = time.monotonic() + cfg.time_limit_s
        # only inputs that clients sent and the serving engine answered: never made-up
        # ones (zeros for a Range's delta crashed OpenVINO's CPU plugin, SIGSEGV)
        samples = job.model.samples()
        if not samples:
            return  # unloaded since it was ready (resample() dropped them)
        each = self._room.measured((job.name, job.version)) or estimate_cost(
            job.path.stat().st_size)
        trials: list[measure.Trial] = []
        try:
            with self._room.reserve(f"measuring the placement of {job.label}",
                                    each * (len(job.plan) + 1)):
                try:
                    decision = self._decide(job, samples, deadline, trials)
                    if decision is not None:
                        self._adopt(job, decision, trials)
                finally:
                    for t in trials:
                        if t.model is not None:
                            t.model.unload()
        except InferdError as e:
            if e.code is not ErrorCode.RESOURCE_EXHAUSTED:
                raise
            log.info("model %s: measuring its placement postponed by %.0f s: the cache is "
                     "short of memory (%s)", job.label, RETRY_S, e.message,
                     extra={"MODEL": job.name})
            with self._cond:
                if (job.name, job.version) in self._jobs:
                    job.not_before = time.monotonic() + RETRY_S
                    self._queue.append(job)

    def _load(self, job: Job, trial: measure.Trial, choice: Choice) -> LoadedModel:
        """A fresh engine of ``choice`` for measuring, its load's figures on ``trial``
        (the RSS delta across the call, less an engine it imported: more than its own if
        another load ran while it waited for the loader's lock, which errs on the safe
        side); raises InferdError
        (logged by :func:`place`, like a load's fallback)."""
        METER.trim()
        before, imported = METER.rss(), sum(self._room.engines().values())
        _, engine = place(job.name, [choice], job.settings, self.config, job.load,
                          trial.threads)
        # an engine this load imported is the engine's, counted apart by the budget
        rss = METER.rss() - before - (sum(self._room.engines().values()) - imported)
        reported = engine.memory_bytes()
        trial.figures = LoadFigures(model_cost(rss, reported,
                                               choice.kind is not DeviceKind.CPU),
                                    rss, reported)
        return engine

    def _trial(self, job: Job, choice: Choice, threads: int | None, samples: list[Inputs],
               reference: list[Inputs] | None, deadline: float) -> measure.Trial:
        trial = measure.Trial(candidate_label(choice.backend.id, threads), choice.backend.id,
                              threads)
        if time.monotonic() >= deadline or self._stopping.is_set():
            limit = self.config.placement.time_limit_s
            trial.why_not = f"not measured within the time limit ({limit:g} s)"
            return trial
        try:
            trial.model = self._load(job, trial, choice)
        except InferdError as e:
            trial.why_not = f"it failed to load: {e.message}"
            return trial
        trial.why_not = measure.signature_difference(job.model, trial.model)
        if trial.why_not is None and reference is not None:
            measure.check(trial, samples, reference, self.config.placement.tolerance)
        return trial

    def _decide(self, job: Job, samples: list[Inputs], deadline: float,
                trials: list[measure.Trial]) -> Decision | None:
        """Measure every rival (into ``trials``, which the caller unloads) and decide;
        None if the reference itself cannot be run again."""
        threads = set_threads(job.settings)
        ref = self._trial(job, job.plan[0], threads, samples, None, deadline)
        trials.append(ref)
        if ref.model is None or ref.why_not is not None:
            log.warning("model %s: its placement cannot be measured: the reference backend "
                        "%s %s; it stays on %s", job.label, ref.backend, ref.why_not,
                        job.placement.backend, extra={"MODEL": job.name})
            job.placement.settled(Status.FIRST, f"measuring impossible: {ref.backend} "
                                  f"{ref.why_not}")
            return None
        try:
            reference = [ref.model.run(s) for s in samples]
        except InferdError as e:
            ref.why_not = f"it failed to run: {e.message}"
            job.placement.settled(Status.FIRST, f"measuring impossible: {ref.backend} "
                                  f"{ref.why_not}")
            return None
        for choice in job.plan[1:]:
            trials.append(self._trial(job, choice, threads, samples, reference, deadline))
        measure.time_trials(trials, samples, deadline, stop=self._stopping)
        best = measure.fastest(trials) or ref
        note = ""
        share = self._share(job)
        if share is not None and not threads_fixed(job.settings, [c.backend.id
                                                                  for c in job.plan]):
            graph, part = share
            cores = len(job.settings.cpu_affinity or PROCESS_CORES)
            more = measure.stage_threads(part, cores)
            note = (f"threads: {part:.0%} of graph {graph}'s busy time on {cores} cores "
                    f"earns {more}")
            if more > 1:
                choice = next(c for c in job.plan if c.backend.id == best.backend)
                wide = self._trial(job, choice, more, samples, reference, deadline)
                # everyone again, in turns with it: one machine state for all figures
                measure.time_trials(trials + [wide], samples, deadline, stop=self._stopping)
                best = measure.fastest(trials) or ref
                trials.append(wide)
                if wide.seconds <= best.seconds * measure.THREADS_PAY:
                    best = wide
                elif wide.why_not is None:
                    note += f", which did not pay (kept {best.threads or 1})"
        return Decision(best.backend, str(job.plan[0].kind), best.threads,
                        measure.times_ms(trials), measure.untimed(trials),
                        measure.describe_samples(samples), time.time(), note)

    def _share(self, job: Job) -> tuple[str, float] | None:
        """The graph in which ``job``'s model does the largest share of the busy time
        of the graph's models since they loaded, and that share; None outside graphs."""
        best: tuple[str, float] | None = None
        with self._cond:
            busy: dict[str, float] = {}
            for (name, _), m in self._models.items():
                busy[name] = max(busy.get(name, 0.0), m.busy_s)
        for graph, members in job.graphs:
            total = sum(busy.get(m, 0.0) for m in members)
            if total > 0:
                part = busy.get(job.name, 0.0) / total
                if best is None or part > best[1]:
                    best = (graph, part)
        return best

    def _adopt(self, job: Job, decision: Decision, trials: list[measure.Trial]) -> None:
        """Keep ``decision`` and move the model onto its winner (the winner's engine
        leaves ``trials``)."""
        self.store.put(job.name, job.version, job.key, decision)
        for label, why in decision.rejected.items():
            if not why.startswith(("it failed to load", "not measured")):
                log.warning("model %s: %s is never chosen for it: %s", job.label, label,
                            why, extra={"MODEL": job.name, "BACKEND": label.split(" ")[0]})
        text = decision.text()
        log.info("model %s: placement measured on %s: chosen: %s", job.label,
                 "; ".join(decision.inputs), text,
                 extra={"MODEL": job.name, "BACKEND": decision.backend})
        serving = job.placement.to_json()
        if (decision.backend, decision.threads) == (serving["backend"], serving["threads"]):
            job.placement.settled(Status.MEASURED, text)
            return
        winner = next(t for t in trials if (t.backend, t.threads) ==
                      (decision.backend, decision.threads))
        engine, winner.model = winner.model, None
        assert engine is not None
        if not job.model.switch(engine):
            return  # unloaded meanwhile; the decision serves its next load
        if winner.figures is not None:
            self._room.recost(job.entry, winner.figures)
        job.placement.moved(decision.backend, job.plan[0].kind,
                            getattr(engine, "device", "") or serving["device"],
                            decision.threads, text)
        log.info("model %s now runs on %s (device %s); %s is unloaded after its last run",
                 job.label, decision.label, job.placement.device,
                 candidate_label(serving["backend"], serving["threads"]),
                 extra={"MODEL": job.name, "BACKEND": decision.backend})
