"""Adaptive batching (issue 20 item 2, daemon/batching.py), on runs, not on time: the
sizer is fed the cost of each run from a cost model, as the workers feed it what they
measure, and must settle on the size where the cost per row stops falling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferd.daemon.batching import (
    FIRST_PROBE, MARGIN, MAX_INTERVAL, BatchMode, BatchSizer, ladder,
)
from inferd.libbackends.contract import BatchSizes, LoadedModel


class _Sizes(LoadedModel):
    """Only what the sizer asks of a model: which batch sizes cost it no switch."""

    inputs = ()
    outputs = ()

    def __init__(self, sizes: BatchSizes | None) -> None:
        self.sizes = sizes

    def run(self, inputs: Any, outputs: Any = None) -> Any:  # pragma: no cover
        raise AssertionError("not run")

    def unload(self) -> None:  # pragma: no cover
        pass

    def batch_sizes(self) -> BatchSizes | None:
        return self.sizes


def drive(sizer: BatchSizer, cost: Callable[[int], float], runs: int,
          waiting: int = 1000) -> list[int]:
    """``runs`` runs with ``waiting`` rows always queued; the limits each ran under."""
    limits = []
    for _ in range(runs):
        limit = sizer.limit()
        rows = min(limit, waiting)
        sizer.observe(rows, limit, cost(rows), waiting > rows)
        limits.append(limit)
    return limits


def per_row(ms: dict[int, float]) -> Callable[[int], float]:
    """A run's seconds from a table of cost per row (ms) by size."""
    return lambda rows: ms[rows] * rows / 1000


FLAT = per_row({n: 0.5 for n in ladder(32)})  # onnxruntime ocr-cls on this machine's CPU
OPENVINO = per_row({1: 0.38, 2: 0.32, 4: 0.28, 8: 0.269, 16: 0.30, 32: 0.31})


def test_the_ladder_is_powers_of_two_up_to_max_batch() -> None:
    assert ladder(1) == [1]
    assert ladder(32) == [1, 2, 4, 8, 16, 32]
    assert ladder(12) == [1, 2, 4, 8, 12]


def test_where_the_cost_per_row_is_flat_batches_stay_at_one_request() -> None:
    sizer = BatchSizer("m", 32, model=_Sizes(None))
    limits = drive(sizer, FLAT, 2000)
    assert sizer.describe()["limit"] == 1
    assert max(limits) == 2  # only probed
    assert "does not pay" in sizer.describe()["why"]
    # the probes back off: far fewer runs at 2 than at 1
    assert limits.count(2) < 100


def test_batches_grow_while_the_cost_per_row_falls_by_the_margin_and_stop_there() -> None:
    sizer = BatchSizer("m", 32, model=_Sizes(None))
    drive(sizer, OPENVINO, 3000)
    # 1 -> 2 -> 4 pays (>= 10 % each); 8 at 0.269 vs 0.28 is under the margin
    assert sizer.describe()["limit"] == 4
    assert 0.269 > 0.28 * (1 - MARGIN)


def test_batches_shrink_back_when_the_larger_size_stops_paying() -> None:
    sizer = BatchSizer("m", 16, model=_Sizes(None))
    falling = per_row({1: 1.0, 2: 0.7, 4: 0.5, 8: 0.35, 16: 0.25})
    drive(sizer, falling, 2000)
    assert sizer.describe()["limit"] == 16
    drive(sizer, FLAT, 40 * MAX_INTERVAL)  # the engine changed (another model took the core)
    assert sizer.describe()["limit"] == 1


def test_no_probe_grows_a_batch_that_no_queue_fills() -> None:
    sizer = BatchSizer("m", 32, model=_Sizes(None))
    limits = drive(sizer, OPENVINO, 500, waiting=1)
    assert set(limits) == {1}


