"""Measured placement (daemon/placer.py, placement.py, measure.py, decisions.py,
placed_model.py): two test backends that sleep a known time per run make "which is
faster" deterministic; one that doubles its input gives wrong results. The models are a
real ONNX file (its hash keys the decision); the test backends run it in numpy.

The memory budget here is ``RecordingRoom``, which records what the placer reserves and
refuses on demand: the cache's own budget (daemon/budget.py) is exercised with the real
daemon in tests/e2e/test_placement.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import os
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.daemon.config import load_config
from inferd.daemon.decisions import Decision, DecisionKey, DecisionStore, cpu_model
from inferd.daemon.measure import Trial, difference, fastest, stage_threads
from inferd.daemon.model_entry import ModelEntry
from inferd.daemon.model_settings import ModelSettings, check_settings
from inferd.daemon.placed_model import PlacedModel
from inferd.daemon.placer import GraphIndex, Placer
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)
from inferd.libbackends.registry import Registry

SLOW_S, FAST_S = 0.030, 0.006


class SleepModel(LoadedModel):
    """y = x * scale, after sleeping ``delay / threads`` seconds per run."""

    def __init__(self, delay: float, scale: float, threads: int, log: list[str],
                 name: str, shape: tuple[int | None, ...] = (None, 4)) -> None:
        self.inputs = (TensorSpec("x", "float32", shape),)
        self.outputs = (TensorSpec("y", "float32", shape),)
        self.device = "CPU"
        self._delay, self._scale, self._threads = delay, scale, threads
        self._log, self._name = log, name
        self.unloaded = False
        self.seen: list[Any] = []
        """Every input x it ran on (copies)."""

    def run(self, inputs: dict[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        assert not self.unloaded, f"{self._name} ran after its unload"
        self.seen.append(np.array(inputs["x"], copy=True))
        if np.isnan(inputs["x"]).any():  # as onnxruntime refuses a Range's delta of 0
            raise InferdError(f"{self._name} refuses NaN", ErrorCode.INVALID_ARGUMENT)
        time.sleep(self._delay / self._threads)
        return {"y": inputs["x"] * np.float32(self._scale)}

    def unload(self) -> None:
        self.unloaded = True
        self._log.append(f"unload {self._name}")


class SleepBackend(Backend):
    kind = DeviceKind.CPU

    def __init__(self, id: str, delay: float, scale: float = 1.0, version: str = "1.0",
                 fail: str = "", shape: tuple[int | None, ...] = (None, 4)) -> None:
        self.id, self.version = id, version
        self._delay, self._scale, self._fail, self._shape = delay, scale, fail, shape
        self.loads: list[LoadOptions] = []
        self.log: list[str] = []
        self.models: list[SleepModel] = []

    def probe(self) -> Probe:
        return Probe(True, devices=("cpu",))

    def supports(self, model_path: Path) -> tuple[bool, str]:
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        if self._fail:
            raise InferdError(f"{self.id} cannot load {model_path}: {self._fail}")
        self.loads.append(options)
        model = SleepModel(self._delay, self._scale, options.threads or 1, self.log,
                           f"{self.id}#{len(self.loads)}", self._shape)
        self.models.append(model)
        return model


class RecordingRoom:
    """The budget's two calls the placer makes; ``refuse`` makes reserve() say no."""

    def __init__(self) -> None:
        self.reserved: list[tuple[str, int]] = []
        self.recosted: list[tuple[Any, Any]] = []
        self.refuse = False
        self.held = self.most = 0
        self.known: list[Any] = []

    def recost(self, entry: Any, figures: Any) -> None:
        self.recosted.append((entry, figures))

    def engines(self) -> dict[str, int]:
        return {}

    def entries(self) -> list[Any]:
        """The cache's entries: those :func:`place` made."""
        return self.known

    cost = 1000
    """What the model cost at its last load, as the budget says."""

    def measured(self, key: tuple[str, int]) -> int | None:
        return self.cost

    @contextlib.contextmanager
    def reserve(self, label: str, need: int, runs_here: bool = True) -> Iterator[None]:
        if self.refuse:
            raise InferdError("model needs 3 KiB but the budget is 1 KiB",
                              ErrorCode.RESOURCE_EXHAUSTED)
        self.reserved.append((label, need))
        self.held += need
        self.most = max(self.most, self.held)
        try:
            yield
        finally:
            self.held -= need


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo" / "m" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not really onnx, but a file whose hash keys the decision")
    return tmp_path / "repo"


