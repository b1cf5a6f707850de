"""The per-model pipeline (daemon/model_threads.py, daemon/pipeline.py) in-process, on real ONNX
models run by the built-in onnxruntime backend: stage threads and their overlap,
per-thread CPU affinity read back from /proc, dynamic batching (merge, split, mixed
shapes, failures reaching only their own request), and model.toml checks."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from inferd.daemon.fairqueue import FairQueue
from inferd.daemon.model_settings import check_settings, read_settings
from inferd.daemon.pipeline import parse_spec
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.model_threads import ModelThreads, Queued
from inferd.ipc.errors import ErrorCode, ModelError
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import LocalTicket, ReplySink
from inferd.libbackends.contract import LoadedModel, LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from onnx import TensorProto, helper


class Collector:
    """Replies by request id, with a way to wait for n of them."""

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {}
        self.cond = threading.Condition()

    def ticket(self, request: Request, **kw: Any) -> LocalTicket:
        rid = request.id

        def deliver(reply: Reply) -> None:
            with self.cond:
                assert rid not in self.replies, f"second reply for {rid}"
                self.replies[rid] = reply
                self.cond.notify_all()
        return LocalTicket(request, deliver, **kw)

    def wait(self, n: int, timeout: float = 60.0) -> dict[str, Reply]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.replies) >= n, timeout), \
                f"only {len(self.replies)} of {n} replies"
            return dict(self.replies)


def load(path: Path) -> Any:
    return OnnxRuntimeCpuBackend().load(path, LoadOptions(1, 1))


def start(name: str, model: Any, settings: dict[str, Any], items: list[tuple[str, dict]],
          collector: Collector, instances: int = 1,
          registry: ProcessorRegistry | None = None) -> ModelThreads:
    """Queue ``items`` first, then start the workers (so batching sees them together)."""
    work = FairQueue()
    for rid, inputs in items:
        work.put(Queued(collector.ticket(Request(rid, Op.INFER, model=name,
                                                 inputs=inputs))))
    spec = parse_spec(name, check_settings(name, settings), registry or ProcessorRegistry())
    workers = ModelThreads(name, model, work, ReplySink(), instances, spec=spec,
                           backend="onnxruntime")
    workers.start()
    return workers


def cls_input(seed: int, width: int = 192, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 3, 48, width)).astype(np.float32)


@pytest.fixture(scope="module")
def cls_model(models_dir: Path) -> Any:
    return load(models_dir / "ocr-cls" / "1" / "model.onnx")


# --------------------------------------------------------------------------- stages


def test_three_stages_run_in_their_own_named_threads_and_overlap(cls_model: Any,
                                                                  tmp_path: Path) -> None:
    # A user processor records when each request is in pre and in post; with 40 ms in
    # each, a stream can only show pre(N+1) overlapping post(N) if the stages really run
    # concurrently (a sequential worker never has two stages busy at once).
    (tmp_path / "probe.py").write_text(
        "import threading, time\n"
        "EVENTS = []\n"
        "def make(stage, ms):\n"
        "    def step(values):\n"
        "        t0 = time.monotonic(); time.sleep(ms / 1000)\n"
        "        EVENTS.append((stage, t0, time.monotonic(), threading.current_thread().name))\n"
        "        return values\n"
        "    return step\n"
        "PROCESSORS = {'probe': make}\n")
    registry = ProcessorRegistry()
    assert registry.load_directory(tmp_path) == ["probe"]
    collector = Collector()
    items = [(f"r{i}", {"x": cls_input(i)}) for i in range(6)]
    settings = {"pre": [{"op": "probe", "stage": "pre", "ms": 40}],
                "post": [{"op": "probe", "stage": "post", "ms": 40},
                         {"op": "softmax", "input": "save_infer_model/scale_0.tmp_1",
                          "output": "prob"}]}
    workers = start("cls3", cls_model, settings, items, collector, registry=registry)
    try:
        replies = collector.wait(6)
    finally:
        assert workers.stop(30)
    assert [t.name for t in workers.threads] == [
        "inferd-cls3-pre", "inferd-cls3-infer-0", "inferd-cls3-post"]
    assert all(r.ok for r in replies.values()), replies
    assert replies["r0"].outputs["prob"].shape == (1, 2)
    import sys
    events = sys.modules["inferd_user_processors.probe"].EVENTS
    assert {e[3] for e in events if e[0] == "pre"} == {"inferd-cls3-pre"}
    assert {e[3] for e in events if e[0] == "post"} == {"inferd-cls3-post"}
    pres = [e for e in events if e[0] == "pre"]
    posts = [e for e in events if e[0] == "post"]
    overlaps = sum(1 for p in pres for q in posts if p[1] < q[2] and q[1] < p[2])
    assert overlaps >= 1, f"pre and post never ran at the same time: {events}"
    assert not any(t.is_alive() for t in workers.threads)


def test_cpu_affinity_is_applied_per_thread_and_read_back_from_proc(cls_model: Any) -> None:
    cores = sorted(os.sched_getaffinity(0))
    want = [cores[-1]]
    collector = Collector()
    settings = {"cpu_affinity": want, "pre": [{"op": "rename", "mapping": {}}],
                "post": [{"op": "rename", "mapping": {}}]}
    workers = start("pinned", cls_model, settings, [("a", {"x": cls_input(0)})], collector,
                    instances=2)
    try:
        assert collector.wait(1)["a"].ok
        placement = workers.pinning()
        assert [p["thread"] for p in placement] == [
            "inferd-pinned-pre", "inferd-pinned-infer-0", "inferd-pinned-infer-1",
            "inferd-pinned-post"]
        for p in placement:
            status = Path(f"/proc/{os.getpid()}/task/{p['native_id']}/status").read_text()
            allowed = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                           if line.startswith("Cpus_allowed_list"))
            assert allowed == str(want[0]), (p, allowed)
            assert p["affinity"] == want
            assert p["backend"] == ("onnxruntime" if p["stage"] == "infer" else None)
        # the rest of the process is not pinned
        assert sorted(os.sched_getaffinity(0)) == cores
    finally:
        assert workers.stop(30)


# --------------------------------------------------------------------------- batching


def test_batching_merges_requests_and_splits_each_reply_back(cls_model: Any) -> None:
    inputs = {f"r{i}": cls_input(i, rows=1 + i % 2) for i in range(6)}
    expected = {rid: cls_model.run({"x": x})["save_infer_model/scale_0.tmp_1"]
                for rid, x in inputs.items()}
    collector = Collector()
    workers = start("b", cls_model,
                    {"max_batch": 16, "max_delay_ms": 200, "batching": "fixed"},
                    [(rid, {"x": x}) for rid, x in inputs.items()], collector)
    try:
        replies = collector.wait(6)
    finally:
        assert workers.stop(30)
    assert workers.batches >= 1 and workers.batched_requests >= 2
    for rid, reply in replies.items():
        assert reply.ok, reply.error
        got = reply.outputs["save_infer_model/scale_0.tmp_1"]
        assert got.shape == expected[rid].shape
        np.testing.assert_allclose(got, expected[rid], atol=1e-5)


def test_mixed_shapes_are_not_merged_and_bad_requests_are_refused_alone(
        cls_model: Any) -> None:
    items = [("w192a", {"x": cls_input(1)}), ("w160", {"x": cls_input(2, width=160)}),
             ("rank3", {"x": cls_input(3)[0]}), ("int", {"x": np.zeros((1, 3, 48, 192),
                                                                       np.int64)}),
             ("w192b", {"x": cls_input(4)})]
    collector = Collector()
    workers = start("mixed", cls_model,
                    {"max_batch": 8, "max_delay_ms": 200, "batching": "fixed"}, items,
                    collector)
    try:
        replies = collector.wait(5)
    finally:
        assert workers.stop(30)
    for rid in ("w192a", "w160", "w192b"):
        assert replies[rid].ok, replies[rid].error
        assert replies[rid].outputs["save_infer_model/scale_0.tmp_1"].shape == (1, 2)
        np.testing.assert_allclose(
            replies[rid].outputs["save_infer_model/scale_0.tmp_1"],
            cls_model.run(dict(items[[i[0] for i in items].index(rid)][1]))[
                "save_infer_model/scale_0.tmp_1"], atol=1e-5)
    assert replies["rank3"].error.code is ErrorCode.INVALID_ARGUMENT
    assert "rank" in replies["rank3"].error.message
    assert replies["int"].error.code is ErrorCode.INVALID_ARGUMENT
    assert workers.batched_requests == 2  # the two 192-wide ones, not the 160-wide one


class Gated(LoadedModel):
    """ocr-cls on onnxruntime behind a gate: a run waits until the test opens it, and
    each run's rows are recorded by the value they carry (the test fills each client's
    inputs with its own number). A wrapper, not a stand-in: the real model runs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.inputs, self.outputs = inner.inputs, inner.outputs
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.runs: list[list[int]] = []

    def run(self, inputs: dict[str, Any], outputs: list[str] | None = None) -> Any:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.runs.append([int(v) for v in inputs["x"][:, 0, 0, 0]])
        return self.inner.run(inputs, outputs)

    def unload(self) -> None:
        pass