def test_only_sizes_that_cost_no_switch_are_tried() -> None:
    dynamic = BatchSizer("m", 32, model=_Sizes(BatchSizes()))
    assert set(drive(dynamic, OPENVINO, 1000)) == {1}
    assert "switch" in dynamic.describe()["why"]
    assert not dynamic.allowed(2) and not dynamic.allowed(8)
    static = BatchSizer("m", 32, model=_Sizes(BatchSizes(frozenset({1, 8}), 0)))
    limits = drive(static, OPENVINO, 1000)
    assert set(limits) <= {1, 8} and static.describe()["limit"] == 8
    assert static.allowed(8) and not static.allowed(4)
    room = BatchSizer("m", 32, model=_Sizes(BatchSizes(frozenset({1}), 3)))
    assert room.allowed(4) and not room.allowed(3)  # a compile left: ladder sizes only


def test_fixed_mode_always_allows_max_batch_and_max_batch_1_is_off() -> None:
    fixed = BatchSizer("m", 16, BatchMode.FIXED)
    assert set(drive(fixed, FLAT, 100)) == {16}
    assert fixed.describe()["mode"] == "fixed"
    off = BatchSizer("m", 1)
    assert set(drive(off, FLAT, 100)) == {1} and off.describe()["why"] == "batching off"


def test_the_first_probe_comes_after_a_few_runs_and_the_view_shows_the_costs() -> None:
    sizer = BatchSizer("m", 8, model=_Sizes(None))
    limits = drive(sizer, OPENVINO, FIRST_PROBE + 1)
    assert set(limits[:FIRST_PROBE]) == {1}
    view = sizer.describe()
    assert view["probing"] == [1, 2] and view["cost_per_row_ms"]["1"] == 0.38


def test_the_engines_switch_free_sizes_reach_the_workers_through_the_cache(
        tmp_path: Path, models_dir: Path) -> None:
    """The cache wraps a loaded model (working memory, placement): adaptive batching
    must still see OpenVINO's static compiles, or every batch size would be compiled
    (seen: x=3 and x=15 compiled through the daemon)."""
    pytest.importorskip("openvino", reason="pip openvino is in the test extras")
    from inferd.daemon.config import load_config
    from inferd.daemon.models import ModelManager
    from inferd.daemon.repository import Repository
    from inferd.ipc.replies import ReplySink
    from inferd.libbackends.openvino_backend import OpenVinoBackend
    from inferd.libbackends.registry import Registry
    from tests.links import link_file

    link_file(models_dir / "ocr-cls" / "1" / "model.onnx", tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "model.toml").write_text(
        'backends = ["openvino"]\nmax_batch = 8\n[openvino]\nstatic_shapes = 4\n')
    registry = Registry()
    registry.register(OpenVinoBackend())
    config = load_config(None, {"models.repository": str(tmp_path)})
    manager = ModelManager(Repository(tmp_path), registry, lambda: config, ReplySink())
    try:
        entry = manager.load("m")
        assert entry.threads is not None
        sizes = entry.threads.model.batch_sizes()
        assert isinstance(sizes, BatchSizes) and sizes.more + len(sizes.free) == 4, sizes
        assert not entry.threads.sizer.allowed(3) and entry.threads.sizer.allowed(4)
    finally:
        assert manager.stop(30)


def test_two_sizes_about_the_margin_apart_do_not_take_turns() -> None:
    """Growing needs the margin (10 %), keeping the larger size half of it: a size 8 %
    cheaper per row, once taken, is kept."""
    sizer = BatchSizer("m", 2, model=_Sizes(None))
    drive(sizer, per_row({1: 1.0, 2: 0.85}), 200)
    assert sizer.describe()["limit"] == 2
    drive(sizer, per_row({1: 1.0, 2: 0.92}), 20 * MAX_INTERVAL)
    assert sizer.describe()["limit"] == 2
    drive(sizer, per_row({1: 1.0, 2: 0.97}), 20 * MAX_INTERVAL)
    assert sizer.describe()["limit"] == 1