def make(backends: list[Backend], directory: Path | None, busy: Any = lambda: False,
         **overrides: Any) -> tuple[Placer, Registry, RecordingRoom]:
    config = load_config(None, {"placement.time_limit_s": 30.0, **overrides})
    registry = Registry()
    for b in backends:
        registry.register(b)
    room = RecordingRoom()
    return Placer(lambda: config, room, DecisionStore(directory), busy), registry, room


def place(placer: Placer, registry: Registry, repo: Path,
          settings: ModelSettings | None = None) -> tuple[Any, PlacedModel]:
    path = repo / "m" / "1" / "model.onnx"
    plan = registry.plan("m", path, settings.backends if settings else None)
    entry = ModelEntry("m", 1, 8)
    placer._room.known.append(entry)  # type: ignore[attr-defined]  # a RecordingRoom
    return placer.place(entry, path, plan, settings or ModelSettings(),
                        placer.config,
                        lambda choice, options: choice.backend.load(path, options), repo)


def serve(model: PlacedModel, runs: int = 3) -> None:
    """The model's first requests: distinct shapes, as a graph's stages bring them."""
    for i in range(runs):
        x = np.arange(4 * (i + 1), dtype=np.float32).reshape(i + 1, 4)
        np.testing.assert_array_equal(model.run({"x": x})["y"], x)


def settled(placement: Any, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while placement.to_json()["status"] == "measuring":
        assert time.monotonic() < deadline, placement.to_json()
        time.sleep(0.02)
    return placement.to_json()


def postponed(caplog: Any, timeout: float = 30.0) -> str:
    """The first 'postponed' line the placer logs (waited for)."""
    deadline = time.monotonic() + timeout
    while True:
        line = next((r.getMessage() for r in caplog.records
                     if "postponed" in r.getMessage()), None)
        if line is not None:
            return line
        assert time.monotonic() < deadline, "no 'postponed' line"
        time.sleep(0.02)


@pytest.mark.slow
def test_the_faster_backend_takes_over_and_the_slower_is_unloaded(repo: Path) -> None:
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, room = make([slow, fast], None)
    placement, model = place(placer, registry, repo)
    try:
        first = placement.to_json()
        assert (first["backend"], first["status"]) == ("slow", "measuring")
        assert "measuring slow, fast in the background" in first["why"]
        serve(model)
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("fast", "measured")
        assert now["why"].startswith("fast, ") and " vs slow " in now["why"]
        assert now["why"].split(" vs ")[0].endswith("ms") and "(measured)" in now["why"]
        # the serving engine moved; the first one and the measuring copies are unloaded
        assert model.engine is fast.models[-1]
        assert all(m.unloaded for m in slow.models) and slow.models
        assert [m.unloaded for m in fast.models] == [True] * (len(fast.models) - 1) + [False]
        serve(model, 1)
        # the one rival was counted in the budget (one model's cost) while it was
        # measured beside the serving engine (the reference: no copy of it), and the
        # model's cost is the winner's load from now on
        assert room.reserved == [("measuring the placement of m version 1", 1000)]
        assert len(slow.loads) == 1
        assert room.held == 0
        assert [e.label for e, _ in room.recosted] == ["m version 1"]
    finally:
        placer.stop()
        model.unload()
    assert all(m.unloaded for m in fast.models)


@pytest.mark.slow
def test_a_candidate_with_wrong_results_is_never_chosen(repo: Path, caplog: Any) -> None:
    ok, wrong = SleepBackend("ok", SLOW_S), SleepBackend("wrong", FAST_S, scale=2.0)
    placer, registry, _ = make([ok, wrong], None)
    placement, model = place(placer, registry, repo)
    caplog.set_level(logging.INFO, "inferd.daemon.placement")
    try:
        serve(model)
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("ok", "measured")
        assert "not chosen: wrong (its output 'y' differs by" in now["why"]
        assert model.engine is ok.models[0]  # never switched
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("wrong is never chosen for it: its output 'y' differs by" in m
                   for m in warned), warned
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_the_decision_survives_a_restart_and_a_new_version_measures_again(
        repo: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], state)
    placement, model = place(placer, registry, repo)
    serve(model)
    assert settled(placement)["backend"] == "fast"
    placer.stop()
    model.unload()
    stored = json.loads((state / "decisions.json").read_text())["decisions"]["m/1"]
    assert stored["decision"]["backend"] == "fast"
    assert stored["key"]["cpu"] == cpu_model()

    # a restart: a new placer and a new store on the same directory load the winner
    slow2, fast2 = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, room = make([slow2, fast2], state)
    placement, model = place(placer, registry, repo)
    try:
        now = placement.to_json()
        assert (now["backend"], now["status"]) == ("fast", "kept")
        assert "kept from the measurement of" in now["why"] and str(state) in now["why"]
        assert not slow2.loads and len(fast2.loads) == 1
        serve(model)
        assert placer._thread is None and not room.reserved  # nothing measured
    finally:
        placer.stop()
        model.unload()

    # a new version of a backend: the key changed, the first of the plan serves and the
    # rivals are measured again
    slow3, fast3 = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S, version="1.1")
    placer, registry, _ = make([slow3, fast3], state)
    placement, model = place(placer, registry, repo)
    try:
        assert placement.to_json()["backend"] == "slow"
        assert placement.to_json()["status"] == "measuring"
        serve(model)
        assert settled(placement)["backend"] == "fast"
    finally:
        placer.stop()
        model.unload()
    key = json.loads((state / "decisions.json").read_text())["decisions"]["m/1"]["key"]
    assert "fast 1.1 cpu" in key["backends"]