def _fair_run(model: Any, settings: dict[str, Any]) -> tuple[Gated, ModelThreads]:
    """A greedy client (0) with 500 requests and a polite one (1) with one, queued while
    the greedy client's first request is running."""
    gated = Gated(model)
    work = FairQueue()
    collector = Collector()
    spec = parse_spec("cls", check_settings("cls", settings), ProcessorRegistry())
    workers = ModelThreads("cls", gated, work, ReplySink(), spec=spec)
    workers.start()

    def put(peer: int, n: int) -> None:
        work.put(Queued(collector.ticket(Request(
            f"{peer}-{n}", Op.INFER, model="cls",
            inputs={"x": np.full((1, 3, 48, 192), peer, np.float32)}), peer=bytes([peer]))))
    put(0, 0)
    assert gated.entered.wait(60)
    for n in range(1, 500):
        put(0, n)
    put(1, 0)
    gated.gate.set()
    collector.wait(501)
    assert workers.stop(30)
    return gated, workers


def test_a_polite_request_rides_in_the_next_batch_beside_a_share_of_a_greedy_clients(
        cls_model: Any) -> None:
    """Issue 20 item 1, on turns: fixed batches of 32 (the shipped ocr-cls max_batch);
    the polite request runs in the batch after the one in progress, beside at most half
    of it of the greedy client's rows (two clients waiting), not 31."""
    gated, _ = _fair_run(cls_model, {"max_batch": 32, "batching": "fixed"})
    assert gated.runs[0] == [0]  # in progress when the others were queued
    second = gated.runs[1]
    assert second.count(1) == 1 and second.count(0) <= 16, gated.runs[:3]
    assert max(len(r) for r in gated.runs) == 32  # alone again, the greedy one batches


