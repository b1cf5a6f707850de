"""Measuring memory: the daemon's resident size and its peak, what a model version costs
once loaded, and what it needs while it runs (its working memory, per input-shape
class). What these figures count against the budget, and what is admitted, is
:mod:`inferd.daemon.budget`'s.

**Load.** A model's cost at load is the daemon's resident-memory growth across the load
and its warm-up (freed heap is handed back to the system first, so a delta is not hidden
by memory an earlier model left in malloc's free lists), plus what a GPU or NPU backend
reports (device memory that RSS does not show). A CPU backend's report counts the same
bytes as the RSS delta, so for it the larger of the two is taken (:func:`model_cost`).

**Working memory.** While it runs a model needs more: onnxruntime's intermediate
tensors, which for the OCR detector on a 736x2048 input are several times the model
itself. The first run of each *shape class* (every input dimension rounded up to a power
of two) is measured: the process's peak resident memory is reset
(``/proc/self/clear_refs``, value 5), the model runs, and the peak above the memory
before the run is that class's working memory. A run of a known class that is more than
``GROWTH`` larger than the largest one measured in it is measured again. Measuring runs
take one lock, so two of them never mix; a measurement taken while another model's run
was in progress in the same process (the daemon's, or the worker's the model runs in) is
not taken as the model's own. Runs in other processes do not count: their memory is not
the measured process's.

Where the peak cannot be reset (a kernel without ``clear_refs``), the growth that stays
after the run is taken instead, and that is logged once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from numpy.typing import NDArray

from inferd.daemon.activations import Activations
from inferd.ipc.libc import malloc_trim

log = logging.getLogger(__name__)

GROWTH = 1.1
"""A run this much larger (in elements) than the largest measured in its class is
measured again."""

RELIABLE_SCALE = 4
"""Without the model's graph, an estimate scaled from a measured class at most this many
times smaller is trusted enough to refuse a run that cannot fit."""

FACTORS = {"onnxruntime": 2.1, "openvino": 2.0}
"""Working memory per byte of peak activations, by backend: the prior of a model's own
factor, used until one of its runs is measured (then the model has its own: see
:data:`FIRST_RUN_FROM`). Measured by the daemon on the demo models, each size the first
run of its size in a fresh daemon after one tiny run (tests/e2e/test_memory_bound.py),
onnxruntime with the shipped arena settings and ``[cache] malloc_arenas = 2``: ocr-det
1.93, ocr-rec 2.6-2.62, ocr-cls 2.76-3.21, vad 1.65-2.0 (with glibc's own arenas: ocr-det 1.92,
ocr-rec 2.3-2.6, ocr-cls 2.7-2.95, vad 1.65-1.95). No one factor is within 30 % of
every model (vad 256x512 measures 1.65-1.71 or 1.98 by the heap's layout, ocr-cls
6x3x48x192 up to 3.21: 1.95x apart); 2.1 is -35 % (ocr-cls) to +27 % (vad) on their
first sizes. More refuses what fits: the OCR graph's detector at 736x2048 (202.7 MiB of
activations, 1.93x measured) beside its load and the engines (~50 MiB) under a 512 MiB
budget (tests/e2e/test_memory_bound.py) was refused at 2.3 (486.6 + 29.3 MiB).
OpenVINO: ocr-det 1.83-1.98, ocr-rec 1.88, ocr-cls 2.63 (bench/bench_memory.py)."""
DEFAULT_FACTOR = 2.1
"""The factor of a backend not measured (onnxruntime's)."""
MIN_FACTOR = 1.0
MAX_FACTOR = 10.0
"""The bounds of a model's own factor: a run holds at least its live activations (a lower
ratio measured memory that other runs left resident, reused unseen); beyond the upper
one a measurement is taken as a bad one."""
CALIBRATE_FROM = 1 << 20
FIRST_RUN_FROM = 16 << 20
"""A run measured alone calibrates its model's own factor if its activations are at
least :data:`CALIBRATE_FROM` (below, reused heap and fixed costs swamp the ratio) and,
for the first run after a load, :data:`FIRST_RUN_FROM`: that run also pays the engine's
one-off set-up, 0.3-1.3 MiB (ocr-det 1x3x64x64 measures 1.9 MiB for 0.38 MiB of
activations, 5x; its next class 1.96x). The model's factor is the largest ratio of its
calibrating runs: a model's ratio moves a little with the size and the heap's layout
(ocr-cls 2.76-3.21, vad 1.65-2.0), and the largest keeps the estimate on the safe
side."""
TRIES = 3
"""Measurements of a class taken beside other runs before it is measured only now and
then (:data:`RETRY_AFTER`)."""
RETRY_AFTER = 64
"""Runs of a class not measured yet, after :data:`TRIES` measurements taken beside other
runs, between two more tries: a class whose first runs all overlapped others (models
loaded together, their rivals measured for placement meanwhile) is measured once the
daemon is quieter, rather than never (then its runs would never count as settled: each
one estimated anew and none sent from the I/O thread), at the cost of one measured run
in this many while it stays busy."""
KNOWN_VALUES = 16
"""Integer inputs of at most this many elements are given to the graph by value (a
sample rate may choose a branch); the class keeps the first run's values."""
SETTLED_SHAPES = 256
"""Exact input shapes whose settled estimate is kept (a run of one of them is estimated
by one look-up); past it the kept ones are dropped and gathered again."""



class _Runs:
    """Model runs in progress, counted by the process each runs in (a worker's pid; 0:
    the daemon's own), for every meter together, and the lock a measured run holds (so
    that two never mix: a worker may hold several models). A run in one process leaves
    another's memory alone: only runs in the same process spoil a measurement."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = threading.Lock()
        self.at: dict[int, list[int]] = {}
        """By process: [runs in progress, runs begun while any was]; an entry goes when
        its last run ends (a measurement counts itself in progress: none is looking)."""

    def begin(self, where: int) -> int:
        """A run in process ``where`` begins; returns how many have begun there while
        any was in progress, this one included."""
        with self.counts:
            c = self.at.get(where)
            if c is None:
                c = self.at[where] = [0, 0]
            c[0] += 1
            c[1] += 1
            return c[1]

    def end(self, where: int) -> int:
        """The run :meth:`begin` counted in ``where`` has ended; returns how many had
        begun there while any was in progress (before this end)."""
        with self.counts:
            c = self.at[where]
            c[0] -= 1
            if c[0] == 0:
                del self.at[where]
            return c[1]


class MemoryMeter:
    """A process's resident memory and its peak: the daemon's own (:data:`METER`), or,
    given ``engine``, the process a model's engine runs in, asked at each use (a worker
    process, daemon/workers/pool.py's ``WorkerModel``, has ``pid`` and ``trim()``; an
    in-process engine has no ``pid``: the daemon's). Every meter shares one
    :class:`_Runs`.

    Args:
        engine: returns the model's current engine (placement may move it); None: this
            process.
    """

    def __init__(self, engine: Callable[[], Any] | None = None,
                 runs: _Runs | None = None) -> None:
        self._proc = psutil.Process()
        self._engine = engine
        self._runs = runs or _Runs()
        self.resettable = True

    @property
    def lock(self) -> threading.Lock:
        return self._runs.lock

    def for_engine(self, engine: Callable[[], Any]) -> MemoryMeter:
        """A meter of the process ``engine()`` runs in, sharing this one's runs."""
        return MemoryMeter(engine, self._runs)

    def _worker(self) -> Any:
        if self._engine is None:
            return None
        engine = self._engine()
        return engine if getattr(engine, "pid", None) is not None else None

    def trim(self) -> None:
        """Return free heap pages to the system (glibc ``malloc_trim``, in the worker
        for a worker's meter), so that the next RSS delta counts new memory rather than
        reused free lists."""
        w = self._worker()
        if w is None:
            malloc_trim()
        else:
            w.trim()

    def rss(self) -> int:
        w = self._worker()
        try:
            proc = self._proc if w is None else psutil.Process(w.pid)
            return int(proc.memory_info().rss)
        except psutil.NoSuchProcess:
            return 0  # a worker that died meanwhile: its run says so

    def _proc_dir(self) -> Path:
        w = self._worker()
        return Path("/proc/self") if w is None else Path(f"/proc/{w.pid}")

    def reset_peak(self) -> int:
        """Reset the peak to the current resident size; returns that size."""
        if self.resettable:
            try:
                (self._proc_dir() / "clear_refs").write_text("5")
            except (FileNotFoundError, ProcessLookupError):
                return 0  # a worker that died meanwhile: its run says so
            except OSError as e:
                self.resettable = False
                log.warning("cannot reset the peak resident memory (%s): working memory "
                            "is measured as the growth that stays after a run", e)
        return self.read()[0]

    def read(self) -> tuple[int, int]:
        """(current, peak) resident bytes of the process."""
        rss = hwm = 0
        try:
            f = open(self._proc_dir() / "status", "rb")
        except (FileNotFoundError, ProcessLookupError):
            return 0, 0  # a worker that died meanwhile: its run says so
        with f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        return rss, hwm

    def peak_since_reset(self) -> int:
        rss, hwm = self.read()
        return hwm if self.resettable else rss

    def where(self) -> int:
        """The process this meter measures: its worker's pid, 0 for the daemon's own."""
        w = self._worker()
        return 0 if w is None else int(w.pid)

    def begin_run(self) -> int:
        """A model run that is not measured begins (see :meth:`running`); returns the
        process it is counted in, for :meth:`end_run` (the model's engine may move
        before it ends)."""
        where = self.where()
        self._runs.begin(where)
        return where

    def end_run(self, where: int) -> None:
        """The run :meth:`begin_run` counted in ``where`` has ended."""
        self._runs.end(where)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a model run that is not measured while the block runs."""
        where = self.begin_run()
        try:
            yield
        finally:
            self.end_run(where)

    def measure(self, run: Callable[[], Any]) -> tuple[Any, int, bool]:
        """Call ``run()`` (a model run) with the peak reset; returns its result, the peak
        above the resident size before it, and whether it ran alone (no other model run
        in the process it measures was in progress or began meanwhile: only then is the
        figure its own)."""
        runs = self._runs
        with runs.lock:  # one measured run at a time
            where = self.where()
            started = runs.begin(where)
            alone = started == 1  # the first while any: none was in progress
            try:
                # Freed heap would be reused unseen: the run's growth must be all of it
                self.trim()
                before = self.reset_peak()
                result = run()
                used = max(0, self.peak_since_reset() - before)
            finally:
                alone = runs.end(where) == started and alone
        return result, used, alone


METER = MemoryMeter()
"""The process's meter."""


def model_cost(rss_delta: int, reported: int | None, device_memory: bool) -> int:
    """What a loaded model counts against the budget (see the module docstring).

    Args:
        rss_delta: resident-memory growth of the daemon across load and warm-up.
        reported: what the backend says the model uses, if it can tell.
        device_memory: True when the backend's report is memory outside the process
            (a GPU or NPU backend), False when it is host memory (a CPU backend).
    """
    rss_delta = max(rss_delta, 0)
    if device_memory:
        return rss_delta + (reported or 0)
    return max(rss_delta, reported or 0)


@dataclass(frozen=True)
class LoadFigures:
    """A load, measured: what it counts (``cost``), the RSS delta it came from, and
    what the backend reported."""

    cost: int
    rss: int
    reported: int | None

    @classmethod
    def of(cls, rss_delta: int, reported: int | None, device_memory: bool) -> LoadFigures:
        """The figures of a load that grew the process it ran in by ``rss_delta`` bytes
        (see :func:`model_cost`)."""
        return cls(model_cost(rss_delta, reported, device_memory), rss_delta, reported)


def format_mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shape_class(inputs: dict[str, NDArray[Any]]) -> tuple[Any, ...]:
    """Every input's dimensions rounded up to a power of two."""
    return tuple(sorted((name, tuple(1 << max(0, int(d) - 1).bit_length() for d in a.shape))
                        for name, a in inputs.items()))


def _elements(inputs: dict[str, NDArray[Any]]) -> int:
    return sum(int(math.prod(a.shape)) for a in inputs.values())


@dataclass(frozen=True)
class Estimate:
    """The working memory a run is expected to need.

    Attributes:
        bytes: the figure.
        reliable: sure enough to refuse a run that cannot fit (measured, or from the
            model's graph with every tensor sized).
        how: how it was found, for messages.
        key: the run's shape class.
        measure: whether this run is to be measured.
        graph: whether it came from the model's graph.
        settled: the figure of a class measured and already admitted at it: admitting
            it again changes nothing (only the budget's own bound is checked).
    """

    bytes: int
    reliable: bool
    how: str
    key: tuple[Any, ...]
    measure: bool
    graph: bool
    settled: bool = False


@dataclass
class _Class:
    """One shape class: the largest run seen in it (elements), its figure measured alone
    (or beside other runs, when the graph gives no estimate), its peak of activations,
    the largest figure admitted before a run, and the largest estimate from the graph
    (a floor: a measurement can be low when the run reuses memory that another model's
    runs left resident, in the shared arena or the heap, and both may need it at once)."""

    elements: int = 0
    measured: int | None = None
    tries: int = 0
    waited: int = 0  # runs not measured since the last of TRIES tries
    activations: tuple[int, int] | None = None  # (elements, bytes) of a run sized
    complete: bool = False
    admitted: int = 0
    floor: int = 0

    def counted(self) -> int:
        return max(self.measured if self.measured is not None else self.admitted,
                   self.floor)


class WorkingMemory:
    """The working memory of one model version, per shape class, kept across its loads.

    A run's need is estimated from the model's graph
    (:class:`~inferd.daemon.activations.Activations`): the peak of live activations for
    the run's shapes times the model's own factor, the largest ratio of measured working
    memory to activations among its runs measured alone (:data:`FIRST_RUN_FROM`), or
    before any, the backend's (:data:`FACTORS`). Without a graph the bytes per element
    of the largest class measured are scaled (trusted up to :data:`RELIABLE_SCALE`).

    A class counts the larger of its estimate and its measurement. A measurement counts
    only if no other model ran meanwhile (the peak is the process's: beside the OCR
    graph the recogniser measured 84.9 MiB, alone 20.8); one taken beside others is
    dropped and the class is measured again at its next run, up to :data:`TRIES` times;
    a model without a graph keeps the smallest such figure.

    Args:
        label: the model's label, for logs.
        meter: the process's meter.
    """

    def __init__(self, label: str, meter: MemoryMeter = METER) -> None:
        self.label = label
        self._meter = meter
        self._lock = threading.Lock()
        self.classes: dict[tuple[Any, ...], _Class] = {}
        self.peak = 0  # the largest figure counted
        self._graph: Activations | None = None
        self._factor = DEFAULT_FACTOR  # the backend's: the prior
        self._own: float | None = None  # the model's own, measured on its backend
        self._first = True  # the next run measured is the load's first
        self._backend = ""
        # exact input shapes -> the settled estimate of their class; emptied whenever a
        # class's figures change (admit, record, use)
        self._settled: dict[tuple[Any, ...], Estimate] = {}
        # shape class -> (elements, bytes, complete): its activations sized ahead of its
        # first run (:meth:`size`); taken by that run's class, emptied by use
        self._sized: dict[tuple[Any, ...], tuple[int, int, bool]] = {}

    def use(self, graph: Activations | None, backend: str,
            meter: MemoryMeter | None = None) -> None:
        """The model (re)loaded on ``backend``; ``graph``: its activations, if its file
        could be read as ONNX; ``meter``: the process it runs in (default the daemon).
        Classes measured before stay, and so does the model's own factor if the backend
        is the same."""
        with self._lock:
            if meter is not None:
                self._meter = meter
            self._graph = graph
            if backend != self._backend:
                self._own = None
            self._backend = backend
            self._factor = FACTORS.get(backend, DEFAULT_FACTOR)
            self._first = True
            self._settled.clear()
            self._sized.clear()
            for c in self.classes.values():  # another engine, another file: size anew
                c.activations = None

    # ----------------------------------------------------------------- estimate

    def settled(self, inputs: dict[str, NDArray[Any]]) -> bool:
        """Whether a run on inputs of these shapes belongs to a class measured already
        and not outgrown: its admission estimates nothing (no graph is read) and makes
        no room (the model counts the class's figure already; a budget that shrank
        below it refuses at once)."""
        if tuple([(n, a.shape) for n, a in inputs.items()]) in self._settled:
            return True
        key = shape_class(inputs)
        with self._lock:
            c = self.classes.get(key)
            return (c is not None and c.measured is not None
                    and _elements(inputs) <= c.elements * GROWTH)

    def estimate(self, inputs: dict[str, NDArray[Any]]) -> Estimate:
        """What a run on ``inputs`` is expected to need (see the class docstring)."""
        shapes = tuple([(n, a.shape) for n, a in inputs.items()])
        settled = self._settled.get(shapes)
        if settled is not None:  # a measured class, admitted: nothing changed since
            return settled
        key = shape_class(inputs)
        elements = _elements(inputs)
        with self._lock:
            c = self.classes.get(key)
            if c is None:
                c = self.classes[key] = _Class()
            again = c.measured is None or elements > c.elements * GROWTH
            measure = again and c.tries < TRIES
            if again and not measure:
                c.waited += 1
                if c.waited >= RETRY_AFTER:  # now and then, once more
                    measure, c.waited = True, 0
            if c.measured is not None and not again:
                need = c.counted()
                if c.admitted < need:  # admitted at this figure once, then settled
                    return Estimate(need, True, "measured", key, False, False)
                estimate = Estimate(need, True, "measured", key, False, False, True)
                if len(self._settled) >= SETTLED_SHAPES:
                    self._settled.clear()
                self._settled[shapes] = estimate
                return estimate
            graph = self._graph
        if graph is not None:
            sized = self._activations(c, graph, inputs, elements, key)
            if sized is not None:
                live, complete = sized
                factor, whose = self._model_factor()
                need = max(int(live * factor), c.measured or 0)
                return Estimate(need, complete, f"estimated from its graph: "
                                f"{format_mib(live)} of activations x {factor:.2f} "
                                f"({whose})", key, measure, True)
        return self._scaled(c, key, elements, measure)

    def _activations(self, c: _Class, graph: Activations, inputs: dict[str, NDArray[Any]],
                     elements: int, key: tuple[Any, ...]) -> tuple[int, bool] | None:
        """The class's peak of activations scaled to ``elements`` (sized once per class,
        at its first run's shapes or ahead of it: :meth:`size`); None if the graph could
        not be sized at all."""
        if c.activations is None:
            with self._lock:
                ahead = self._sized.pop(key, None)
            if ahead is None:
                peak = self._peak(graph, inputs)
                if peak is None:
                    return None
                ahead = (elements, peak.bytes, peak.complete)
            with self._lock:
                c.activations, c.complete = (ahead[0], ahead[1]), ahead[2]
        sized_elements, live = c.activations
        return int(live * elements / max(1, sized_elements)), c.complete

    def _peak(self, graph: Activations, inputs: dict[str, NDArray[Any]]) -> Any:
        """The graph's peak of activations for ``inputs``; None if it cannot be sized."""
        try:
            return graph.peak({n: a.shape for n, a in inputs.items()},
                              {n: a for n, a in inputs.items()
                               if a.dtype.kind in "iub" and a.size <= KNOWN_VALUES})
        except Exception as e:  # noqa: BLE001  shape inference's own errors: no estimate
            log.info("model %s: no estimate from its graph for %s: %s", self.label,
                     {n: list(a.shape) for n, a in inputs.items()}, e)
            return None

    def size(self, inputs: dict[str, NDArray[Any]]) -> None:
        """Read the graph for the shape class of ``inputs`` ahead of its first run (a
        stream model's batches: ModelThreads.warm_up), so that run's estimate reads
        nothing: reading the graph takes 30 to 60 ms on vad, and the run, and every
        request queued behind it, would wait for it. Nothing is admitted, counted or
        shown before that run."""
        key = shape_class(inputs)
        with self._lock:
            graph = self._graph
            c = self.classes.get(key)
            if graph is None or key in self._sized or (c is not None
                                                       and c.activations is not None):
                return
        peak = self._peak(graph, inputs)
        if peak is not None:
            with self._lock:
                self._sized[key] = (_elements(inputs), peak.bytes, peak.complete)

    def _model_factor(self) -> tuple[float, str]:
        """The model's own factor, or before it has one the backend's."""
        own = self._own
        if own is not None:
            return own, "measured on its runs"
        return self._factor, f"{self._backend or 'the backend'}'s"

    def _scaled(self, c: _Class, key: tuple[Any, ...], elements: int,
                measure: bool) -> Estimate:
        """The bytes per element of the largest class measured, times ``elements``."""
        with self._lock:
            measured = [(k.elements, k.measured) for k in self.classes.values()
                        if k.measured is not None]
        if not measured:
            return Estimate(0, False, "not known before its first run", key, measure,
                            False)
        most, used = max(measured)
        scaled = max(c.measured or 0, int(used / max(1, most) * elements))
        return Estimate(scaled, most * RELIABLE_SCALE >= elements,
                        "estimated from a measured run", key, measure, False)

    # ----------------------------------------------------------------- figures

    def admit(self, estimate: Estimate) -> bool:
        """A run is let in on ``estimate``: its class counts it (until measured, or for
        good if it came from the graph). True if that raised the model's largest
        figure."""
        if estimate.settled:
            return False
        with self._lock:
            c = self.classes.setdefault(estimate.key, _Class())
            if estimate.bytes <= c.admitted and (not estimate.graph
                                                 or estimate.bytes <= c.floor):
                return False  # nothing to count anew
            c.admitted = max(c.admitted, estimate.bytes)
            if estimate.graph:
                c.floor = max(c.floor, estimate.bytes)
            self._settled.clear()
            return self._recount()

    def begin(self) -> int:
        """A run not measured that no thread waits in begins (sent to a worker from the
        I/O thread): counted as running, as :meth:`run` counts one, until :meth:`end`
        is given what this returns."""
        return self._meter.begin_run()

    def end(self, where: int) -> None:
        """The run :meth:`begin` counted (in ``where``) has ended."""
        self._meter.end_run(where)

    def run(self, run: Callable[..., Any], *args: Any) -> Any:
        """Call ``run(*args)`` (a model run not measured), counted as running: a
        measurement meanwhile is not taken as its model's own."""
        with self._meter.running():
            return run(*args)

    def measure(self, key: tuple[Any, ...], inputs: dict[str, NDArray[Any]],
                run: Callable[[], Any]) -> tuple[Any, bool]:
        """Call ``run()`` and measure its working memory as class ``key``'s; returns its
        result and whether the figures counted for this model changed."""
        result, used, alone = self._meter.measure(run)
        return result, self.record(key, _elements(inputs), used, alone)

    def record(self, key: tuple[Any, ...], elements: int, used: int,
               alone: bool = True) -> bool:
        """Note a measurement of ``used`` bytes for class ``key``; True if the model's
        largest figure changed."""
        with self._lock:
            self._settled.clear()
            first, self._first = self._first, False  # it paid the engine's set-up
            c = self.classes.setdefault(key, _Class())
            c.tries += 1
            if not alone and (self._graph is not None or c.tries < TRIES):
                log.debug("model %s: working memory of shape class %s measured beside "
                          "other runs (%d bytes): dropped", self.label, key, used)
                return False
            if alone or c.measured is None:
                c.measured = max(c.measured or 0, used) if alone else used
            else:
                c.measured = min(c.measured, used)
            if alone and c.activations is not None and self._graph is not None:
                self._calibrate(c.activations, elements, used, first)
            c.elements = max(c.elements, elements)
            c.tries = 0 if alone else c.tries
            changed = self._recount()
        log.debug("model %s: working memory %d bytes for shape class %s", self.label,
                  used, key)
        return changed

    def _calibrate(self, activations: tuple[int, int], elements: int, used: int,
                   first: bool) -> None:
        """A run of ``elements`` (the load's first measured if ``first``) measured alone
        at ``used`` bytes; ``activations``: its class's (elements, bytes) as sized. Raises
        the model's own factor to its ratio (see :data:`FIRST_RUN_FROM`); the caller
        holds the lock."""
        live = int(activations[1] * elements / max(1, activations[0]))
        if live < (FIRST_RUN_FROM if first else CALIBRATE_FROM):
            return
        ratio = min(max(used / live, MIN_FACTOR), MAX_FACTOR)
        if self._own is None or ratio > self._own:
            log.debug("model %s: working-memory factor %.2f (%d bytes for %d of "
                      "activations)", self.label, ratio, used, live)
            self._own = ratio

    def _recount(self) -> bool:
        peak = max((c.counted() for c in self.classes.values()), default=0)
        changed, self.peak = peak != self.peak, peak
        return changed

    def describe(self) -> list[dict[str, Any]]:
        """One row per shape class run: its dimensions, what it counts, its measured
        working bytes (None: not measured alone yet), the estimate it was admitted on,
        and its peak of activations."""
        with self._lock:
            return [{"shapes": {n: list(s) for n, s in key}, "counted_bytes": c.counted(),
                     "bytes": c.measured, "admitted_bytes": c.admitted or None,
                     "activations_bytes": c.activations[1] if c.activations else None}
                    for key, c in sorted(self.classes.items())
                    if c.measured is not None or c.admitted]


class ModelMemory:
    """What one model version was measured to need: its last load, and its working
    memory (kept across loads: the next load reserves both)."""

    def __init__(self, label: str, meter: MemoryMeter = METER) -> None:
        self.load: LoadFigures | None = None
        self.working = WorkingMemory(label, meter)

    def loaded(self, figures: LoadFigures, graph: Activations | None = None,
               backend: str | None = None, meter: MemoryMeter | None = None) -> None:
        """A load was measured (or, after the engine changed, measured again); with
        ``backend``, the model now runs there, ``graph`` gives its activations and
        ``meter`` measures the process it runs in."""
        self.load = figures
        if backend is not None:
            self.working.use(graph, backend, meter)

    def total(self) -> int | None:
        """Load cost plus the largest working memory; None before the first load."""
        return None if self.load is None else self.load.cost + self.working.peak