@pytest.mark.slow
def test_a_rival_runs_only_on_inputs_a_client_sent_and_the_first_engine_answered(
        repo: Path) -> None:
    """The crash of 698a2f0 (test_onnx_node_cases: SIGSEGV in OpenVINO's CPU plugin):
    a model whose input sizes are all fixed was measured at once on warm-up zeros, and a
    Range node given a delta of 0 crashed the rival. Here the rival records what it ran
    on: nothing but the one request the serving engine answered, after it came."""
    fixed = (1, 4)
    ref = SleepBackend("ref", SLOW_S, shape=fixed)
    rival = SleepBackend("rival", FAST_S, shape=fixed)
    placer, registry, _ = make([ref, rival], None)
    placement, model = place(placer, registry, repo)
    try:
        assert placement.to_json()["status"] == "measuring"
        refused = {"x": np.array([[1, np.nan, 3, 4]], np.float32)}
        with pytest.raises(InferdError, match="refuses NaN"):
            model.run(refused)  # the serving engine refuses it: never kept
        sent = {"x": np.array([[1, 2, 3, 4]], np.float32)}
        np.testing.assert_array_equal(model.run(sent)["y"], sent["x"])
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("rival", "measured"), now
        ran = [x for m in rival.models for x in m.seen]
        assert ran and all(np.array_equal(x, sent["x"]) for x in ran), ran
        # the serving engine is the reference (no copy of it is loaded): after the two
        # requests, it was run on the one it answered only
        assert len(ref.models) == 1
        served, measured = ref.models[0].seen[:2], ref.models[0].seen[2:]
        assert np.isnan(served[0]).any() and np.array_equal(served[1], sent["x"])
        assert measured and all(np.array_equal(x, sent["x"]) for x in measured)
    finally:
        placer.stop()
        model.unload()


def test_unloading_at_once_after_the_first_request_never_runs_a_freed_engine(
        repo: Path, caplog: Any, monkeypatch: Any) -> None:
    """Load, one request, unload at once, many times (test_onnx_node_cases' loop), each
    model ready to be measured after its first run: no engine runs after its unload
    (SleepModel.run asserts it), measuring never fails, and every engine measuring
    loaded is unloaded."""
    monkeypatch.setattr("inferd.daemon.placer.SAMPLES", 1)
    caplog.set_level(logging.INFO, "inferd.daemon.placement")
    slow, fast = SleepBackend("slow", 0.001), SleepBackend("fast", 0.0)
    placer, registry, _ = make([slow, fast], None)
    try:
        for i in range(40):
            _, model = place(placer, registry, repo)
            serve(model, 1 + i % 2)
            model.unload()
        assert placer.stop()
    finally:
        placer.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert all(m.unloaded for m in slow.models + fast.models)


