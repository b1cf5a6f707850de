"""Measured placement: the loader's one call (:meth:`Placer.place`), and the background
thread (``inferd-placement``) that measures a model's rival backends and moves it onto
the fastest (see :mod:`inferd.daemon.placement` for the rules).

Where the daemon runs engines in worker processes (the default), every candidate being
measured, the serving backend's too, is loaded in a worker of its own
(``... (measuring)``): a rival that crashes costs that worker and the candidate, never
the daemon nor the serving engine. So measuring starts right after the load, on the
model's warm-up inputs, beside serving (the serving engine answers every request
meanwhile; nothing waits for an idle moment), and a preloaded model's is done before the
daemon reports ready (:meth:`Placer.settle`, within ``[placement] ready_within_s``).
With ``[workers] isolation = "in-process"`` a rival runs inside the daemon: then it runs
only on inputs that clients sent and the serving engine answered, and only while no
request is in flight (``busy``: measuring yields to traffic).

The cost is bounded: a model is measured once per machine (the decision is kept,
:mod:`inferd.daemon.decisions`); one rival at a time is loaded beside the serving engine
(and, isolated, the reference copy), counted in the cache's memory budget and within
``MACHINE_SHARE`` of the memory available, and a loser is unloaded at once; measuring
waits (``RETRY_S``) rather than evict a model or load past either; each measurement
stops after ``[placement] time_limit_s`` of measuring.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import tomllib
from collections.abc import Callable
from functools import partial
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from inferd.daemon import measure
from inferd.daemon.budget import estimate_cost, format_bytes
from inferd.daemon.memory import METER, LoadFigures
from inferd.daemon.graph import GRAPH_FILE
from inferd.daemon.decisions import (
    Decision, DecisionKey, DecisionStore, candidate_label, cpu_model, file_sha256,
)
from inferd.daemon.placed_model import Inputs, PlacedModel
from inferd.daemon.placement import (
    Load, Mode, ModelPlacement, Room, Status, backend_options, place, rivals,
    set_threads, state_directory, threads_fixed,
)
from inferd.daemon.units import PROCESS_CORES
from inferd.daemon.warmup import warmup_inputs
from inferd.daemon.workers.pool import WorkerModel
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
IDLE_WAIT_S = 0.05
"""In-process only (rivals in the daemon): while the daemon serves, measuring waits for
one of its models' runs to end, at most this long (a request can end without a run of
a placed model: a graph's between its stages, a queued one that expired)."""
MACHINE_SHARE = 0.5
"""A rival is loaded only if what it needs is at most this share of the memory the
machine has available (with or without a cache budget, which counts it too)."""


def _read_graphs(root: str) -> list[tuple[str, list[str]]]:
    """Every graph of the repository at ``root`` with the models its nodes call (read
    from each ``graph.toml``; an unreadable one is skipped: loading the graph reports
    it)."""
    found: list[tuple[str, list[str]]] = []
    try:
        folders = sorted(e.name for e in os.scandir(root) if e.is_dir())
    except OSError:
        return found
    for name in folders:
        try:
            with open(os.path.join(root, name, GRAPH_FILE), "rb") as f:
                nodes = tomllib.load(f).get("nodes", [])
            found.append((name, sorted({n["model"] for n in nodes if isinstance(n, dict)
                                        and isinstance(n.get("model"), str)})))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError,
                AttributeError):
            continue
    return found


class GraphIndex:
    """The repository's graphs (:meth:`of`: those whose nodes call a model), kept until
    a folder is added to or removed from the repository (its mtime moves) or the daemon
    reloads (:meth:`clear`): reading them costs one ``open`` per model folder, ~8 us
    here, 14 ms a load over the 1,669 folders of tests/e2e/test_onnx_node_cases.py, and
    every load asks. A graph.toml edited in place is seen at the next reload, as the
    graph itself is. A listing read within ``RACY_S`` of the repository's last change is
    not kept (a folder made in that tick may get its graph.toml after the read)."""

    RACY_S = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[int, list[tuple[str, list[str]]]]] = {}

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def of(self, repo_root: Path, model: str) -> list[tuple[str, list[str]]]:
        """The graphs whose nodes call ``model``, each with every model it calls."""
        root = str(repo_root)
        try:
            mtime = os.stat(root).st_mtime_ns
        except OSError:
            return []
        with self._lock:
            kept = self._kept.get(root)
        if kept is not None and kept[0] == mtime:
            graphs = kept[1]
        else:
            graphs = _read_graphs(root)
            if time.time_ns() - mtime >= self.RACY_S * 1e9:
                with self._lock:
                    self._kept[root] = (mtime, graphs)
        return [(g, members) for g, members in graphs if model in members]