def test_with_the_shipped_ocr_cls_settings_a_polite_request_waits_one_batch(
        cls_model: Any, models_dir: Path) -> None:
    """The same with the demo ocr-cls model.toml as shipped (max_batch 32, adaptive):
    before the polite request runs, at most the batch in progress and one batch of the
    greedy client's (each at most the adaptive limit) run."""
    shipped = read_settings("ocr-cls", models_dir / "ocr-cls")
    gated, workers = _fair_run(cls_model, {"max_batch": shipped.max_batch,
                                           "max_delay_ms": shipped.max_delay_ms})
    polite = next(i for i, r in enumerate(gated.runs) if 1 in r)
    limit = workers.batching()["max_batch"]
    assert polite <= 2, gated.runs[:4]
    greedy_before = sum(len(r) for r in gated.runs[1:polite]) + gated.runs[polite].count(0)
    assert greedy_before <= limit // 2 + 1, gated.runs[:4]


def gather_model(path: Path) -> Path:
    """data [N,4] float, idx [N,1] int64 -> GatherElements along axis 1: an index out of
    range fails in onnxruntime at run time, after every check has passed."""
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["data", "idx"], ["out"], axis=1)], "g",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_failing_batch_fails_only_the_request_that_broke_it(tmp_path: Path) -> None:
    model = load(gather_model(tmp_path / "g.onnx"))
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    items = [(f"r{i}", {"data": data[i:i + 1], "idx": np.array([[i]], np.int64)})
             for i in range(3)]
    items.insert(1, ("bad", {"data": data[:1], "idx": np.array([[7]], np.int64)}))
    collector = Collector()
    workers = start("g", model, {"max_batch": 8, "max_delay_ms": 200, "batching": "fixed"},
                    items, collector)
    try:
        replies = collector.wait(4)
    finally:
        assert workers.stop(30)
    assert not replies["bad"].ok
    for i in range(3):
        assert replies[f"r{i}"].ok, replies[f"r{i}"].error
        assert replies[f"r{i}"].outputs["out"].tolist() == [[data[i, i]]]


def test_fixed_batch_dimension_turns_batching_off(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "r",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "r.onnx")
    model = load(tmp_path / "r.onnx")
    collector = Collector()
    items = [(f"r{i}", {"x": np.full((1, 4), i - 1, np.float32)}) for i in range(3)]
    workers = start("fixed", model, {"max_batch": 4}, items, collector)
    try:
        replies = collector.wait(3)
    finally:
        assert workers.stop(30)
    assert workers.max_batch == 1 and workers.batches == 0
    assert [replies[f"r{i}"].outputs["y"][0, 0] for i in range(3)] == [0, 0, 1]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("settings, words", [
    ({"cpu_affinity": []}, "cpu_affinity"),
    ({"cpu_affinity": [9999]}, "not usable by this process"),
    ({"max_batch": 0}, "max_batch"),
    ({"max_delay_ms": -1}, "max_delay_ms"),
    ({"pre": [{"op": "no.such.step"}]}, "unknown processor 'no.such.step'; available:"),
    ({"post": [{"op": "topk", "k": 0}]}, "refused its parameters"),
    ({"pre": "softmax"}, "list of step tables"),
])
def test_bad_model_toml_pipeline_settings_name_the_key(settings: dict[str, Any],
                                                       words: str) -> None:
    with pytest.raises(ModelError) as e:
        parse_spec("m", check_settings("m", settings), ProcessorRegistry())
    assert "model m" in e.value.message and words in e.value.message


