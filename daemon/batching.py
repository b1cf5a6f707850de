"""How many rows a model's next batch may hold: adaptive batching, measured per model.

Whether batching pays depends on the engine and the CPU (onnxruntime on this machine's
CPU: the cost per row of ocr-cls is flat from batch 1 to 16; OpenVINO: it falls by a
third up to batch 8), so a fixed ``max_batch`` is wrong one way or the other. In
``batching = "adaptive"`` mode (the default for a model that allows batching) the
:class:`BatchSizer` measures the cost per row of the batches a model runs and lets
batches grow only while that cost falls:

- batches start at one request (no merging);
- the cost of a batch is what it costs its inference thread, from the merge to the
  last reply handed on (the run, merging and splitting, the replies);
- when a batch fills its limit (more work is waiting), a *probe* compares the limit
  with the next size of the ladder (1, 2, 4, ... up to ``max_batch``): the next runs
  alternate between the two limits, and once each has :data:`MIN_SAMPLES` full runs the
  larger one is taken if its cost per row is at least :data:`MARGIN` lower (and kept
  while it is at least half of that lower: no flapping between two sizes). The cost of
  a size is the lowest of its samples: on a busy machine a run is only ever slowed
  down (preempted), never sped up, so the fastest sample is the size's own cost;
- the limit is checked again later in both directions (a smaller size, to shrink back
  when the larger no longer pays; a larger one, to grow when it starts to): the gap
  between probes doubles while nothing changes, from :data:`FIRST_PROBE` runs up to
  :data:`MAX_INTERVAL`;
- only sizes that cost the model no switch are tried (:meth:`LoadedModel.batch_sizes`:
  OpenVINO's dynamic compile re-plans at every change of shape, ~2 ms here; its static
  compiles do not), and batches are cut to such sizes.

``batching = "fixed"`` keeps the older rule: every batch up to ``max_batch`` rows.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from enum import StrEnum
from typing import Any

from inferd.libbackends.contract import BatchSizes, LoadedModel

log = logging.getLogger(__name__)

MARGIN = 0.10
"""How much lower the cost per row of the larger size must be for it to be kept."""
MIN_SAMPLES = 5
"""Full runs of each size a probe needs before it decides."""
PROBE_RUNS = 64
"""Runs a probe may last; one that has not seen enough full runs of both sizes by then
decides nothing (not enough work waits to fill the larger size)."""
FIRST_PROBE = 16
"""Runs before the first probe, and after a change."""
MAX_INTERVAL = 4096
"""The longest gap between two probes, in runs."""
RECENT = 16
"""Runs of each size kept for the view (its lowest cost per row is shown)."""


class BatchMode(StrEnum):
    """model.toml ``batching``."""

    ADAPTIVE = "adaptive"
    FIXED = "fixed"


def ladder(max_batch: int) -> list[int]:
    """The sizes adaptive batching tries: powers of two below ``max_batch``, then it."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return sizes + [max_batch]


