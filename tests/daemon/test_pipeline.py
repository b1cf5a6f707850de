"""The per-model pipeline (daemon/worker.py, daemon/pipeline.py) in-process, on real ONNX
models run by the built-in onnxruntime backend: stage threads and their overlap,
per-thread CPU affinity read back from /proc, dynamic batching (merge, split, mixed
shapes, failures reaching only their own request), and model.toml checks."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from inferd.daemon.model_settings import check_settings
from inferd.daemon.pipeline import parse_spec
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.worker import Workers, WorkItem
from inferd.ipc.errors import ErrorCode, ModelError
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import LocalTicket, ReplySink
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from onnx import TensorProto, helper


class Collector:
    """Replies by request id, with a way to wait for n of them."""

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {}
        self.cond = threading.Condition()

    def ticket(self, rid: str) -> LocalTicket:
        def deliver(reply: Reply) -> None:
            with self.cond:
                assert rid not in self.replies, f"second reply for {rid}"
                self.replies[rid] = reply
                self.cond.notify_all()
        return LocalTicket(rid, deliver)

    def wait(self, n: int, timeout: float = 60.0) -> dict[str, Reply]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.replies) >= n, timeout), \
                f"only {len(self.replies)} of {n} replies"
            return dict(self.replies)


def load(path: Path) -> Any:
    return OnnxRuntimeCpuBackend().load(path, LoadOptions(1, 1))


def start(name: str, model: Any, settings: dict[str, Any], items: list[tuple[str, dict]],
          collector: Collector, instances: int = 1,
          registry: ProcessorRegistry | None = None) -> Workers:
    """Queue ``items`` first, then start the workers (so batching sees them together)."""
    work: queue.Queue[Any] = queue.Queue(64)
    for rid, inputs in items:
        work.put(WorkItem(Request(rid, Op.INFER, model=name, inputs=inputs),
                          collector.ticket(rid)))
    spec = parse_spec(name, check_settings(name, settings), registry or ProcessorRegistry())
    workers = Workers(name, model, work, ReplySink(), instances, spec=spec, backend="onnxruntime")
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
        placement = workers.placement()
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
    workers = start("b", cls_model, {"max_batch": 16, "max_delay_ms": 200},
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
    workers = start("mixed", cls_model, {"max_batch": 8, "max_delay_ms": 200}, items,
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
    workers = start("g", model, {"max_batch": 8, "max_delay_ms": 200}, items, collector)
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
    work: queue.Queue[WorkItem | None] = queue.Queue()
    ticket = collector.ticket("late")
    ticket.deadline = time.monotonic() - 1
    work.put(WorkItem(Request("late", Op.INFER, model="m", inputs={"x": cls_input(0)},
                              timeout_ms=1), ticket))
    workers = Workers("m", cls_model, work, ReplySink())
    workers.start()
    try:
        assert collector.wait(1)["late"].error.code is ErrorCode.DEADLINE_EXCEEDED
    finally:
        assert workers.stop(30)