@dataclass
class Contest:
    """One model version whose rivals are (to be) measured against each other."""

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
    loaded_why: str = ""
    """Why the load chose the backend that serves first (kept when measuring fails)."""
    isolated: bool = False
    """Its candidates load in worker processes of their own: measured beside serving."""
    seeded: bool = False
    """Its samples are its warm-up inputs (not its first requests')."""

    @property
    def name(self) -> str:
        return str(self.entry.name)

    @property
    def version(self) -> int:
        return int(self.entry.version)

    @property
    def label(self) -> str:
        return str(self.entry.label)


class _Gone(Exception):
    """The model was unloaded, or the daemon stops: measuring it ends."""


class _Unseeded(Exception):
    """The reference failed on the warm-up inputs: measure on the first requests'."""


@dataclass
class _Clock:
    """``[placement] time_limit_s`` counts the time measuring works, not its waits for
    the daemon to serve nothing."""

    limit: float
    started: float = field(default_factory=time.monotonic)
    waited: float = 0.0

    def over(self) -> bool:
        return time.monotonic() - self.started - self.waited >= self.limit


class _Serving(LoadedModel):
    """The engine serving the model, as measuring runs it (through
    :meth:`PlacedModel.run_measuring`: an unload never frees it under the run)."""

    def __init__(self, model: PlacedModel) -> None:
        self._model = model
        self.inputs, self.outputs, self.device = model.inputs, model.outputs, model.device

    def run(self, inputs: Inputs, outputs: list[str] | None = None) -> Inputs:
        result = self._model.run_measuring(inputs)
        if result is None:
            raise _Gone
        return result

    def unload(self) -> None:
        pass  # the cache's to unload, not measuring's


class _Rivals:
    """The rival engines measuring holds, each with its reservation in the budget."""

    def __init__(self) -> None:
        self._held: list[tuple[measure.Trial, ExitStack]] = []

    def hold(self, trial: measure.Trial, reservation: ExitStack) -> None:
        self._held.append((trial, reservation))

    def release(self, trial: measure.Trial) -> None:
        """Unload ``trial``'s engine (unless taken: ``trial.model`` None) and end its
        reservation."""
        for held in [h for h in self._held if h[0] is trial]:
            self._held.remove(held)
            if trial.model is not None:
                trial.model.unload()
                trial.model = None
            held[1].close()

    def release_all(self) -> None:
        for trial, _ in list(self._held):
            self.release(trial)


def _outputs(trial: measure.Trial, samples: list[Inputs],
             pause: measure.Pause) -> list[Inputs]:
    """``trial``'s outputs on every sample (it is the reference backend); [] with
    ``why_not`` set if a run fails."""
    assert trial.model is not None
    out = []
    for inputs in samples:
        pause()
        try:
            out.append(trial.model.run(inputs))
        except InferdError as e:
            trial.why_not = f"it failed to run: {e.message}"
            return []
    return out