@pytest.mark.slow
def test_measuring_waits_while_the_daemon_serves_and_runs_between_requests(
        repo: Path, monkeypatch: Any) -> None:
    """In-process: while a request is in flight (busy() True) nothing is loaded or run
    for measuring; once the daemon serves nothing it proceeds. It looks again when a run
    ends (an event), not on a poll: with the wait's bound at 60 s, runs wake it."""
    import inferd.daemon.placer as placer_module

    monkeypatch.setattr(placer_module, "IDLE_WAIT_S", 60.0)
    serving = threading.Event()
    serving.set()
    polls = threading.Semaphore(0)

    def busy() -> bool:
        polls.release()
        return serving.is_set()

    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, room = make([slow, fast], None, busy)
    placement, model = place(placer, registry, repo)
    x = np.ones((1, 4), np.float32)

    def run_until_it_looks() -> int:
        """Runs, one at a time, until measuring looked at busy() again; how many."""
        for n in range(1, 200):
            model.run({"x": x})
            if polls.acquire(timeout=0.1):
                return n
        raise AssertionError("no run woke measuring")
    try:
        serve(model)
        assert polls.acquire(timeout=60)  # its first look: busy
        runs = 3 + run_until_it_looks() + run_until_it_looks()
        assert not fast.loads and not room.reserved
        assert len(slow.models[0].seen) == runs  # the requests only
        assert placement.to_json()["status"] == "measuring"
        serving.clear()
        run_until_it_looks()  # the run's end: it sees the daemon idle and proceeds
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("fast", "measured")
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_one_rival_at_a_time_and_the_loser_freed_at_once(repo: Path) -> None:
    """Three backends: the serving engine plus at most one rival is ever loaded (each
    load checks), counted one model's cost at a time; a slower rival is unloaded before
    the next one loads."""
    backends: list[SleepBackend] = []

    class Counting(SleepBackend):
        def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
            alive = [m for b in backends for m in b.models if not m.unloaded]
            assert len(alive) <= 1, [m._name for m in alive]  # the serving engine only
            return super().load(model_path, options)

    first, slower, fast = (Counting("first", 0.020), Counting("slower", 0.040),
                           Counting("fast", FAST_S))
    backends += [first, slower, fast]
    placer, registry, room = make(backends, None)
    placement, model = place(placer, registry, repo)
    try:
        serve(model)
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("fast", "measured"), now
        assert " vs first " in now["why"] and "slower " in now["why"]
        assert all(m.unloaded for m in slower.models) and len(slower.models) == 1
        assert room.most == 1000 and room.held == 0
        assert [n for n, _ in room.reserved] == ["measuring the placement of m version 1"] * 2
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_a_rival_that_needs_more_than_half_the_memory_available_waits(
        repo: Path, caplog: Any, monkeypatch: Any) -> None:
    """Without a cache budget too: the machine's available memory bounds a rival."""

    class Machine:
        available = 500 * 2**20  # the rival needs 300 MiB (room.cost)

    # psutil stands in for the machine here: its real available memory (gigabytes, and
    # moving with whatever else runs) cannot be made to sit between 300 and 600 MiB, the
    # range in which a 300 MiB rival needs more than half of it. The placer reads only
    # virtual_memory().available, and that is all the stand-in has.
    monkeypatch.setattr("inferd.daemon.placer.psutil",
                        types.SimpleNamespace(virtual_memory=lambda: Machine))
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, room = make([slow, fast], None)
    room.cost = 300 * 2**20
    caplog.set_level(logging.INFO, "inferd.daemon.placement")
    placement, model = place(placer, registry, repo)
    try:
        serve(model)
        line = postponed(caplog)
        assert line.endswith("(measuring the placement of m version 1 needs 300.0 MiB but "
                             "the machine has 500.0 MiB available (measuring takes at most "
                             "50% of it))"), line
        assert not fast.loads and not room.reserved
        assert placement.to_json()["status"] == "measuring"
    finally:
        placer.stop()
        model.unload()


@pytest.mark.parametrize("where", ["model.toml", "config"])
def test_placement_first_keeps_the_first_that_loads(repo: Path, where: str) -> None:
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    overrides = {"placement.mode": "first"} if where == "config" else {}
    placer, registry, room = make([slow, fast], None, **overrides)
    settings = check_settings("m", {"placement": "first"}) if where == "model.toml" \
        else ModelSettings()
    placement, model = place(placer, registry, repo, settings)
    try:
        serve(model)
        now = placement.to_json()
        assert (now["backend"], now["status"]) == ("slow", "first")
        assert now["why"].endswith('placement = "first"')
        assert placer._thread is None and not fast.loads and not room.reserved
    finally:
        placer.stop()
        model.unload()


