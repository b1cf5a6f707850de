"""Working memory (daemon/memory.py, its admission in daemon/budget.py): shape classes,
measuring a run's peak, the ``[onnxruntime]`` options reaching the backend, and a real
daemon counting a model's working memory in its cache figure."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from inferd.daemon.model_threads import RunAdmission
from inferd.daemon.memory import METER, WorkingMemory, shape_class
from inferd.daemon.model_entry import ModelEntry
from inferd.ipc import RequestError
from inferd.ipc.errors import ModelError
from inferd.libbackends.onnxruntime_cpu import ArenaPolicy, arena_policy


def test_shape_class_rounds_every_dimension_up_to_a_power_of_two():
    a = {"x": np.zeros((1, 3, 736, 2044), np.uint8)}
    assert shape_class(a) == (("x", (1, 4, 1024, 2048)),)
    assert shape_class({"x": np.zeros((0, 5), np.uint8)}) == (("x", (1, 8)),)


def test_a_run_is_measured_once_per_shape_class_and_its_peak_counted():
    working = WorkingMemory("test")
    runs = []

    def run(n: int):
        def go():
            block = np.ones(n, np.uint8)  # touched: resident while the run lasts
            runs.append(int(block[-1]))
            return block.size
        return go
    small = {"x": np.zeros((1, 1000), np.float32)}
    estimate = working.estimate(small)
    assert estimate.measure and estimate.key == shape_class(small)
    size, changed = working.measure(estimate.key, small, run(64 * 2**20))
    assert size == 64 * 2**20 and len(working.classes) == 1
    if METER.resettable:
        assert working.peak >= 48 * 2**20, working.describe()  # freed, but the peak saw it
        assert changed
    assert not working.estimate(small).measure
    assert working.estimate({"x": np.zeros((1, 1000 * 2), np.float32)}).measure
    # a larger run in the same class (1000 and 1020 both round to 1024) is measured again
    assert not working.estimate({"x": np.zeros((1, 1020), np.float32)}).measure
    assert working.estimate({"x": np.zeros((1, 1500), np.float32)}).measure
    assert len(runs) == 1


def test_a_measurement_beside_another_run_is_dropped_and_taken_again():
    working = WorkingMemory("test")
    small = {"x": np.zeros((1, 1000), np.float32)}
    key = shape_class(small)
    started, finish = threading.Event(), threading.Event()

    def other_model_runs():
        working.run(lambda: (started.set(), finish.wait(30)))
    other = threading.Thread(target=other_model_runs)
    other.start()
    assert started.wait(30)
    working.measure(key, small, lambda: np.ones(32 * 2**20, np.uint8)[-1])
    finish.set()
    other.join(30)
    # the peak counted another model's run too: not this model's figure
    assert working.classes[key].measured is None and working.peak == 0
    assert working.estimate(small).measure  # measured again at its next run
    working.measure(key, small, lambda: np.ones(32 * 2**20, np.uint8)[-1])
    assert working.classes[key].measured is not None


def test_a_run_in_another_process_does_not_spoil_a_measurement():
    """Runs in progress are counted by the process they run in: a run of a model whose
    engine is in another process (here a real child, standing for a worker) leaves this
    process's measurement its own; one in the same process does not, and the process a
    run was counted in is the one its end is taken from, wherever its engine went."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        class Engine:  # a worker's model as the meter sees it: a pid, and a trim
            pid = child.pid

            def trim(self) -> None:
                pass
        engine: list[object | None] = [Engine()]
        elsewhere = WorkingMemory("other", METER.for_engine(lambda: engine[0]))
        here = WorkingMemory("test")
        small = {"x": np.zeros((1, 1000), np.float32)}
        key = shape_class(small)
        counted = elsewhere.begin()  # sent to the other process, not answered yet
        assert counted == child.pid
        engine[0] = None  # the other model moved into this process meanwhile
        here.measure(key, small, lambda: np.ones(32 * 2**20, np.uint8)[-1])
        assert here.classes[key].measured is not None  # measured alone
        with elsewhere._meter.running():  # a run of the other model here now
            here.measure(shape_class({"x": np.zeros((1, 3000), np.float32)}),
                         {"x": np.zeros((1, 3000), np.float32)},
                         lambda: np.ones(32 * 2**20, np.uint8)[-1])
        assert len([c for c in here.classes.values() if c.measured is not None]) == 1
        elsewhere.end(counted)  # its end is the child's, where it was counted
        assert METER._runs.at == {}
    finally:
        child.kill()
        child.wait()