class Placer:
    """Places models and measures the ones with rivals (see the module docstring).

    Args:
        config: returns the daemon configuration in force (``[placement]``, ``[cache]
            warmup_dim``): read from the one place that holds it (the runtime's),
            never copied here.
        room: the cache's memory budget, which counts a candidate being measured.
        store: where decisions are kept (default: from ``[placement] directory``).
        busy: whether the daemon serves a request now (queued or running, any model):
            measuring loads and runs only while it does not (more: :meth:`yield_to`).
    """

    def __init__(self, config: Callable[[], Any], room: Room,
                 store: DecisionStore | None = None,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self._config = config
        self._room = room
        self._busy_checks = [busy]
        self.store = store if store is not None else DecisionStore(state_directory(config()))
        self._cond = threading.Condition()
        self._queue: list[Contest] = []
        self._thread: threading.Thread | None = None
        self._running: Contest | None = None  # the job being measured now
        self._waiting = 0  # in _turn, waiting for the daemon to serve nothing
        self._stopping = threading.Event()
        self._cpu = cpu_model()
        self._graphs = GraphIndex()

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Measure only while ``busy()`` is false too (the server's requests in flight:
        a graph's request is open between its models' runs)."""
        self._busy_checks.append(busy)

    def _busy(self) -> bool:
        return any(check() for check in self._busy_checks)

    @property
    def config(self) -> Any:
        """The configuration in force (read through the getter it was given)."""
        return self._config()

    def reloaded(self) -> None:
        """A reload happened: graphs are read again (the configuration in force is read
        through the getter, so nothing else changes here)."""
        self._graphs.clear()

    # ----------------------------------------------------------------- the loader's call

    def place(self, entry: Any, path: Path, plan: list[Choice], settings: Any,
              config: Any, load: Load, repo_root: Path, isolated: bool = False
              ) -> tuple[ModelPlacement, PlacedModel]:
        """Load ``entry``'s version (a ModelEntry; file ``path``) where it is known to
        run best (a kept decision's winner), else on the plan's first that loads; where
        the plan has rivals of the kind that loaded and ``placement = "measured"``,
        measure them in the background. ``load`` is called again later, on the
        placement thread, for each rival (``rival=True`` where ``isolated``: each in a
        worker of its own, measured at once on the warm-up inputs, beside serving); the
        budget recosts ``entry`` after a move.

        Raises:
            InferdError: as :func:`inferd.daemon.placement.place`.
        """
        name, version = entry.name, entry.version
        mode = Mode(settings.placement or config.placement.mode)
        threads = set_threads(settings)
        decision = key = None
        order = plan
        first = rivals(plan, plan[0].kind)
        graphs = self._graphs.of(repo_root, name)
        if mode is Mode.MEASURED and len(first) > 1:
            key = self._key(path, first, settings, config, graphs)
            decision = self.store.get(name, version, key)
            if decision is not None:
                won = (decision.backend, decision.kind)
                order = sorted(plan, key=lambda c: (c.backend.id, str(c.kind)) != won)
                threads = decision.threads if threads is None else threads
        placement, engine = place(name, order, settings, config, load, threads)
        model = PlacedModel(engine, on_sample=self._wake,
                            on_unload=partial(self._closed, entry),
                            on_ran=None if isolated else self._ran)
        found = rivals(plan, placement.kind)
        if mode is Mode.FIRST or len(found) < 2:
            if len(found) > 1:
                placement.settled(Status.FIRST, f'{placement.why}; placement = "first"')
            return placement, model
        if found != first or key is None:
            key = self._key(path, found, settings, config, graphs)
        job = Contest(entry, path, found, settings, load, key, model, placement,
                  graphs, loaded_why=placement.why, isolated=isolated)
        if decision is not None and placement.backend == decision.backend:
            # measured before: nothing to do unless `inferctl reload --remeasure`
            placement.settled(Status.KEPT, f"{decision.text()}; {self._kept(decision)}")
            self._submit(job, queued=False)
            return placement, model
        self._sample(job, config)
        placement.settled(Status.MEASURING, f"{placement.why}; measuring "
                          f"{', '.join(c.backend.id for c in found)} "
                          + ("beside serving" if job.seeded else "in the background"))
        self._submit(job)
        return placement, model

    def _sample(self, job: Contest, config: Any) -> None:
        """What ``job`` is measured on: isolated, its warm-up inputs (at once); else, or
        where they cannot be made, its first requests' inputs."""
        job.seeded = False
        if job.isolated:
            try:
                inputs = warmup_inputs(job.label, job.model, job.path, job.settings,
                                       config.cache.warmup_dim)
            except InferdError as e:
                log.info("model %s: measured on its first requests: %s", job.label,
                         e.message, extra={"MODEL": job.name})
            else:
                job.model.seed([inputs])
                job.seeded = True
                return
        job.model.resample(SAMPLES)

    def _key(self, path: Path, found: list[Choice], settings: Any, config: Any,
             graphs: list[tuple[str, list[str]]]) -> DecisionKey:
        ids = [c.backend.id for c in found]
        relevant = {"threads": set_threads(settings),
                    "options": {b: backend_options(config, settings, b) for b in ids},
                    "onnxruntime": vars(config.onnxruntime),
                    "graphs": [g for g, _ in graphs]}
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

    def _submit(self, job: Contest, queued: bool = True) -> None:
        """Open ``job`` on its entry (for :meth:`remeasure`) and, if ``queued``, measure
        it."""
        job.entry.open_contest(job)  # the entry's lock, never inside ours
        with self._cond:
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

    def _ran(self) -> None:
        """A run ended (in-process): wake measuring if it waits for the daemon to serve
        nothing (read without the lock: a run missed here is seen at the wait's bound)."""
        if self._waiting:
            self._wake()

    def _closed(self, entry: Any, model: PlacedModel) -> None:
        """``entry``'s placed model was unloaded: its contest is closed and no longer
        measured (a measurement of it in progress will not switch it:
        :meth:`PlacedModel.switch` refuses)."""
        job = entry.close_contest(model)  # the entry's lock, never inside ours
        if job is None:
            return
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)

    @staticmethod
    def _when(job: Contest) -> float | None:
        """When ``job`` can be measured (monotonic), or None while it waits for samples
        (a kept run wakes the thread)."""
        first = job.model.first_sample_at
        if first is None:
            return None
        return max(job.not_before, first if job.model.sampled else first + SETTLE_S)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping.is_set():
                        return
                    now = time.monotonic()
                    times = [(w, j) for j in self._queue if (w := self._when(j)) is not None]
                    job = next((j for w, j in times if w <= now), None)
                    if job is not None:
                        self._queue.remove(job)
                        self._running = job
                        break
                    # woken by a submission, a kept sample, a stop; else at the next
                    # job's time (a retry, or samples that settle)
                    self._cond.wait(min(w for w, _ in times) - now if times else None)
            try:
                self._measure(job)
            except Exception:  # noqa: BLE001  measuring must never take serving down
                log.exception("model %s: measuring its placement failed; it stays on %s",
                              job.label, job.placement.backend, extra={"MODEL": job.name})
                job.placement.settled(Status.FIRST, f"{job.loaded_why}; measuring failed "
                                      "(see the journal)")
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def settle(self, timeout: float) -> list[str]:
        """Wait (at most ``timeout`` seconds) until no model that can be measured now is
        being or waiting to be measured: a preload's candidates are measured before the
        daemon reports ready. Returns the labels of those still measuring."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                left = [j for j in self._queue
                        if (w := self._when(j)) is not None and w <= now]
                if self._running is not None:
                    left.insert(0, self._running)
                if not left or now >= deadline or self._stopping.is_set():
                    return [j.label for j in left]
                self._cond.wait(deadline - now)

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
            for entry in self._room.entries():
                job = entry.contest
                if job is None or (names is not None and job.name not in names) or \
                        job in self._queue:
                    continue
                job.not_before = 0.0
                self._sample(job, self.config)
                job.placement.settled(Status.MEASURING, f"{job.placement.why}; measuring "
                                      f"again (inferctl reload --remeasure)")
                self._queue.append(job)
                again.append(job.label)
            if again:
                self._start()
            self._cond.notify_all()
        return again

    # ----------------------------------------------------------------- measuring

    def _measure(self, job: Contest) -> None:
        """Measure ``job``'s rivals one at a time beside the serving engine, while the
        daemon serves nothing; keep the decision, move the model to the winner."""
        # only inputs that clients sent and the serving engine answered: never made-up
        # ones (zeros for a Range's delta crashed OpenVINO's CPU plugin, SIGSEGV)
        samples = job.model.samples()
        if not samples:
            return  # unloaded since it was ready (resample() dropped them)
        clock = _Clock(self.config.placement.time_limit_s)
        rivals, copies = _Rivals(), _Rivals()
        try:
            decision, trials = self._decide(job, samples, clock, rivals, copies)
            if decision is not None:
                self._adopt(job, decision, trials, clock, rivals)
        except _Unseeded as e:
            log.info("model %s: its warm-up inputs cannot measure its placement (%s); "
                     "measured on its first requests instead", job.label, e,
                     extra={"MODEL": job.name})
            with self._cond:
                if job.entry.contest is job:  # not unloaded meanwhile
                    job.seeded = False
                    job.model.resample(SAMPLES)
                    self._queue.append(job)
        except _Gone:
            log.info("model %s: measuring its placement ended: %s", job.label,
                     "the daemon stops" if self._stopping.is_set() else "it was unloaded",
                     extra={"MODEL": job.name})
        except InferdError as e:
            if e.code is not ErrorCode.RESOURCE_EXHAUSTED:
                raise
            log.info("model %s: measuring its placement postponed by %.0f s: the cache is "
                     "short of memory (%s)", job.label, RETRY_S, e.message,
                     extra={"MODEL": job.name})
            with self._cond:
                if job.entry.contest is job:  # not unloaded meanwhile
                    job.not_before = time.monotonic() + RETRY_S
                    self._queue.append(job)
        finally:
            rivals.release_all()
            copies.release_all()
            with self._cond:
                if job not in self._queue:  # not postponed, nor queued by remeasure()
                    job.model.resample(0)  # the samples are not needed any more

    def _turn(self, job: Contest, clock: _Clock) -> None:
        """Wait until the daemon serves nothing (no request queued or running for any
        model): measuring runs and loads only between requests. Raises _Gone if the
        model was unloaded or the placer stops meanwhile. Isolated, measuring runs beside
        serving: it waits for nothing."""
        began = time.monotonic()
        while not job.isolated and not (self._stopping.is_set() or job.model.closed) \
                and self._busy():
            with self._cond:
                self._waiting += 1
                try:
                    self._cond.wait(IDLE_WAIT_S)  # woken by a run's end, or a stop
                finally:
                    self._waiting -= 1
        clock.waited += time.monotonic() - began
        if self._stopping.is_set() or job.model.closed:
            raise _Gone

    def _reserve(self, job: Contest, need: int) -> AbstractContextManager[None]:
        """Count ``need`` bytes (a rival) in the cache budget while it is loaded; with
        or without a budget, refuse (RESOURCE_EXHAUSTED) what passes ``MACHINE_SHARE``
        of the memory the machine has available."""
        available = psutil.virtual_memory().available
        label = f"measuring the placement of {job.label}"
        if need > available * MACHINE_SHARE:
            raise InferdError(f"{label} needs {format_bytes(need)} but the machine has "
                              f"{format_bytes(available)} available (measuring takes "
                              f"at most {MACHINE_SHARE:.0%} of it)",
                              ErrorCode.RESOURCE_EXHAUSTED)
        # a rival in a worker of its own: the serving model's runs are still measured
        # alone (they were dropped for the whole contest: its runs never settled, and
        # none went the I/O thread's way until the contest ended)
        return self._room.reserve(label, need, runs_here=not job.isolated)

    def _load(self, job: Contest, trial: measure.Trial, choice: Choice,
              rivals: _Rivals, rival: bool = True) -> str | None:
        """Load a fresh engine of ``choice`` into ``trial`` (held by ``rivals``, counted
        in the budget until released), its load's figures on ``trial``: the RSS delta
        across the call, less an engine it imported (more than its own if another load
        ran while it waited for the loader's lock, which errs on the safe side). Returns
        why it failed to load (logged by :func:`place`, like a load's fallback), or None.

        Raises:
            InferdError: RESOURCE_EXHAUSTED: it does not fit (nothing was loaded).
        """
        need = self._room.measured((job.name, job.version)) or estimate_cost(
            job.path.stat().st_size)
        stack = ExitStack()
        stack.enter_context(self._reserve(job, need))
        try:
            METER.trim()
            before, imported = METER.rss(), sum(self._room.engines().values())
            _, engine = place(job.name, [choice], job.settings, self.config, job.load,
                              trial.threads, rival=rival and job.isolated)
        except InferdError as e:
            stack.close()
            return f"it failed to load: {e.message}"
        except BaseException:
            stack.close()
            raise
        trial.model = engine
        rivals.hold(trial, stack)
        if isinstance(engine, WorkerModel):  # measured in its worker, not the daemon
            trial.figures = LoadFigures.of(engine.added, engine.reported,
                                           choice.kind is not DeviceKind.CPU)
            return None
        # an engine this load imported is the engine's, counted apart by the budget
        rss = METER.rss() - before - (sum(self._room.engines().values()) - imported)
        trial.figures = LoadFigures.of(rss, engine.memory_bytes(),
                                       choice.kind is not DeviceKind.CPU)
        return None

    def _candidate(self, job: Contest, choice: Choice, threads: int | None,
                   samples: list[Inputs], reference: list[Inputs], serving: measure.Trial,
                   clock: _Clock, rivals: _Rivals) -> measure.Trial:
        """Load, check and time one rival beside the serving engine, the only rival
        loaded (the one held before is released first); released again at once unless
        it can be chosen. An empty ``reference`` is filled with this one's outputs (it is
        the reference backend)."""
        trial = measure.Trial(candidate_label(choice.backend.id, threads), choice.backend.id,
                              threads)
        if clock.over():
            limit = self.config.placement.time_limit_s
            trial.why_not = f"not measured within the time limit ({limit:g} s)"
            return trial
        rivals.release_all()  # one rival at a time
        self._turn(job, clock)
        trial.why_not = self._load(job, trial, choice, rivals)
        if trial.model is None:
            return trial
        pause = lambda: self._turn(job, clock)  # noqa: E731
        trial.why_not = measure.signature_difference(job.model, trial.model)
        if trial.why_not is None and reference:
            measure.check(trial, samples, reference, self.config.placement.tolerance, pause)
        elif trial.why_not is None:
            reference.extend(_outputs(trial, samples, pause))
        if trial.why_not is None:
            # in turns with the serving engine: its time in these turns is the baseline
            beside = measure.Trial(serving.label, serving.backend, serving.threads,
                                   model=serving.model)
            measure.time_trials([beside, trial], samples, clock.over, pause=pause)
            trial.baseline = beside.measured
            if beside.why_not is not None:
                trial.why_not = f"not timed: the serving engine {beside.why_not}"
            serving.times = [a + b for a, b in zip(serving.times or [[] for _ in samples],
                                                   beside.times)]
        if trial.why_not is not None:
            rivals.release(trial)
        return trial

    def _decide(self, job: Contest, samples: list[Inputs], clock: _Clock, rivals: _Rivals,
                copies: _Rivals) -> tuple[Decision | None, list[measure.Trial]]:
        """Measure every rival (see :meth:`_candidate`) and decide; None if the
        reference cannot be run. Returns the decision and every trial. Isolated, the
        serving backend is measured through a copy in a worker of its own (held by
        ``copies``): the serving engine runs clients' requests only."""
        threads = set_threads(job.settings)
        now = job.placement.to_json()
        serving = measure.Trial(candidate_label(now["backend"], now["threads"]),
                                now["backend"], now["threads"], model=_Serving(job.model))
        if job.isolated:
            serving.model = None
            choice = next(c for c in job.plan if c.backend.id == serving.backend)
            failed = self._load(job, serving, choice, copies)
            if failed is not None:
                raise InferdError(f"a copy of the serving backend {serving.label}: {failed}")
        trials = [serving]
        reference: list[Inputs] = []
        if serving.backend == job.plan[0].backend.id:
            pause = lambda: self._turn(job, clock)  # noqa: E731
            reference.extend(_outputs(serving, samples, pause))
            if serving.why_not is not None:
                if job.seeded:
                    raise _Unseeded(f"{serving.label}: {serving.why_not}")
                self._impossible(job, serving)
                return None, trials
        order = [c.backend.id for c in job.plan]
        for choice in job.plan:
            if (choice.backend.id, threads) == (serving.backend, serving.threads):
                continue
            trial = self._candidate(job, choice, threads, samples, reference, serving,
                                    clock, rivals)
            trials.append(trial)
            if not reference:  # the reference backend itself failed
                if job.seeded and not (trial.why_not or "").startswith("it failed to load"):
                    raise _Unseeded(f"{trial.label}: {trial.why_not}")
                self._impossible(job, trial)
                return None, trials
            self._keep_best(trials, serving, order, rivals)
        best = self._best(trials, serving, order)
        note = ""
        share = self._share(job)
        if share is not None and not threads_fixed(job.settings, [c.backend.id
                                                                  for c in job.plan]):
            graph, part = share
            cores = len(job.settings.cpu_affinity or PROCESS_CORES)
            more = measure.stage_threads(part, cores)
            note = (f"threads: {part:.0%} of graph {graph}'s busy time on {cores} cores "
                    f"earns {more}")
            if more > 1 and (best.backend, more) != (serving.backend, serving.threads):
                choice = next(c for c in job.plan if c.backend.id == best.backend)
                wide = self._candidate(job, choice, more, samples, reference, serving,
                                       clock, rivals)
                trials.append(wide)
                measure.rescale(trials, serving)
                if wide.why_not is None and wide.seconds <= best.seconds * \
                        measure.THREADS_PAY:
                    best = wide
                else:
                    rivals.release(wide)
                    if wide.why_not is None:
                        note += f", which did not pay (kept {best.threads or 1})"
        measure.rescale(trials, serving)
        return Decision(best.backend, str(job.plan[0].kind), best.threads,
                        measure.times_ms(trials), measure.untimed(trials),
                        measure.describe_samples(samples), time.time(), note), trials

    @staticmethod
    def _best(trials: list[measure.Trial], serving: measure.Trial,
              order: list[str]) -> measure.Trial:
        """The fastest trial of one thread count, in the plan's order (see
        :func:`measure.fastest`); the serving engine if none was timed."""
        measure.rescale(trials, serving)
        ranked = sorted(trials, key=lambda t: (order.index(t.backend), t.threads or 0))
        return measure.fastest(ranked) or serving

    def _keep_best(self, trials: list[measure.Trial], serving: measure.Trial,
                   order: list[str], rivals: _Rivals) -> None:
        """Release every rival held but the best so far."""
        best = self._best(trials, serving, order)
        for t in trials:
            if t is not best:
                rivals.release(t)

    def _impossible(self, job: Contest, ref: measure.Trial) -> None:
        log.warning("model %s: its placement cannot be measured: the reference backend "
                    "%s %s; it stays on %s", job.label, ref.backend, ref.why_not,
                    job.placement.backend, extra={"MODEL": job.name})
        job.placement.settled(Status.FIRST, f"{job.loaded_why}; measuring impossible: "
                              f"{ref.backend} {ref.why_not}")

    def _share(self, job: Contest) -> tuple[str, float] | None:
        """The graph in which ``job``'s model does the largest share of the busy time
        of the graph's models since they loaded, and that share; None outside graphs."""
        best: tuple[str, float] | None = None
        busy: dict[str, float] = {job.name: job.model.busy_s}  # loaded or not yet
        with self._cond:
            for entry in self._room.entries():
                m = entry.model
                if isinstance(m, PlacedModel):  # loaded (any version of the name)
                    busy[entry.name] = max(busy.get(entry.name, 0.0), m.busy_s)
        for graph, members in job.graphs:
            total = sum(busy.get(m, 0.0) for m in members)
            if total > 0:
                part = busy.get(job.name, 0.0) / total
                if best is None or part > best[1]:
                    best = (graph, part)
        return best

    def _adopt(self, job: Contest, decision: Decision, trials: list[measure.Trial],
               clock: _Clock, rivals: _Rivals) -> None:
        """Keep ``decision`` and move the model onto its winner (the winner's engine
        leaves ``trials``; loaded again if it was released for a later rival)."""
        serving = job.placement.to_json()
        winner = next(t for t in trials if (t.backend, t.threads) ==
                      (decision.backend, decision.threads))
        moving = (decision.backend, decision.threads) != (serving["backend"],
                                                          serving["threads"])
        if moving and job.isolated:
            rivals.release(winner)  # measured in its own worker; served from the usual
        if moving and winner.model is None:
            self._turn(job, clock)
            failed = self._load(job, winner, next(c for c in job.plan
                                                  if c.backend.id == decision.backend),
                                rivals, rival=False)
            if failed is not None:
                raise InferdError(f"model {job.label}: the measured winner {winner.label} "
                                  f"{failed}")
        self.store.put(job.name, job.version, job.key, decision)
        for label, why in decision.rejected.items():
            if not why.startswith(("it failed to load", "not measured")):
                log.warning("model %s: %s is never chosen for it: %s", job.label, label,
                            why, extra={"MODEL": job.name, "BACKEND": label.split(" ")[0]})
        text = decision.text()
        log.info("model %s: placement measured on %s: chosen: %s", job.label,
                 "; ".join(decision.inputs), text,
                 extra={"MODEL": job.name, "BACKEND": decision.backend})
        if not moving:
            job.placement.settled(Status.MEASURED, text)
            return
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
