"""A loaded model that can move to another backend between two runs, and that keeps the
inputs of its first runs that its engine answered (in the order they came, repeats too:
a dynamic-shape engine pays for a change of shape, and traffic brings both) and its busy
time for the placement's measuring.

The cache's workers run a :class:`PlacedModel` like any loaded model. When the
background measuring finds a faster candidate, :meth:`PlacedModel.switch` makes the
winner serve every run that starts from then on; runs already inside the old engine
finish there, and the last one to finish unloads it. No worker is restarted, no queue is
drained, no request fails.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.libbackends.contract import BatchSizes, LoadedModel

Inputs = dict[str, NDArray[Any]]

SAMPLE_BYTES = 32 * 2**20
"""At most this many bytes of inputs are kept for measuring (a run that would go over
is not kept): one detector image of 1x3x736x2048 (18 MiB), many classifier batches."""
SAMPLE_SECONDS = 1.0
"""Runs stop being kept once the kept ones took this long: one replay of the samples
costs each candidate about this much (a detector's few large images, a classifier's
many small batches)."""


def shapes_text(inputs: Inputs) -> str:
    """``x=1x3x48x192`` (several inputs comma-separated), for figures and the journal."""
    return ", ".join(f"{n}={'x'.join(map(str, a.shape)) or 'scalar'}"
                     for n, a in sorted(inputs.items()))


def _own_pages(array: NDArray[Any]) -> NDArray[Any]:
    """A copy of ``array`` in a mapping of its own: a sample kept for seconds beside the
    runs' working memory must not pin the heap they grow and shrink (malloc would place
    an 18 MiB copy inside it once its mmap threshold has risen: measured, the OCR
    graph's peak RSS 760-980 MiB with samples kept on the heap, 740 MiB without)."""
    if array.dtype.hasobject or array.nbytes == 0:
        return np.array(array, copy=True)
    pages = mmap.mmap(-1, array.nbytes)
    copy: NDArray[Any] = np.frombuffer(pages, dtype=array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


class PlacedModel(LoadedModel):
    """The model a cache entry serves, whichever engine runs it now.

    Args:
        model: the engine the placement loaded first.
        on_sample: called (without arguments) after a run whose inputs were kept.
        on_unload: called with this model once it is unloaded.
        on_ran: called (without arguments) after every run.
    """

    def __init__(self, model: LoadedModel, on_sample: Callable[[], None] | None = None,
                 on_unload: Callable[[PlacedModel], None] | None = None,
                 on_ran: Callable[[], None] | None = None) -> None:
        self.inputs = model.inputs
        self.outputs = model.outputs
        self.device = model.device
        self._current = model
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}  # id(engine) -> runs inside it now
        self._retired: list[LoadedModel] = []  # switched away from, runs still inside
        self._want = 0
        self._on_sample = on_sample
        self._on_unload = on_unload
        self._on_ran = on_ran
        self._closed = False
        self._samples: list[Inputs] = []
        self._kept_bytes = 0
        self._kept_s = 0.0
        self.first_sample_at: float | None = None
        self.busy_s = 0.0
        """Seconds spent inside the engines since the load (every run)."""
        self.runs = 0

    @property
    def engine(self) -> LoadedModel:
        """The engine that runs the next run."""
        return self._current

    def run(self, inputs: Inputs, outputs: list[str] | None = None) -> Inputs:
        engine, copy = self._begin(inputs)
        started = time.perf_counter()
        ok = False
        try:
            result = engine.run(inputs, outputs)
            ok = True
            return result
        finally:
            self._end(engine, copy, time.perf_counter() - started, ok)

    def start(self, inputs: Inputs, outputs: list[str] | None = None,
              into: Any = None) -> Started | None:
        """Send a run to the serving engine without waiting for it (the I/O thread's
        way, daemon/model_threads.py), kept and counted as :meth:`run` keeps and counts
        one; None if the engine cannot (one in the daemon, or one whose worker is gone:
        the caller runs it the waiting way)."""
        engine, copy = self._begin(inputs)
        call = None
        try:
            start = getattr(engine, "start", None)
            if start is not None:
                call = start(inputs, outputs, into)
        finally:
            if call is None:
                self._leave(engine)
        return None if call is None else Started(self, engine, copy, call)

    def _begin(self, inputs: Inputs) -> tuple[LoadedModel, Inputs | None]:
        """The engine a run goes into (counted as in use) and, if the run is to be kept
        as a sample, a copy of its inputs: made before the run (a request's arrays are
        views of its message frames), kept only if the engine answers it: inputs the
        serving engine refuses (a Range whose delta is 0) are never replayed through a
        rival, whose native code may not refuse them as cleanly."""
        with self._lock:
            engine = self._enter()
            keep = len(self._samples) < self._want and self._kept_s < SAMPLE_SECONDS
        return engine, self._copy(inputs) if keep else None

    def _end(self, engine: LoadedModel, copy: Inputs | None, took: float, ok: bool) -> None:
        """A run that :meth:`_begin` began ended after ``took`` seconds (``ok``: the
        engine answered it)."""
        with self._lock:  # one turn of the lock on the way out
            self.busy_s += took
            kept = ok and copy is not None and self._keep(copy, took)
            self.runs += 1
            done = self._left(engine)
        if done:
            engine.unload()
        if kept and self._on_sample is not None:
            self._on_sample()
        if self._on_ran is not None:
            self._on_ran()

    def _enter(self) -> LoadedModel:
        """The engine the next run goes into, counted as in use (caller holds ``_lock``)."""
        engine = self._current
        self._active[id(engine)] = self._active.get(id(engine), 0) + 1
        return engine

    def _leave(self, engine: LoadedModel) -> None:
        """A run left ``engine``; the last run out of a retired engine unloads it."""
        with self._lock:
            done = self._left(engine)
        if done:
            engine.unload()

    def _left(self, engine: LoadedModel) -> bool:
        """Count a run out of ``engine`` (caller holds ``_lock``); True if it was the last
        one in a retired engine, which the caller then unloads."""
        left = self._active[id(engine)] = self._active[id(engine)] - 1
        done = left == 0 and any(e is engine for e in self._retired)
        if done:
            self._retired = [e for e in self._retired if e is not engine]
            del self._active[id(engine)]
        return done

    def run_unsampled(self, inputs: Inputs) -> Inputs:
        """One run that is not kept as a sample nor counted as busy (the warm-up)."""
        return self._current.run(inputs)

    def run_measuring(self, inputs: Inputs) -> Inputs | None:
        """One run of the serving engine for measuring (on the placement thread, beside
        the workers): not kept, not counted as busy. None if the model is unloaded; an
        unload while the run is inside the engine leaves the engine to this run, which
        unloads it on its way out."""
        with self._lock:
            if self._closed:
                return None
            engine = self._enter()
        try:
            return engine.run(inputs)
        finally:
            self._leave(engine)

    @property
    def closed(self) -> bool:
        """Whether the model was unloaded."""
        return self._closed

    def _fits(self, inputs: Inputs) -> bool:
        """Whether ``inputs`` would fit among the samples (caller holds ``_lock``)."""
        size = sum(a.nbytes for a in inputs.values())
        return len(self._samples) < self._want and self._kept_bytes + size <= SAMPLE_BYTES

    def _copy(self, inputs: Inputs) -> Inputs | None:
        """A copy of ``inputs`` if they would fit among the samples, else None."""
        with self._lock:
            if not self._fits(inputs):
                return None
        return {n: _own_pages(a) for n, a in inputs.items()}

    def _keep(self, copy: Inputs, took: float) -> bool:
        """Keep ``copy`` as a sample if there is still room (caller holds ``_lock``)."""
        if not self._fits(copy):
            return False
        self._kept_bytes += sum(a.nbytes for a in copy.values())
        self._kept_s += took
        self._samples.append(copy)
        if self.first_sample_at is None:
            self.first_sample_at = time.monotonic()
        return True

    @property
    def sampled(self) -> bool:
        """Whether as many runs as wanted are kept, or the kept ones took
        ``SAMPLE_SECONDS``."""
        with self._lock:
            return len(self._samples) >= self._want or self._kept_s >= SAMPLE_SECONDS

    def samples(self) -> list[Inputs]:
        """The inputs of the runs kept so far, in the order they ran."""
        with self._lock:
            return list(self._samples)

    def resample(self, samples: int) -> None:
        """Keep the inputs of the next ``samples`` runs (at most ``SAMPLE_BYTES`` in
        all), dropping those kept before."""
        with self._lock:
            self._want = samples
            self._samples, self._kept_bytes, self._kept_s = [], 0, 0.0
            self.first_sample_at = None

    def seed(self, samples: list[Inputs]) -> None:
        """Measure on ``samples`` (its warm-up inputs) rather than on its first runs'."""
        with self._lock:
            self._want = len(samples)
            self._samples = list(samples)
            self._kept_bytes = sum(a.nbytes for s in samples for a in s.values())
            self._kept_s = 0.0
            self.first_sample_at = time.monotonic()

    def switch(self, engine: LoadedModel) -> bool:
        """Serve every run that starts from now on with ``engine``; the engine it
        replaces is unloaded at once if idle, else by its last run. False (and
        ``engine`` unloaded) if this model was unloaded meanwhile."""
        with self._lock:
            closed = self._closed
            old, idle = self._current, False
            if not closed:
                self._current, self.device = engine, engine.device
                if self._active.get(id(old)):
                    self._retired.append(old)  # its last run unloads it
                else:
                    self._active.pop(id(old), None)
                    idle = True
        if closed:
            engine.unload()
            return False
        if idle:
            old.unload()
        return True

    def unload(self) -> None:
        # The workers have stopped; a measuring run may still be inside an engine: that
        # one is left to it (run_measuring unloads it on its way out)
        with self._lock:
            engines = [self._current, *self._retired]
            self._retired = [e for e in engines if self._active.get(id(e))]
            idle = [e for e in engines if not self._active.get(id(e))]
            self._want, self._samples, self._closed = 0, [], True
            self._kept_bytes = 0
        for engine in idle:
            engine.unload()
        if self._on_unload is not None:
            self._on_unload(self)

    def memory_bytes(self) -> int | None:
        return self._current.memory_bytes()

    def describe(self) -> dict[str, Any]:
        return self._current.describe()

    def batch_sizes(self) -> BatchSizes | None:
        return self._current.batch_sizes()  # adaptive batching asks the engine


class Started:
    """A run that :meth:`PlacedModel.start` sent to its engine, not answered yet: the
    engine's call (``fileno``, ``deadline``, ``receive``, ``late``: daemon/workers/pool.py
    ``Call``), and the model's count of it, settled by :meth:`outputs`."""

    __slots__ = ("_model", "_engine", "_copy", "_call", "_began", "deadline")

    def __init__(self, model: PlacedModel, engine: LoadedModel, copy: Inputs | None,
                 call: Any) -> None:
        self._model, self._engine, self._copy, self._call = model, engine, copy, call
        self._began = time.perf_counter()
        self.deadline: float = call.deadline

    def fileno(self) -> int:
        return int(self._call.fileno())

    def receive(self) -> bool:
        return bool(self._call.receive())

    def late(self) -> None:
        self._call.late()

    def outputs(self) -> tuple[Inputs, float]:
        """The run's outputs and the engine's own seconds (raises as the run would)."""
        ok = False
        try:
            result: tuple[Inputs, float] = self._call.outputs()
            ok = True
            return result
        finally:
            self._model._end(self._engine, self._copy,
                             time.perf_counter() - self._began, ok)