def test_a_class_measured_only_beside_other_runs_is_tried_again_now_and_then(tmp_path):
    """A model with a graph drops every measurement taken beside another run; after TRIES
    such, its class is still measured once every RETRY_AFTER runs, so that it settles
    once the daemon is quieter. Before, it was never measured again: a model whose first
    runs overlapped others (models loaded together, their placement rivals measured
    meanwhile) never settled, its every run estimated anew and none sent from the I/O
    thread (bench_spine's 16 B infer took the model's threads for good)."""
    from inferd.daemon.activations import Activations
    from inferd.daemon.memory import RETRY_AFTER, TRIES
    from tests.daemon.test_workers import unary_model

    working = WorkingMemory("test")
    working.use(Activations(unary_model(tmp_path, "neg", "Neg")), "onnxruntime")
    x = {"x": np.zeros((1, 1000), np.float32)}
    started, finish = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: working.run(
        lambda: (started.set(), finish.wait(30))))
    other.start()
    assert started.wait(30)
    try:
        for _ in range(TRIES):  # each one beside the other run: dropped
            estimate = working.estimate(x)
            assert estimate.measure
            working.measure(estimate.key, x, lambda: None)
        assert working.classes[estimate.key].measured is None
        assert [working.estimate(x).measure for _ in range(RETRY_AFTER)] == \
            [False] * (RETRY_AFTER - 1) + [True]
    finally:
        finish.set()
        other.join(30)
    assert not working.settled(x)
    working.measure(estimate.key, x, lambda: None)  # the try, alone now
    assert working.classes[estimate.key].measured is not None
    assert working.settled(x) and not working.estimate(x).measure


def test_arena_policy_defaults_and_values():
    assert arena_policy({}, "m") == ArenaPolicy()
    p = arena_policy({"memory_arena": True, "arena_extend_strategy": "same_as_requested",
                      "arena_max_memory": "64MiB", "arena_shrinkage": True}, "m")
    assert p.shared and p.arena_max_memory == 64 * 2**20 and p.arena_shrinkage
    assert not arena_policy({"memory_arena": False,
                             "arena_extend_strategy": "same_as_requested"}, "m").shared


@pytest.mark.parametrize("options, key", [
    ({"memory_arena": "yes"}, "memory_arena"),
    ({"arena_extend_strategy": "double"}, "arena_extend_strategy"),
    ({"arena_max_memory": "lots"}, "arena_max_memory"),
    ({"arena_shrink": True}, "arena_shrink"),
])
def test_arena_policy_names_the_bad_key(options, key):
    with pytest.raises(ModelError, match=key):
        arena_policy(options, "model m")


@pytest.fixture
def repo(models_dir, short_tmp):
    root = short_tmp / "models"
    for name in ("ocr-det", "ocr-cls"):
        (root / name).mkdir(parents=True)
        (root / name / "1").mkdir()  # hard links: the daemon refuses links out of the repo
        os.link(models_dir / name / "1" / "model.onnx", root / name / "1" / "model.onnx")
    return root