def test_one_backend_named_in_model_toml_is_obeyed(repo: Path) -> None:
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], None)
    placement, model = place(placer, registry, repo, check_settings(
        "m", {"backends": ["slow"]}))
    try:
        serve(model)
        assert placement.to_json()["status"] == "first" and not fast.loads
        assert placer._thread is None
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_a_rival_that_fails_to_load_is_not_chosen_and_says_why(repo: Path) -> None:
    slow = SleepBackend("slow", SLOW_S)
    broken = SleepBackend("broken", FAST_S, fail="no kernel for If")
    placer, registry, _ = make([slow, broken], None)
    placement, model = place(placer, registry, repo)
    try:
        assert placement.to_json()["backend"] == "slow"
        serve(model)
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("slow", "measured")
        assert "not chosen: broken (it failed to load: broken cannot load" in now["why"]
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_measuring_waits_while_the_cache_is_short_of_memory(repo: Path,
                                                           caplog: Any) -> None:
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, room = make([slow, fast], None)
    room.refuse = True
    caplog.set_level(logging.INFO, "inferd.daemon.placement")
    placement, model = place(placer, registry, repo)
    try:
        serve(model)
        line = postponed(caplog)
        assert placement.to_json()["status"] == "measuring"
        assert not fast.loads and len(slow.loads) == 1 and not room.reserved
        assert line == ("model m version 1: measuring its placement postponed by 30 s: the "
                        "cache is short of memory (model needs 3 KiB but the budget is 1 KiB)")
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_the_time_limit_stops_measuring(repo: Path) -> None:
    slow = SleepBackend("slow", 0.3)
    fast = SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], None, **{"placement.time_limit_s": 0.01})
    placement, model = place(placer, registry, repo)
    try:
        serve(model)
        now = settled(placement)
        # the reference ran its check and one round; the time was gone before the rival
        assert now["backend"] == "slow"
        assert "not chosen: fast (not measured within the time limit (0.01 s))" in now["why"]
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_within_a_graph_the_slowest_stage_gets_the_idle_cores(repo: Path,
                                                             monkeypatch: Any) -> None:
    (repo / "g").mkdir()
    (repo / "g" / "graph.toml").write_text(
        '[[nodes]]\nname = "a"\nmodel = "m"\n[[nodes]]\nname = "b"\nmodel = "other"\n')
    # The cores this process may use are the machine's (1 to hundreds): two, so that the
    # graph's busy time earns a known number of threads whatever runs the test.
    monkeypatch.setattr("inferd.daemon.placer.PROCESS_CORES", frozenset({0, 1}))
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", 0.012)
    placer, registry, _ = make([slow, fast], None)
    placement, model = place(placer, registry, repo)
    try:
        serve(model)
        now = settled(placement)
        # "other" never ran: m did all of the graph's work, so it earns both cores, and
        # the sleeping backend really is faster on two threads
        assert (now["backend"], now["threads"]) == ("fast", 2), now
        assert now["why"].startswith("fast (2 threads), ")
        assert "threads: 100% of graph g's busy time on 2 cores earns 2" in now["why"]
        assert fast.loads[-1].threads == 2 and fast.loads[-1].intra_op_threads == 2
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_threads_set_in_model_toml_are_not_measured(repo: Path, monkeypatch: Any) -> None:
    (repo / "g").mkdir()
    (repo / "g" / "graph.toml").write_text('[[nodes]]\nname = "a"\nmodel = "m"\n')
    # two cores whatever the machine has (as above): threads = 1 must not be measured
    monkeypatch.setattr("inferd.daemon.placer.PROCESS_CORES", frozenset({0, 1}))
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], None)
    placement, model = place(placer, registry, repo, check_settings("m", {"threads": 1}))
    try:
        serve(model)
        now = settled(placement)
        assert (now["backend"], now["threads"]) == ("fast", 1)
        assert all(o.threads == 1 for o in fast.loads + slow.loads)
        assert "threads:" not in now["why"]
    finally:
        placer.stop()
        model.unload()


@pytest.mark.slow
def test_remeasure_forgets_the_decision_and_measures_again(repo: Path,
                                                           tmp_path: Path) -> None:
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], tmp_path / "state")
    placement, model = place(placer, registry, repo)
    try:
        serve(model)
        settled(placement)
        loads = len(slow.loads)
        assert placer.remeasure(["other"]) == []
        assert placer.remeasure(["m"]) == ["m version 1"]
        assert placement.to_json()["status"] == "measuring"
        assert not json.loads((tmp_path / "state" / "decisions.json").read_text())[
            "decisions"]
        serve(model)
        assert settled(placement)["backend"] == "fast"
        assert len(slow.loads) == loads + 1  # the reference was loaded again
        model.unload()  # its contest closes with it: nothing left to measure again
        assert placer.remeasure(["m"]) == []
    finally:
        placer.stop()
        if not model.closed:
            model.unload()