class BatchSizer:
    """The batch limit of one model's workers (shared by its inference threads).

    Args:
        name: the model (for the log).
        max_batch: the upper bound (model.toml ``max_batch``; 1: no batching).
        mode: adaptive or fixed.
        model: the loaded model, asked which batch sizes cost it no switch.
    """

    def __init__(self, name: str, max_batch: int, mode: BatchMode = BatchMode.ADAPTIVE,
                 model: LoadedModel | None = None) -> None:
        self.name = name
        self.max_batch = max_batch
        self.mode = mode if max_batch > 1 else BatchMode.FIXED
        self._model = model
        self._ladder = ladder(max_batch)
        self._lock = threading.Lock()
        self._size = 1 if self.mode is BatchMode.ADAPTIVE else max_batch
        self._probe: tuple[int, int] | None = None
        self._samples: dict[int, list[float]] = {}
        self._turn = 0
        self._probe_runs = 0
        self._interval = FIRST_PROBE
        self._countdown = FIRST_PROBE
        self._up = True  # the direction of the next probe
        # rows -> the costs per row of its last runs (s): the view shows the lowest
        self._cost: dict[int, deque[float]] = {}
        self._why = "not measured yet" if self.mode is BatchMode.ADAPTIVE else \
            ("batching off" if max_batch == 1 else "fixed (model.toml batching)")

    # ----------------------------------------------------------------- workers

    def limit(self) -> int:
        """The rows the next batch may hold (during a probe: each of the two sizes in
        turn)."""
        with self._lock:
            if self._probe is None:
                return self._size
            self._turn ^= 1
            return self._probe[self._turn]

    def allowed(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows costs the model no switch."""
        if self.mode is BatchMode.FIXED:
            return True
        sizes = self._sizes()
        return sizes is None or rows in sizes.free or (sizes.more > 0 and rows in self._ladder)

    def observe(self, rows: int, limit: int, seconds: float, waiting: bool = True) -> None:
        """Account for one run of ``rows`` rows formed under ``limit``; ``waiting``:
        whether more requests were queued when its batch was formed."""
        if self.mode is BatchMode.FIXED or rows <= 0:
            return
        with self._lock:
            self._cost.setdefault(rows, deque(maxlen=RECENT)).append(seconds / rows)
            if self._probe is not None:
                if rows == limit and limit in self._samples:
                    self._samples[limit].append(seconds / rows)
                self._probe_runs += 1
                if all(len(s) >= MIN_SAMPLES for s in self._samples.values()) \
                        or self._probe_runs >= PROBE_RUNS:
                    self._decide()
                return
            self._countdown -= 1
            if self._countdown > 0:
                return
            up = self._up or self._size == 1
            if up and (rows < self._size or not waiting):
                return  # nothing more waits: growing could not be measured (try again)
            self._start(up)

    def sizes(self) -> list[int]:
        """The batch sizes this model's batches are cut to or probed at: the ladder's
        sizes that cost it no switch (every size of the ladder in fixed mode)."""
        return [s for s in self._ladder if s == 1 or self.allowed(s)]

    def _start(self, up: bool) -> None:
        """Begin a probe from the current size (caller holds the lock)."""
        candidates = self.sizes()
        i = candidates.index(self._size) if self._size in candidates else 0
        pair = None
        if up and i + 1 < len(candidates):
            pair = (self._size, candidates[i + 1])
        elif not up and i > 0:
            pair = (candidates[i - 1], self._size)
        if pair is None:  # nothing in that direction: look the other way next time
            self._up = not up
            self._countdown = self._interval
            if not up or self._size == 1:
                sizes = self._sizes()
                if sizes is not None and len(candidates) == 1:
                    self._why = ("batch sizes cost this model a switch (a re-plan of its "
                                 "dynamic compile): runs of one request each")
            return
        self._probe = pair
        self._samples = {pair[0]: [], pair[1]: []}
        self._probe_runs = 0

    def _decide(self) -> None:
        """End the probe: keep the larger size only if it pays (caller holds the lock)."""
        assert self._probe is not None
        small, big = self._probe
        self._probe = None
        s, b = self._samples[small], self._samples[big]
        if len(s) < MIN_SAMPLES or len(b) < MIN_SAMPLES:
            self._interval = min(MAX_INTERVAL, self._interval * 2)
            self._countdown = self._interval
            self._up = not self._up
            return
        cost_s, cost_b = min(s), min(b)  # preemption only adds time
        # hysteresis: growing needs the margin, keeping the larger size half of it, so
        # two sizes that differ by about the margin do not take turns
        pays = cost_b <= cost_s * (1 - (MARGIN if self._size == small else MARGIN / 2))
        chosen = big if pays else small
        self._why = (f"{cost_b * 1e3:.3f} ms per row at {big} vs {cost_s * 1e3:.3f} ms at "
                     f"{small}: {'pays' if pays else 'does not pay'}")
        if chosen != self._size:
            grew = chosen > self._size
            log.info("model %s: batches of up to %d rows now (%s)", self.name, chosen,
                     self._why, extra={"MODEL": self.name})
            self._size = chosen
            self._interval = FIRST_PROBE
            self._up = grew  # keep going the same way
        else:
            self._interval = min(MAX_INTERVAL, self._interval * 2)
            self._up = not self._up
        self._countdown = self._interval

    def _sizes(self) -> BatchSizes | None:
        return self._model.batch_sizes() if self._model is not None else None

    # ----------------------------------------------------------------- view

    def describe(self) -> dict[str, Any]:
        """The ``batching`` field of ``inferctl models -v`` and the metrics."""
        with self._lock:
            return {"mode": str(self.mode), "max_batch": self.max_batch,
                    "limit": self._size, "probing": list(self._probe) if self._probe else None,
                    "cost_per_row_ms": {str(n): round(min(c) * 1e3, 4)
                                        for n, c in sorted(self._cost.items())},
                    "why": self._why}