@pytest.mark.slow
def test_daemon_counts_working_memory_and_refuses_bad_options(repo, start_daemon):
    # onnxruntime only: no other backend to fall back on
    (repo / "ocr-cls" / "model.toml").write_text(
        "backends = ['onnxruntime']\n[onnxruntime]\nmemory_arena = 'yes'\n")
    d = start_daemon("--models", str(repo))
    with d.client(timeout=120) as c:
        c.infer("ocr-det", {"x": np.zeros((1, 3, 64, 64), np.float32)})
        before = {m["name"]: m for m in c.models()}["ocr-det"]
        c.infer("ocr-det", {"x": np.zeros((1, 3, 640, 640), np.float32)})
        after = {m["name"]: m for m in c.models()}["ocr-det"]
        status = c.status()
        with pytest.raises(RequestError) as e:
            c.infer("ocr-cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})
    assert "[onnxruntime] memory_arena = 'yes'" in e.value.message
    assert len(after["working_memory"]) == 2
    # a 100x larger input needs more working memory, and the cache figure grows with it
    assert after["memory_working_bytes"] > before["memory_working_bytes"]
    assert after["memory_bytes"] - before["memory_bytes"] == \
        after["memory_working_bytes"] - before["memory_working_bytes"]
    engines = sum(status["cache"]["engines_bytes"].values())  # onnx and onnxruntime
    assert status["cache"]["used_bytes"] == after["memory_bytes"] + engines


class _Admissions:
    """Stands for the cache's admission step (ModelManager.admit, tested with real
    daemons below): notes the estimate of each run it is asked to admit."""

    def __init__(self, working) -> None:
        self.working = working
        self.calls: list[tuple[int, bool, bool]] = []

    def admit(self, inputs):
        estimate = self.working.estimate(inputs)
        self.calls.append((estimate.bytes, estimate.measure, estimate.reliable))
        return estimate


class _Echo:
    inputs = outputs = ()

    def run(self, inputs, outputs=None):
        return dict(inputs)


def test_without_a_graph_the_largest_class_is_scaled_and_each_run_admitted():
    entry = ModelEntry("test", 1, 1)
    working = entry.memory.working
    budget = _Admissions(working)
    admission = RunAdmission(budget.admit, working, lambda: None)

    class model:  # a run as the model's threads make it: admitted, then the engine
        @staticmethod
        def run(inputs):
            return admission.run(inputs, lambda: _Echo().run(inputs))
    tiny = {"x": np.zeros((1, 10), np.float32)}
    model.run(tiny)  # measured: a few KiB of noise, its own class
    assert budget.calls == [(0, True, False)]  # nothing known yet: no estimate
    small = {"x": np.zeros((1, 1000), np.float32)}
    working.record(shape_class(small), 1000, 4000)  # 4 bytes per element
    big = {"x": np.zeros((1, 3000), np.float32)}
    huge = {"x": np.zeros((1, 5000), np.float32)}
    assert working.estimate(small).bytes == 4000 and working.estimate(small).reliable
    assert (working.estimate(big).bytes, working.estimate(big).reliable) == (12000, True)
    assert (working.estimate(huge).bytes, working.estimate(huge).reliable) == (20000, False)
    budget.calls.clear()
    model.run(huge)
    assert budget.calls == [(20000, True, False)]
    budget.calls.clear()
    model.run(small)  # known: checked against the budget, not measured
    assert budget.calls == [(4000, False, True)]


@pytest.mark.slow
def test_a_class_that_cannot_fit_the_budget_is_refused_before_it_runs(models_dir,
                                                                        start_daemon,
                                                                        short_tmp):
    root = short_tmp / "models"
    (root / "ocr-det" / "1").mkdir(parents=True)
    os.link(models_dir / "ocr-det" / "1" / "model.onnx", root / "ocr-det" / "1" / "model.onnx")
    config = short_tmp / "budget.toml"
    # room for the detector, its engine (imported by its load: counted in it) and a small
    # input, not for a 960x960 one
    config.write_text('[cache]\nmax_memory = "96MiB"\n[metrics]\ntextfile = ""\n')
    d = start_daemon("--models", str(root), env={"INFERD_CONFIG": str(config)})
    big = {"x": np.zeros((1, 3, 960, 960), np.float32)}
    with d.client(timeout=120) as c:
        c.infer("ocr-det", {"x": np.zeros((1, 3, 64, 64), np.float32)})
        with pytest.raises(RequestError) as e:
            c.infer("ocr-det", big)  # its graph says it cannot fit: never run
        det = {m["name"]: m for m in c.models()}["ocr-det"]
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert "inputs of this size need" in e.value.message
    assert "of working memory (estimated from its graph: 84.4 MiB of activations" \
        in e.value.message and "over the cache budget of 96.0 MiB" in e.value.message
    assert [r["shapes"]["x"] for r in det["working_memory"]] == [[1, 4, 64, 64]]
    assert det["memory_bytes"] <= 96 * 2**20


def test_a_measured_class_settles_and_any_new_figure_unsettles_it():
    """A run of a measured class costs one look-up once admitted at its figure; a new
    measurement (or a new engine) is seen at the next estimate."""
    working = WorkingMemory("test")
    small = {"x": np.zeros((1, 1000), np.float32)}
    key = shape_class(small)
    working.record(key, 1000, 4000)
    first = working.estimate(small)
    assert (first.bytes, first.measure, first.settled) == (4000, False, False)
    assert working.describe()[0]["admitted_bytes"] is None
    working.admit(first)
    assert working.describe()[0]["admitted_bytes"] == 4000
    settled = working.estimate(small)
    assert settled.settled and settled.bytes == 4000
    assert working.estimate(small) is settled  # one look-up
    assert not working.admit(settled) and working.peak == 4000
    assert working.describe()[0]["admitted_bytes"] == 4000
    working.record(key, 1000, 9000)  # measured again, larger: the look-up is gone
    again = working.estimate(small)
    assert (again.bytes, again.settled) == (9000, False)
    working.admit(again)
    resettled = working.estimate(small)
    assert resettled.settled and resettled.bytes == 9000
    working.use(None, "openvino")  # another engine: looked up anew (still measured)
    assert working.estimate(small) is not resettled


def two_relus(tmp_path):
    """The activations of a two-Relu ONNX graph on x [n, 1024] (skips without onnx)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from inferd.daemon.activations import Activations

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1024])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["a"]),
                               helper.make_node("Relu", ["a"], ["y"])], "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
              str(path))
    return Activations(path)


def test_a_model_gets_its_own_factor_from_its_runs_measured_alone(tmp_path):
    """The backend's factor until a run of the model is measured; then the largest ratio
    of measured working memory to activations among its runs (the load's first run only
    from FIRST_RUN_FROM: it pays the engine's set-up). The figures are given, not
    measured: what is tested is the arithmetic on them; a real graph sizes the runs."""
    from inferd.daemon.memory import FACTORS, FIRST_RUN_FROM

    activations = two_relus(tmp_path)
    working = WorkingMemory("test")
    working.use(activations, "onnxruntime")

    def rows(n):
        inputs = {"x": np.zeros((n, 1024), np.float32)}
        return inputs, activations.peak({"x": (n, 1024)}).bytes

    def run(n, ratio, alone=True):
        inputs, live = rows(n)
        estimate = working.estimate(inputs)
        working.admit(estimate)
        working.record(estimate.key, n * 1024, int(live * ratio), alone)
        return estimate, live

    first, live = run(256, 5.0)  # the load's first: set-up swamps it, no factor from it
    assert live < FIRST_RUN_FROM
    assert first.bytes == int(live * FACTORS["onnxruntime"]) and "onnxruntime's" in first.how
    second, live = run(1024, 3.0)  # calibrates: 3.0
    assert second.bytes == int(live * FACTORS["onnxruntime"])
    third, live = run(2048, 2.0)  # on 3.0; its 2.0 lowers nothing
    assert third.bytes == int(live * 3.0) and "measured on its runs" in third.how
    beside, live = run(4096, 6.0, alone=False)  # beside another run: dropped
    assert beside.bytes == int(live * 3.0)
    inputs, live = rows(8192)
    assert working.estimate(inputs).bytes == int(live * 3.0)
    working.use(activations, "onnxruntime")  # loaded again on the same engine: kept
    assert working.estimate(inputs).bytes == int(live * 3.0)
    working.use(activations, "openvino")  # another engine: its prior again
    assert working.estimate(inputs).bytes == int(live * FACTORS["openvino"])
    low, live = run(8192 * 2, 0.5)  # a first run large enough, whose memory was reused
    assert live >= FIRST_RUN_FROM
    inputs, live = rows(8192 * 4)
    assert working.estimate(inputs).bytes == int(live * 1.0)  # at least its activations


def test_settled_is_a_measured_class_not_outgrown():
    """The I/O thread runs a request only when its admission reads no graph and makes
    no room (WorkingMemory.settled): a class measured, at most GROWTH times larger."""
    working = ModelEntry("test", 1, 1).memory.working
    small = {"x": np.zeros((1, 1000), np.float32)}
    assert not working.settled(small)  # never measured: its first run is estimated
    working.record(shape_class(small), 1000, 4000)
    assert working.settled(small)
    assert working.settled({"x": np.zeros((1, 1010), np.float32)})  # same class
    assert not working.settled({"x": np.zeros((1, 5000), np.float32)})  # another class


def test_a_class_sized_ahead_reads_no_graph_at_its_first_run(tmp_path):
    """WorkingMemory.size (a stream model's batches, sized at its load): the graph is
    read then, not at the class's first run, whose estimate is what it would have been
    (scaled from the size ahead); nothing is counted or shown before that run, and a
    new load sizes anew."""
    from inferd.daemon.memory import FACTORS

    activations = two_relus(tmp_path)
    reads = []

    class Counted:
        def peak(self, shapes, values=None):
            reads.append(dict(shapes))
            return activations.peak(shapes, values)

    working = WorkingMemory("test")
    working.use(Counted(), "onnxruntime")
    four = {"x": np.zeros((4, 1024), np.float32)}
    working.size(four)
    working.size(four)  # sized already
    assert reads == [{"x": (4, 1024)}]
    assert working.classes == {} and working.peak == 0 and working.describe() == []
    estimate = working.estimate({"x": np.zeros((3, 1024), np.float32)})  # its class
    assert len(reads) == 1 and estimate.measure and estimate.reliable
    live = activations.peak({"x": (4, 1024)}).bytes
    assert estimate.bytes == int(int(live * 3 / 4) * FACTORS["onnxruntime"])
    working.size(four)  # the class has its activations now: nothing to read
    assert len(reads) == 1
    eight = {"x": np.zeros((8, 1024), np.float32)}
    working.size(eight)
    working.use(Counted(), "onnxruntime")  # loaded again: what was sized ahead goes
    working.estimate(eight)
    assert reads[1:] == [{"x": (8, 1024)}, {"x": (8, 1024)}]


@pytest.mark.parametrize("shapes", ['warmup_shapes = { x = [1, 3, 48, 192] }\n', ""])
def test_a_batched_models_batches_are_sized_at_its_load(tmp_path, models_dir, monkeypatch,
                                                        shapes):
    """ModelThreads.warm_up: the working memory of each batch size a batched model may
    run is sized at its load (its graph read, nothing run) when its batches' shapes are
    known (here from model.toml's warmup_shapes: ocr-cls's height and width are free),
    so that no first request of a size waits on the graph being read (30-60 ms a size);
    without known shapes it is left to the first runs."""
    from inferd.daemon.activations import Activations
    from inferd.daemon.config import load_config
    from inferd.daemon.models import ModelManager
    from inferd.daemon.repository import Repository
    from inferd.ipc.replies import ReplySink
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
    from inferd.libbackends.registry import Registry
    from tests.links import link_file

    link_file(models_dir / "ocr-cls" / "1" / "model.onnx", tmp_path / "cls" / "1" / "model.onnx")
    (tmp_path / "cls" / "model.toml").write_text(
        f'max_batch = 4\nbatching = "fixed"\n{shapes}')
    config = load_config(None, {"models.repository": str(tmp_path),
                                "workers.isolation": "in-process",
                                "placement.mode": "first"})
    registry = Registry()
    registry.register(OnnxRuntimeCpuBackend())
    reads: list[tuple[int, ...]] = []
    peak = Activations.peak

    def counted(self, shapes, values=None):
        reads.append(tuple(shapes["x"]))
        return peak(self, shapes, values)
    monkeypatch.setattr(Activations, "peak", counted)
    manager = ModelManager(Repository(tmp_path), registry, lambda: config, ReplySink())
    try:
        manager.load("cls")
        if shapes:
            assert sorted(reads) == [(n, 3, 48, 192) for n in (1, 2, 4)]
        else:
            assert reads == []
    finally:
        manager.stop(10.0)