def test_an_unloaded_model_closes_only_its_own_contest() -> None:
    """The entry holds its load's contest (the placer keeps no map of its own): the
    unload of an earlier load's model leaves the contest of the load after it open."""
    entry = ModelEntry("m", 1, 8)
    earlier = types.SimpleNamespace(model=object())
    later = types.SimpleNamespace(model=object())
    entry.open_contest(earlier)
    entry.open_contest(later)
    assert entry.close_contest(earlier.model) is None and entry.contest is later
    assert entry.close_contest(later.model) is later and entry.contest is None
    assert entry.close_contest(later.model) is None


def test_a_switch_lets_runs_in_the_old_engine_finish_there() -> None:
    log: list[str] = []

    class Blocking(SleepModel):
        def __init__(self) -> None:
            super().__init__(0.0, 1.0, 1, log, "old")
            self.entered, self.release = threading.Event(), threading.Event()

        def run(self, inputs: dict[str, Any], outputs: list[str] | None = None
                ) -> dict[str, Any]:
            self.entered.set()
            assert self.release.wait(30)
            return super().run(inputs, outputs)

    old, new = Blocking(), SleepModel(0.0, 1.0, 1, log, "new")
    placed = PlacedModel(old)
    x = {"x": np.ones((1, 4), np.float32)}
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(placed.run(x)))
    t.start()
    assert old.entered.wait(30)
    assert placed.switch(new)
    assert not old.unloaded  # a run is still inside it
    np.testing.assert_array_equal(placed.run(x)["y"], x["x"])  # served by the new one
    old.release.set()
    t.join(30)
    assert results and old.unloaded and not new.unloaded
    assert log == ["unload old"]
    placed.unload()
    assert log == ["unload old", "unload new"]
    late = SleepModel(0.0, 1.0, 1, log, "late")
    assert not placed.switch(late) and late.unloaded  # after the unload: refused


def test_an_unload_leaves_the_engine_to_a_measuring_run_inside_it() -> None:
    """The placement thread runs the serving engine (the reference) beside the
    workers; an unload meanwhile must not free it under that run."""
    log: list[str] = []
    entered, release = threading.Event(), threading.Event()

    class Blocking(SleepModel):
        def run(self, inputs: dict[str, Any], outputs: list[str] | None = None
                ) -> dict[str, Any]:
            entered.set()
            assert release.wait(30)
            return super().run(inputs, outputs)

    engine = Blocking(0.0, 1.0, 1, log, "serving")
    placed = PlacedModel(engine)
    x = {"x": np.ones((1, 4), np.float32)}
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(placed.run_measuring(x)))
    t.start()
    assert entered.wait(30)
    placed.unload()
    assert placed.closed and not engine.unloaded  # the measuring run is inside it
    release.set()
    t.join(30)
    assert results and results[0] is not None and engine.unloaded
    assert placed.run_measuring(x) is None  # after the unload: nothing runs
    assert log == ["unload serving"]


def test_difference_within_and_beyond_the_tolerance() -> None:
    ref = {"y": np.array([[0.5, 100.0]], np.float32), "n": np.array([3], np.int64)}
    near = {"y": ref["y"] + np.float32(0.05), "n": ref["n"]}
    assert difference(ref, near, 1e-3) is None  # 0.05 <= 1e-3 x 100
    far = {"y": ref["y"] + np.float32(0.5), "n": ref["n"]}
    assert difference(ref, far, 1e-3) == ("its output 'y' differs by 0.5 (tolerance "
                                          "0.001 x 100)")
    assert difference(ref, {"y": ref["y"], "n": ref["n"] + 1}, 1e-3) == \
        "its output 'n' differs in 1 of 1 values"
    assert difference(ref, {"y": ref["y"][:, :1], "n": ref["n"]}, 1e-3) == \
        "its output 'y' is float32 [1, 1], not float32 [1, 2]"
    nan = {"y": np.array([[np.nan, 100.0]], np.float32), "n": ref["n"]}
    assert "NaN or infinite" in (difference(ref, nan, 1e-3) or "")


def test_stage_threads_and_fastest() -> None:
    assert [stage_threads(s, 2) for s in (0.0, 0.25, 0.5, 0.7, 1.0)] == [1, 1, 1, 2, 2]
    assert [stage_threads(s, 4) for s in (0.25, 0.5, 0.7)] == [1, 2, 3]
    assert stage_threads(0.9, 1) == 1
    a, b, c = Trial("a", "a"), Trial("b", "b"), Trial("c", "c", why_not="wrong")
    a.times, b.times, c.times = [[0.010]], [[0.0099]], [[0.001]]
    assert fastest([a, b, c]) is a  # within 2 %: the earlier one stays
    b.times = [[0.005]]
    assert fastest([a, b, c]) is b