def test_deadline_passed_in_queue_is_answered_not_run(cls_model: Any) -> None:
    collector = Collector()
    work = FairQueue()
    # received a second ago with a timeout of 1 ms: its deadline has passed
    work.put(Queued(collector.ticket(Request("late", Op.INFER, model="m",
                                             inputs={"x": cls_input(0)}, timeout_ms=1),
                                     received=time.monotonic() - 1)))
    workers = ModelThreads("m", cls_model, work, ReplySink())
    workers.start()
    try:
        assert collector.wait(1)["late"].error.code is ErrorCode.DEADLINE_EXCEEDED
    finally:
        assert workers.stop(30)


# --------------------------------------------------------------------------- stuck stages


def _queue(work: FairQueue, collector: Collector, *rids: str) -> None:
    for rid in rids:
        work.put(Queued(collector.ticket(Request(rid, Op.INFER, model="m",
                                                 inputs={"x": cls_input(0)}))))


def _until(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_stuck_model_run_is_named_given_up_and_its_queue_served_by_new_workers(
        cls_model: Any) -> None:
    """Issue 20 item 4: a model run that does not return (a driver that hangs: the
    gated model). stop() gives up once the run is past stuck_after instead of waiting;
    abandon() answers the request inside the run UNAVAILABLE and leaves the queued ones
    for a new load's workers; when the run returns, its reply is dropped and the old
    thread ends. Each request is answered and counted once."""
    gated = Gated(cls_model)
    work, collector, done = FairQueue(), Collector(), []
    old = ModelThreads("m", gated, work, ReplySink(), on_done=done.append)
    old.start()
    _queue(work, collector, "r1")
    assert gated.entered.wait(30)
    _queue(work, collector, "r2", "r3")
    _until(lambda: old.stuck(0.1))
    assert old.stuck(0.1)[0].startswith("inferd-m-infer-0 (infer: running request r1 for ")
    assert old.all_stuck(0.1)
    t0 = time.monotonic()
    assert not old.stop(timeout=None, stuck_after=0.1)
    assert time.monotonic() - t0 < 5
    old.abandon()
    r1 = collector.wait(1)["r1"]
    assert r1.error.code is ErrorCode.UNAVAILABLE and "inferd-m-infer-0" in r1.error.message
    assert work.qsize() == 2  # the STOP withdrawn, the requests kept
    new = ModelThreads("m", cls_model, work, ReplySink(), on_done=done.append)
    new.start()
    replies = collector.wait(3)
    assert replies["r2"].ok and replies["r3"].ok
    gated.gate.set()
    for t in old.threads:
        t.join(30)
        assert not t.is_alive()
    assert new.stop(30)
    assert len(collector.replies) == 3 and sorted(done) == [False, True, True]


def test_a_stuck_post_step_gives_up_what_waits_between_the_stages(cls_model: Any,
                                                                  tmp_path: Path) -> None:
    """The same with a post step that does not return and stage queues of one: the
    request in the step, the one queued before it and the one the inference thread was
    handing on are answered UNAVAILABLE; the one still in the model queue stays."""
    (tmp_path / "gate.py").write_text(
        "import threading\nGATE = threading.Event()\n"
        "def make():\n    def step(values):\n        GATE.wait()\n        return values\n"
        "    return step\nPROCESSORS = {'gate': make}\n")
    registry = ProcessorRegistry()
    assert registry.load_directory(tmp_path) == ["gate"]
    import sys
    gate = sys.modules["inferd_user_processors.gate"].GATE
    work, collector, done = FairQueue(), Collector(), []
    spec = parse_spec("m", check_settings("m", {"post": [{"op": "gate"}],
                                                "stage_queue_size": 1}), registry)
    workers = ModelThreads("m", cls_model, work, ReplySink(), spec=spec, on_done=done.append)
    workers.start()
    try:
        _queue(work, collector, "r1", "r2", "r3", "r4")
        _until(lambda: workers.stuck(0.1) and work.qsize() == 1)  # r3 waits for room
        assert "post: post-processing request r1" in workers.stuck()[0]
        assert not workers.stop(stuck_after=0.1)
        workers.abandon()
        replies = collector.wait(3)
        assert all(replies[r].error.code is ErrorCode.UNAVAILABLE for r in ("r1", "r2", "r3"))
        assert work.qsize() == 1 and "r4" not in replies
    finally:
        gate.set()
    for t in workers.threads:
        t.join(30)
        assert not t.is_alive(), t.name
    assert len(collector.replies) == 3 and done == [False, False, False]
