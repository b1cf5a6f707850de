"""Measuring placement candidates: the same inputs through each loaded candidate, its
outputs checked against the reference backend's, its runs timed; and the thread count
a graph's stage earns from its share of the graph's work.

Pure functions over loaded models; loading, memory and the decision are the placer's
(:mod:`inferd.daemon.placement`).

- **Correctness.** A candidate's outputs must have the reference's names, dtypes and
  shapes; float outputs may differ by at most ``tolerance`` times the larger of 1 and
  the reference output's largest magnitude, other outputs not at all. One sample beyond
  it and the candidate is never chosen (:func:`difference` says why).
- **Time.** Each candidate runs in turns with the serving engine (each replays the
  samples in their order, then the other, then again), so that a change in the
  machine's load falls on both alike; each sample's time is the median of its runs, a
  candidate's time per run the mean over the samples, scaled by the serving engine's
  time over all turns against its time in the candidate's turns (:func:`rescale`).
  Runs stop at ``rounds`` or when ``over()`` says so, whichever comes first (at least
  one round); ``pause()`` is called before each run (measuring yields to traffic).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
import numpy as np

from inferd.daemon.placed_model import Inputs, shapes_text
from inferd.ipc.errors import InferdError
from inferd.libbackends.contract import LoadedModel

ROUNDS = 5
"""Timed rounds per candidate when the time limit allows (after the checking run)."""

THREADS_PAY = 0.9
"""More threads are kept only if they bring a stage's time to at most this share of its
time on one thread: a gain smaller than that is within this machine's noise."""


@dataclass
class Trial:
    """One candidate being measured: a backend (with a thread count) and its figures."""

    label: str
    backend: str
    threads: int | None = None
    model: LoadedModel | None = None
    times: list[list[float]] = field(default_factory=list)
    """Per sample, the seconds of each timed run."""
    why_not: str | None = None
    """Why it cannot be chosen (failed to load, wrong results, too slow), else None."""
    figures: Any = None
    """Its load's memory figures (a LoadFigures), once loaded."""
    baseline: float | None = None
    """The serving engine's :attr:`measured` seconds in this trial's turns (None: this
    is the serving engine, or it was not timed)."""
    scale: float = 1.0
    """What :attr:`seconds` multiplies :attr:`measured` by (:func:`rescale`)."""

    @property
    def measured(self) -> float:
        """Seconds per run as timed: the mean over the samples of each one's median
        (inf before any run)."""
        if not self.times or any(not t for t in self.times):
            return math.inf
        return statistics.fmean(statistics.median(t) for t in self.times)

    @property
    def seconds(self) -> float:
        """Seconds per run, on the serving engine's scale (see the module docstring)."""
        return self.measured * self.scale


def signature_difference(reference: LoadedModel, candidate: LoadedModel) -> str | None:
    """Why ``candidate`` cannot stand in for ``reference`` (other input or output
    names, dtypes or ranks, or another fixed size), or None if it can."""
    for what, mine, theirs in (("inputs", reference.inputs, candidate.inputs),
                               ("outputs", reference.outputs, candidate.outputs)):
        a = {s.name: s for s in mine}
        b = {s.name: s for s in theirs}
        if set(a) != set(b):
            return f"its {what} are {sorted(b)}, not {sorted(a)}"
        for name, s in a.items():
            t = b[name]
            fixed = [(x, y) for x, y in zip(s.shape, t.shape)
                     if isinstance(x, int) and isinstance(y, int)]
            if s.dtype != t.dtype or len(s.shape) != len(t.shape) or any(
                    x != y for x, y in fixed):
                return (f"its {what[:-1]} {name!r} is {t.dtype} {list(t.shape)}, not "
                        f"{s.dtype} {list(s.shape)}")
    return None


def difference(reference: Inputs, got: Inputs, tolerance: float) -> str | None:
    """Why ``got`` (a candidate's outputs) is not ``reference``'s within ``tolerance``
    (see the module docstring), or None if it is."""
    if set(got) != set(reference):
        return f"it gave outputs {sorted(got)}, not {sorted(reference)}"
    for name, ref in reference.items():
        out = np.asarray(got[name])
        ref = np.asarray(ref)
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return (f"its output {name!r} is {out.dtype} {list(out.shape)}, not "
                    f"{ref.dtype} {list(ref.shape)}")
        if ref.dtype.kind in "fc":
            finite = np.isfinite(ref)
            if not np.array_equal(np.isfinite(out), finite):
                return f"its output {name!r} has NaN or infinite values where the " \
                       f"reference has none, or the other way round"
            diff = float(np.max(np.abs(out[finite] - ref[finite]), initial=0.0))
            scale = max(1.0, float(np.max(np.abs(ref[finite]), initial=0.0)))
            if diff > tolerance * scale:
                return (f"its output {name!r} differs by {diff:.3g} (tolerance "
                        f"{tolerance:g} x {scale:.3g})")
        elif not np.array_equal(out, ref):
            wrong = int(np.count_nonzero(out != ref)) if out.shape == ref.shape else -1
            return f"its output {name!r} differs in {wrong} of {ref.size} values"
    return None