def test_a_store_that_cannot_be_read_or_written_measures_again(tmp_path: Path,
                                                               caplog: Any) -> None:
    key = DecisionKey("sha", ("a 1 cpu", "b 1 cpu"), "cpu", 2, "{}")
    (tmp_path / "decisions.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        store = DecisionStore(tmp_path)
    assert "not a decisions file (not JSON" in caplog.text and store.get("m", 1, key) is None
    store.put("m", 1, key, Decision("b", "cpu", None, {"a": 2.0, "b": 1.0}))
    again = DecisionStore(tmp_path)
    assert again.get("m", 1, key) == store.get("m", 1, key)
    assert again.get("m", 1, DecisionKey("sha2", *list(vars(key).values())[1:])) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store = DecisionStore(blocked / "sub")
        store.put("m", 1, key, Decision("b", "cpu"))
        store.put("m", 2, key, Decision("b", "cpu"))
    assert caplog.text.count("cannot be written") == 1
    assert store.get("m", 2, key) == Decision("b", "cpu")  # kept in memory


def test_the_graph_index_reads_graphs_again_when_the_repository_changes(
        tmp_path: Path) -> None:
    """The placer asks at every load which graphs call the model; the answer is kept
    until a folder is added or removed (the repository's mtime) or a reload clears it,
    and a listing made in the repository's last mtime tick is not kept."""
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        (repo / name / "1").mkdir(parents=True)
    (repo / "g").mkdir()
    (repo / "g" / "graph.toml").write_text(
        '[[nodes]]\nname = "x"\nmodel = "a"\n[[nodes]]\nname = "y"\nmodel = "b"\n')
    (repo / "bad").mkdir()
    (repo / "bad" / "graph.toml").write_text("[[nodes]\n")  # unreadable: skipped
    past = time.time() - 10
    os.utime(repo, (past, past))
    index = GraphIndex()
    assert index.of(repo, "a") == [("g", ["a", "b"])]
    assert index.of(repo, "c") == []
    # kept: an edit in place is not seen until a reload clears the index
    (repo / "g" / "graph.toml").write_text('[[nodes]]\nname = "x"\nmodel = "c"\n')
    assert index.of(repo, "c") == []
    index.clear()
    assert index.of(repo, "c") == [("g", ["c"])]
    # a new folder moves the repository's mtime: read again, and (racy) not kept
    (repo / "h").mkdir()
    (repo / "h" / "graph.toml").write_text('[[nodes]]\nname = "x"\nmodel = "a"\n')
    assert index.of(repo, "a") == [("h", ["a"])]
    (repo / "h" / "graph.toml").write_text('[[nodes]]\nname = "x"\nmodel = "b"\n')
    assert index.of(repo, "b") == [("h", ["b"])]
    assert index.of(tmp_path / "missing", "a") == []


# ----------------------------------------------------------------- isolated candidates
# (issue 30 item 6): where the daemon runs engines in worker processes, every candidate
# is loaded apart (``rival=True``: a worker of its own), measured at once on the warm-up
# inputs and beside serving; a preload waits for it (settle), within a bound.


def place_isolated(placer: Placer, registry: Registry, repo: Path,
                   loads: list[tuple[str, bool]]) -> tuple[Any, PlacedModel]:
    """:func:`place` with ``isolated=True``; ``loads`` records (backend, rival) of each
    load."""
    path = repo / "m" / "1" / "model.onnx"
    plan = registry.plan("m", path, None)

    def load(choice: Any, options: LoadOptions, *, rival: bool = False) -> LoadedModel:
        loads.append((choice.backend.id, rival))
        return choice.backend.load(path, options)
    return placer.place(ModelEntry("m", 1, 8), path, plan, ModelSettings(), placer.config,
                        load, repo, isolated=True)


def test_isolated_candidates_are_measured_at_once_on_warmup_inputs_beside_serving(
        repo: Path) -> None:
    """A daemon busy from the start (busy() always True): the candidates are loaded
    apart and measured anyway, on the warm-up inputs only, while the model answers its
    requests on the first candidate; the winner is then loaded as the model's own."""
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, room = make([slow, fast], None, busy=lambda: True)
    loads: list[tuple[str, bool]] = []
    placement, model = place_isolated(placer, registry, repo, loads)
    errors: list[str] = []
    served = [0]
    stop = threading.Event()

    def client() -> None:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        while not stop.is_set():
            try:
                np.testing.assert_array_equal(model.run({"x": x})["y"], x)
                served[0] += 1
            except Exception as e:  # noqa: BLE001  shown by the test
                errors.append(repr(e))
    thread = threading.Thread(target=client)
    thread.start()
    try:
        assert placer.settle(30.0) == []
        stop.set()
        thread.join(30)
        now = placement.to_json()
        assert (now["backend"], now["status"]) == ("fast", "measured"), now
        assert errors == [] and served[0] > 0
        # the serving engine answered the client only; a copy of it and the rival,
        # each loaded apart, ran the warm-up zeros only; the winner was loaded again as
        # the model's own (not apart) and serves now
        assert loads == [("slow", False), ("slow", True), ("fast", True), ("fast", False)]
        assert all(x.shape == (2, 4) for x in slow.models[0].seen)
        measured = [x for m in (slow.models[1], fast.models[0]) for x in m.seen]
        assert measured and all(x.shape == (1, 4) and not x.any() for x in measured)
        assert model.engine is fast.models[1] and not fast.models[1].seen
        assert slow.models[1].unloaded and fast.models[0].unloaded
        assert room.held == 0
    finally:
        stop.set()
        thread.join(30)
        placer.stop()
        model.unload()


def test_settle_waits_for_measuring_within_its_bound(repo: Path) -> None:
    """settle() (the preload before READY) returns once measuring is done, or at its
    bound with the labels still measuring; the model serves on its first candidate
    meanwhile and measuring goes on."""
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], None)
    gate = threading.Event()
    load = fast.load

    def held_load(model_path: Path, options: LoadOptions) -> LoadedModel:
        assert gate.wait(30)
        return load(model_path, options)
    fast.load = held_load  # type: ignore[method-assign]
    placement, model = place_isolated(placer, registry, repo, [])
    try:
        began = time.monotonic()
        assert placer.settle(0.3) == ["m version 1"]
        assert 0.3 <= time.monotonic() - began < 5
        assert placement.to_json()["status"] == "measuring"
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(model.run({"x": x})["y"], x)  # the first serves
        gate.set()
        assert placer.settle(30.0) == []
        assert placement.to_json()["backend"] == "fast"
    finally:
        gate.set()
        placer.stop()
        model.unload()