Pause = Callable[[], None]


def check(trial: Trial, samples: list[Inputs], reference: list[Inputs],
          tolerance: float, pause: Pause = lambda: None) -> None:
    """Run ``trial`` once on every sample and compare with ``reference`` (the
    reference backend's outputs on the same samples); sets ``why_not`` if it differs
    or fails."""
    assert trial.model is not None
    for i, (inputs, ref) in enumerate(zip(samples, reference)):
        pause()
        try:
            got = trial.model.run(inputs)
        except InferdError as e:
            trial.why_not = f"it failed to run: {e.message}"
            return
        why = difference(ref, got, tolerance)
        if why is not None:
            trial.why_not = why + (f" on sample {i + 1}" if len(samples) > 1 else "")
            return


def time_trials(trials: list[Trial], samples: list[Inputs], over: Callable[[], bool],
                rounds: int = ROUNDS, pause: Pause = lambda: None) -> None:
    """Time every trial without ``why_not`` on ``samples``, in turns (see the module
    docstring), adding to the times it has, until ``rounds`` more or ``over()``; at
    least one round. A trial that fails to run gets ``why_not``."""
    live = [t for t in trials if t.why_not is None and t.model is not None]
    for t in live:
        if len(t.times) != len(samples):
            t.times = [[] for _ in samples]
    for n in range(rounds):
        if n and over():
            break
        for t in live:
            if t.why_not is not None:
                continue
            assert t.model is not None
            for i, inputs in enumerate(samples):
                pause()
                started = time.perf_counter()
                try:
                    t.model.run(inputs)
                except InferdError as e:
                    t.why_not = f"it failed to run: {e.message}"
                    break
                t.times[i].append(time.perf_counter() - started)


def fastest(trials: list[Trial], margin: float = 0.02) -> Trial | None:
    """The fastest trial that can be chosen; one within ``margin`` of an earlier one
    (in plan order) does not beat it, so noise does not move a model for nothing."""
    best: Trial | None = None
    for t in trials:
        if t.why_not is not None or math.isinf(t.seconds):
            continue
        if best is None or t.seconds < best.seconds * (1 - margin):
            best = t
    return best


def rescale(trials: list[Trial], serving: Trial) -> None:
    """Put every trial timed beside ``serving`` (the serving engine, timed in each of
    their turns) on its scale: its figure times the serving engine's over all turns
    over the serving engine's in its own turns."""
    for t in trials:
        if t is not serving and t.baseline and math.isfinite(t.baseline) \
                and math.isfinite(serving.measured):
            t.scale = serving.measured / t.baseline


def stage_threads(share: float, cores: int) -> int:
    """The engine threads a graph stage earns: its share of the graph's busy time in
    cores, rounded up, at least 1 and at most ``cores`` (the slowest stage takes the
    cores the others leave idle: 70 % of the work on 2 cores gives 2 threads)."""
    if cores <= 1 or share <= 0:
        return 1
    return max(1, min(cores, math.ceil(share * cores - 1e-9)))


def times_ms(trials: list[Trial]) -> dict[str, float]:
    """Each timed trial's milliseconds per run, by label."""
    return {t.label: round(t.seconds * 1000, 3) for t in trials
            if t.why_not is None and not math.isinf(t.seconds)}


def untimed(trials: list[Trial]) -> dict[str, str]:
    """Each trial that cannot be chosen, with why."""
    return {t.label: t.why_not for t in trials if t.why_not is not None}


def describe_samples(samples: list[Inputs]) -> tuple[str, ...]:
    """The samples' input shapes, each once, with how many samples had it
    (``x=1x3x48x192 (3 runs)``), for the decision and the journal."""
    counts: dict[str, int] = {}
    for s in samples:
        text = shapes_text(s)
        counts[text] = counts.get(text, 0) + 1
    return tuple(f"{t} ({n} run{'s' if n > 1 else ''})" for t, n in counts.items())