def test_warmup_inputs_the_model_refuses_fall_back_to_its_first_requests(
        repo: Path, caplog: Any) -> None:
    """A warm-up input the serving backend refuses (warmup/x.npy with a NaN) is never
    given to a rival: measuring logs why and waits for the first requests' inputs."""
    (repo / "m" / "1" / "warmup").mkdir()
    np.save(repo / "m" / "1" / "warmup" / "x.npy", np.array([[1, np.nan, 3, 4]],
                                                             np.float32))
    slow, fast = SleepBackend("slow", SLOW_S), SleepBackend("fast", FAST_S)
    placer, registry, _ = make([slow, fast], None)
    caplog.set_level(logging.INFO, "inferd.daemon.placement")
    placement, model = place_isolated(placer, registry, repo, [])
    try:
        assert placer.settle(30.0) == []
        assert placement.to_json()["status"] == "measuring"
        assert any("its warm-up inputs cannot measure its placement (slow: it failed to "
                   "run: slow#2 refuses NaN); measured on its first requests instead"
                   in r.getMessage() for r in caplog.records), caplog.text
        assert not any(m.seen for m in fast.models)
        serve(model)
        now = settled(placement)
        assert (now["backend"], now["status"]) == ("fast", "measured"), now
        ran = [x for m in fast.models for x in m.seen]
        assert ran and not any(np.isnan(x).any() for x in ran)
    finally:
        placer.stop()
        model.unload()


def test_warm_up_zeros_of_the_newer_types():
    """A model with bfloat16 / int4 inputs is sampled for measured placement on zeros of
    its warm-up shapes: made through the wire's dtypes (ml_dtypes brought in on demand),
    not np.dtype(name), which failed the whole load ('bfloat16' not understood)."""
    from inferd.daemon.warmup import _zeros
    from inferd.libbackends.contract import TensorSpec

    for name in ("bfloat16", "int4", "float8_e4m3fn", "float32"):
        z = _zeros(TensorSpec("x", name, (2, 3)), [2, 3])
        assert z.shape == (2, 3) and z.dtype.name == name and not z.astype(float).any()
