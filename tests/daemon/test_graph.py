"""Graphs (daemon/graph.py, daemon/graphs.py) in-process over a real model manager with
real ONNX models: load errors name the culprit, dead nodes are dropped, both executors
give identical results, the multi-consumer edge keeps packets until all consumers took
them, and user processor files are logged and skipped when broken."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inferd.daemon.config import load_config
from inferd.daemon.executors import Edge
from inferd.daemon.graphs import GraphManager
from inferd.daemon.models import ModelManager
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.repository import Repository
from inferd.ipc.replies import LocalTicket, ReplySink
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.protocol import Op, Reply, Request
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from inferd.libbackends.registry import Registry
from tests.links import link_tree

CLS_OUT = "save_infer_model/scale_0.tmp_1"

TWO_BRANCHES = f"""
executor = "{{executor}}"
inputs = ["x"]
[outputs]
top = "join.top"
probs = "join.probs"

[[nodes]]
name = "cls"
model = "ocr-cls"
inputs = {{{{ x = "input.x" }}}}
rename = {{{{ "{CLS_OUT}" = "probs" }}}}

[[nodes]]
name = "top"
processor = "topk"
params = {{{{ k = 1, input = "probs", labels = ["0", "180"] }}}}
inputs = {{{{ probs = "cls.probs" }}}}

[[nodes]]
name = "scale"
processor = "image.normalize"
params = {{{{ input = "x", scale = 2.0 }}}}
inputs = {{{{ x = "input.x" }}}}

[[nodes]]
name = "cls2"
model = "ocr-cls"
inputs = {{{{ x = "scale.x" }}}}
rename = {{{{ "{CLS_OUT}" = "probs" }}}}

[[nodes]]
name = "join"
processor = "rename"
params = {{{{ mapping = {{{{ labels = "top" }}}} }}}}
inputs = {{{{ labels = "top.topk_labels", probs = "cls2.probs" }}}}

[[nodes]]
name = "unused"
processor = "softmax"
inputs = {{{{ x = "input.x" }}}}
"""


class Harness:
    """A model manager and a graph manager over a temporary repository."""

    def __init__(self, root: Path, models_dir: Path,
                 models: tuple[str, ...] = ("ocr-cls",), **settings: Any) -> None:
        root.mkdir(exist_ok=True)
        for name in models:
            (root / name).mkdir()
            link_tree(models_dir / name / "1", root / name / "1")
        self.root = root
        self.config = load_config(None, {"models.repository": str(root), **settings})
        repo = Repository(root)
        registry = Registry()
        registry.register(OnnxRuntimeCpuBackend())
        sink = ReplySink(self._wire_reply)
        self.processors = ProcessorRegistry()
        self.models = ModelManager(repo, registry, lambda: self.config, sink,
                                   processors=self.processors)
        self.graphs = GraphManager(repo, self.processors, self.models, sink)
        self.sink = sink

    @staticmethod
    def _wire_reply(ticket: Any, reply: Reply) -> None:
        raise AssertionError("no wire tickets in these tests")

    def write(self, name: str, text: str) -> None:
        (self.root / name).mkdir(exist_ok=True)
        (self.root / name / "graph.toml").write_text(text)

    def call(self, graph: str, inputs: dict[str, np.ndarray],
             timeout: float = 60.0) -> Reply:
        return self.call_many(graph, [inputs], timeout)[0]

    def call_many(self, graph: str, batch: list[dict[str, np.ndarray]],
                  timeout: float = 60.0) -> list[Reply]:
        replies: dict[int, Reply] = {}
        cond = threading.Condition()

        def deliver(i: int) -> Any:
            def put(reply: Reply) -> None:
                with cond:
                    assert i not in replies
                    replies[i] = reply
                    cond.notify_all()
            return put
        for i, inputs in enumerate(batch):
            self.graphs.submit(LocalTicket(Request(f"q{i}", Op.INFER, model=graph,
                                                   inputs=inputs), deliver(i)))
        with cond:
            assert cond.wait_for(lambda: len(replies) == len(batch), timeout)
        return [replies[i] for i in range(len(batch))]

    def stop(self) -> None:
        assert self.graphs.stop(30) == []
        assert self.models.stop(30)


@pytest.fixture
def harness(tmp_path: Path, models_dir: Path) -> Iterator[Harness]:
    h = Harness(tmp_path / "repo", models_dir)
    yield h
    h.stop()


def images(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal((1 + i % 2, 3, 48, 192)).astype(np.float32)}
            for i in range(n)]


def test_both_executors_give_identical_results_on_the_same_graph(harness: Harness) -> None:
    harness.write("g_task", TWO_BRANCHES.format(executor="task"))
    harness.write("g_pipe", TWO_BRANCHES.format(executor="pipeline"))
    batch = images(6)
    task = harness.call_many("g_task", batch)
    pipe = harness.call_many("g_pipe", batch)
    for t, p, inputs in zip(task, pipe, batch):
        assert t.ok and p.ok, (t.error, p.error)
        assert sorted(t.outputs) == ["probs", "top"]
        assert t.outputs["top"].dtype == object and t.outputs["top"].shape == (len(inputs["x"]), 1)
        assert t.outputs["top"].tolist() == p.outputs["top"].tolist()
        np.testing.assert_array_equal(t.outputs["probs"], p.outputs["probs"])
    described = {g["name"]: g for g in harness.graphs.describe()}
    assert described["g_pipe"]["dropped"] == ["unused"]
    assert "inferd-g_pipe-cls" in described["g_pipe"]["threads"]
    assert not any("unused" in t for t in described["g_pipe"]["threads"])


def test_graph_request_errors_reach_only_their_own_request(harness: Harness) -> None:
    harness.write("g", TWO_BRANCHES.format(executor="pipeline"))
    good = images(1)[0]
    bad = {"x": np.zeros((1, 3, 48), np.float32)}  # wrong rank for ocr-cls
    replies = harness.call_many("g", [good, bad, good])
    assert replies[0].ok and replies[2].ok
    assert replies[1].error.code is ErrorCode.INVALID_ARGUMENT
    message = replies[1].error.message
    assert "graph g: node cls" in message or "node cls2" in message
    with pytest.raises(InferdError) as e:
        harness.graphs.submit(LocalTicket(Request("x", Op.INFER, model="g",
                                                  inputs={"y": good["x"]}), lambda r: None))
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and "missing ['x']" in e.value.message


def test_reload_retires_a_changed_or_removed_graph_and_lets_its_frames_finish(
        harness: Harness) -> None:
    harness.write("g", TWO_BRANCHES.format(executor="pipeline"))
    assert harness.call("g", images(1)[0]).ok
    running = harness.graphs.executor("g")
    assert harness.graphs.reload(harness.graphs.repo, 30) == []  # unchanged: kept
    assert harness.graphs.executor("g") is running

    # Frames in flight when the file changes finish on the old graph.
    batch = images(8)
    done: list[Reply] = []
    caller = threading.Thread(target=lambda: done.extend(harness.call_many("g", batch)))
    caller.start()
    harness.write("g", TWO_BRANCHES.format(executor="task"))
    assert harness.graphs.reload(harness.graphs.repo, 30) == ["g"]
    caller.join(60)
    assert len(done) == len(batch) and all(r.ok for r in done), [r.error for r in done]
    assert harness.call("g", images(1)[0]).ok
    assert {d["name"]: d for d in harness.graphs.describe()}["g"]["executor"] == "task"

    (harness.root / "g" / "graph.toml").unlink()
    assert harness.graphs.reload(harness.graphs.repo, 30) == ["g"]
    gone = harness.call("g", images(1)[0])
    assert gone.error is not None and gone.error.code is ErrorCode.NOT_FOUND


BAD_GRAPHS = {
    "cycle": ("""inputs = ["x"]
outputs = { y = "b.x" }
[[nodes]]
name = "a"
processor = "softmax"
inputs = { x = "b.x", z = "input.x" }
[[nodes]]
name = "b"
processor = "softmax"
inputs = { x = "a.x" }
""", ErrorCode.INVALID_ARGUMENT, "cycle among nodes a -> b -> a"),
    "dangling": ("""inputs = ["x"]
outputs = { y = "a.x" }
[[nodes]]
name = "a"
processor = "softmax"
inputs = { x = "ghost.x" }
""", ErrorCode.INVALID_ARGUMENT, "dangling edge ghost.x -> a.x: there is no node 'ghost'"),
    "dangling_input": ("""inputs = ["x"]
outputs = { y = "a.x" }
[[nodes]]
name = "a"
processor = "softmax"
inputs = { x = "input.image" }
""", ErrorCode.INVALID_ARGUMENT, "the graph has no input 'image'"),
    "dangling_output": ("""inputs = ["x"]
outputs = { y = "nobody.x" }
[[nodes]]
name = "a"
processor = "softmax"
inputs = { x = "input.x" }
""", ErrorCode.INVALID_ARGUMENT, "dangling edge nobody.x -> output y"),
    "missing_model": ("""inputs = ["x"]
outputs = { y = "a.y" }
[[nodes]]
name = "a"
model = "ocr-nothing"
inputs = { x = "input.x" }
""", ErrorCode.NOT_FOUND, "node a names model 'ocr-nothing', which is not in the repository"),
    "bad_processor": ("""inputs = ["x"]
outputs = { y = "a.y" }
[[nodes]]
name = "a"
processor = "nope"
inputs = { x = "input.x" }
""", ErrorCode.INVALID_ARGUMENT, "unknown processor 'nope'"),
    "bad_executor": ("""executor = "magic"
inputs = ["x"]
outputs = { y = "a.y" }
""", ErrorCode.INVALID_ARGUMENT, "executor 'magic'"),
}


@pytest.mark.parametrize("name", sorted(BAD_GRAPHS))
def test_graph_load_errors_name_the_culprit(harness: Harness, name: str) -> None:
    text, code, words = BAD_GRAPHS[name]
    harness.write(name, text)
    assert harness.graphs.is_graph(name)
    with pytest.raises(ModelError) as e:
        harness.graphs.executor(name)
    assert e.value.code is code
    assert f"graph {name}: " in e.value.message and words in e.value.message, e.value.message
    # through submit (as the daemon does) the load error is the request's reply
    reply = harness.call(name, {"x": np.zeros(1, np.float32)})
    assert reply.error == (code, e.value.message)


def test_edge_keeps_a_packet_until_every_consumer_took_it_and_blocks_when_full() -> None:
    edge = Edge("e", ["a", "b"], capacity=2)
    assert edge.put(1, block=False) and edge.put(2, block=False)
    assert not edge.put(3, block=False)  # full: the producer would block
    assert edge.get("a") == 1 and edge.get("a") == 2
    assert edge.held() == 2  # b has taken nothing yet
    assert edge.get("b") == 1
    assert edge.held() == 1 and edge.put(3, block=False)
    blocked = threading.Event()
    done = threading.Event()

    def producer() -> None:
        blocked.set()
        edge.put(4)  # blocks until b takes 2
        done.set()
    t = threading.Thread(target=producer)
    t.start()
    blocked.wait()
    assert not done.is_set()
    assert edge.get("b") == 2
    assert done.wait(10)
    t.join()
    assert [edge.get("a"), edge.get("a"), edge.get("b"), edge.get("b")] == [3, 4, 3, 4]
    assert edge.held() == 0


def test_user_processor_files_are_logged_and_skipped_when_broken(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "good.py").write_text(
        "def double(values):\n    return {k: v * 2 for k, v in values.items()}\n"
        "PROCESSORS = {'double': lambda: double}\n")
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    (tmp_path / "nodict.py").write_text("X = 1\n")
    (tmp_path / "clash.py").write_text("PROCESSORS = {'softmax': lambda: None}\n")
    registry = ProcessorRegistry()
    with caplog.at_level(logging.WARNING, logger="inferd.daemon.processors"):
        assert registry.load_directory(tmp_path) == ["double"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    by_file = {Path(r.PLUGIN_PATH).name: (r.STAGE, r.getMessage()) for r in warnings}
    assert by_file["syntax.py"][0] == "import" and "SyntaxError" in by_file["syntax.py"][1]
    assert by_file["nodict.py"][0] == "contract" and "PROCESSORS" in by_file["nodict.py"][1]
    assert by_file["clash.py"][0] == "register" and "softmax" in by_file["clash.py"][1]
    for r in warnings:
        assert str(tmp_path) in r.getMessage()
    step = registry.build({"op": "double"}, __import__(
        "inferd.daemon.processors", fromlist=["Context"]).Context(), "test")
    assert step({"x": np.ones(2)})["x"].tolist() == [2, 2]
    assert "double" in registry.names() and "ocr.det_post" in registry.names()


def test_foreach_over_a_1d_int64_input_calls_the_model_per_element(harness: Harness) -> None:
    """Issue 18, defect 10: 'Unable to handle object of type numpy.int64'."""
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (harness.root / "double" / "1").mkdir(parents=True)
    save(model, str(harness.root / "double" / "1" / "model.onnx"))
    harness.write("each", 'inputs = ["ids"]\n[outputs]\ny = "dbl.y"\n[[nodes]]\n'
                          'name = "dbl"\nmodel = "double"\nforeach = true\n'
                          'inputs = { x = "input.ids" }\n')
    reply = harness.call("each", {"ids": np.array([3, 5, 7], np.int64)})
    assert reply.error is None, reply.error
    assert [int(v) for v in np.asarray(reply.outputs["y"]).ravel()] == [6, 10, 14]
    reply = harness.call("each", {"ids": np.array(4, np.int64)})  # nothing to iterate
    assert reply.error is not None and reply.error.code is ErrorCode.INVALID_ARGUMENT
    assert "foreach input 'x' is a scalar" in reply.error.message


# --------------------------------------------------------------------------- stuck nodes

GATE = """
import threading
GATE = threading.Event()
def make():
    def step(values):
        GATE.wait()
        return values
    return step
PROCESSORS = {"gate": make}
"""

HANG = """executor = "{executor}"
inputs = ["x"]
[outputs]
y = "hang.x"
[[nodes]]
name = "hang"
processor = "gate"
inputs = {{ x = "input.x" }}
"""


class Replies:
    """The replies of LocalTickets by id; a second reply to one id fails the test."""

    def __init__(self) -> None:
        self.got: dict[str, Reply] = {}
        self.cond = threading.Condition()
        self.tickets: list[LocalTicket] = []

    def ticket(self, request: Request) -> LocalTicket:
        rid = request.id

        def deliver(reply: Reply) -> None:
            with self.cond:
                assert rid not in self.got, f"second reply to {rid}"
                self.got[rid] = reply
                self.cond.notify_all()
        t = LocalTicket(request, deliver)
        self.tickets.append(t)
        return t

    def open_tickets(self) -> list[LocalTicket]:
        """For the watch: the tickets not answered yet, as the server's open ones."""
        return [t for t in self.tickets if t.code is None]

    def wait(self, *rids: str, timeout: float = 30) -> list[Reply]:
        with self.cond:
            assert self.cond.wait_for(lambda: all(r in self.got for r in rids), timeout), \
                (rids, list(self.got))
            return [self.got[r] for r in rids]


def _gated(harness: Harness, tmp_path: Path) -> Any:
    (tmp_path / "procs").mkdir()
    (tmp_path / "procs" / "gate.py").write_text(GATE)
    assert harness.processors.load_directory(tmp_path / "procs") == ["gate"]
    import sys
    return sys.modules["inferd_user_processors.gate"].GATE


def _until(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("executor", ["pipeline", "task"])
def test_a_stuck_node_cannot_hold_deadlines_an_unload_or_its_frames(
        tmp_path: Path, models_dir: Path, executor: str) -> None:
    """Issue 20 item 4, in-process: a node that never returns (a processor waiting on
    a gate the test opens at the end). The requests with a deadline get
    DEADLINE_EXCEEDED from the watch when it passes; the stage is reported stuck; an
    unload answers at once with an error naming the node, answering the frames it held
    UNAVAILABLE; when the node returns, its late reply is dropped (one reply each)."""
    from inferd.daemon.watch import Watch

    h = Harness(tmp_path / "repo", models_dir, **{"models.stuck_after_s": 0.2})
    gate = _gated(h, tmp_path)
    replies = Replies()
    watch = Watch(h.sink, replies, h.models, h.graphs, lambda: h.config)
    watch.start()
    try:
        h.write("hang", HANG.format(executor=executor))
        x = {"x": np.ones((1, 4), np.float32)}
        tickets = [replies.ticket(Request(rid, Op.INFER, model="hang", inputs=x,
                                          timeout_ms=timeout_ms))
                   for rid, timeout_ms in (("first", None), ("d1", 500), ("d2", 500),
                                           ("forever", None))]
        for t in tickets:
            watch.track(t)
            h.graphs.executor("hang").submit(t)
        for r in replies.wait("d1", "d2"):
            assert r.error.code is ErrorCode.DEADLINE_EXCEEDED, r.error
        ex = h.graphs.executor("hang")
        _until(lambda: ex.stuck(0.2))
        watch.scan()
        thread = "inferd-hang-hang" if executor == "pipeline" else "inferd-hang-task"
        assert thread in " ".join(watch.stuck()["hang"]), watch.stuck()
        t0 = time.monotonic()
        with pytest.raises(InferdError) as e:
            h.graphs.unload("hang", timeout=None, stuck_after=0.2)
        assert time.monotonic() - t0 < 5
        assert e.value.code is ErrorCode.UNAVAILABLE and "did not end" in e.value.message
        assert thread in e.value.message
        first, forever = replies.wait("first", "forever")
        assert first.error.code is ErrorCode.UNAVAILABLE and "stuck" in first.error.message
        assert forever.error.code is ErrorCode.UNAVAILABLE
        gate.set()  # the stuck call returns: its result goes nowhere
        _until(lambda: not ex.stuck())
        watch.scan()
        assert "hang" not in watch.stuck()
        assert h.call("hang", x).ok  # a fresh executor
    finally:
        gate.set()
        watch.stop()
        h.stop()
    assert len(replies.got) == 4


def test_a_graph_call_to_a_full_model_queue_waits_for_room_within_its_deadline(
        tmp_path: Path, models_dir: Path) -> None:
    """Item 3: a foreach of 40 ocr-cls calls into a model queue of 2 is backpressure,
    not RESOURCE_EXHAUSTED; with a deadline that passes first it is DEADLINE_EXCEEDED."""
    h = Harness(tmp_path / "repo", models_dir, **{"models.queue_size": 2})
    try:
        h.write("each", 'inputs = ["x"]\n[outputs]\np = "cls.p"\n[[nodes]]\nname = "cls"\n'
                        'model = "ocr-cls"\nforeach = true\ninputs = { x = "input.x" }\n'
                        f'rename = {{ "{CLS_OUT}" = "p" }}\n')
        crops = np.zeros((40, 1, 3, 48, 192), np.float32)
        reply = h.call("each", {"x": crops})
        assert reply.ok, reply.error
        assert np.asarray(reply.outputs["p"]).shape == (40, 1, 2)
        late = Replies()
        h.graphs.submit(late.ticket(Request("late", Op.INFER, model="each",
                                            inputs={"x": crops}, timeout_ms=20)))
        (r,) = late.wait("late")
        assert r.error.code is ErrorCode.DEADLINE_EXCEEDED, r.error
    finally:
        h.stop()


# --------------------------------------------------------------------------- released values

HOLDER = """
import threading, weakref
import numpy as np
GATE = threading.Event()
REFS = []
def big():
    def step(values):
        x = np.ones((256, 1024), np.float32)  # 1 MiB
        REFS.append(weakref.ref(x))
        return {"big": x, "small": values["x"]}
    return step
def use():
    return lambda values: {"n": np.asarray(float(values["big"].sum()))}
def gate():
    def step(values):
        GATE.wait()
        return values
    return step
PROCESSORS = {"big": big, "use": use, "gate": gate}
"""

RELEASE = """executor = "{executor}"
queue_size = 1
inputs = ["x"]
[outputs]
small = "last.small"
n = "last.n"
[[nodes]]
name = "make"
processor = "big"
inputs = {{ x = "input.x" }}
[[nodes]]
name = "use"
processor = "use"
inputs = {{ big = "make.big" }}
[[nodes]]
name = "wait"
processor = "gate"
inputs = {{ n = "use.n" }}
[[nodes]]
name = "last"
processor = "rename"
params = {{ mapping = {{}} }}
inputs = {{ small = "make.small", n = "wait.n" }}
"""


@pytest.mark.parametrize("executor", ["pipeline", "task"])
def test_a_value_is_let_go_once_every_node_that_reads_it_has_it(
        tmp_path: Path, models_dir: Path, executor: str) -> None:
    """Issue 21 part 3: a frame's value is not held until the frame's last node. ``make``
    gives ``big`` (read by ``use`` only) and ``small`` (read by ``last``, which also
    waits for the gated ``wait``): while the frame waits at the gate, ``big`` is gone
    from memory, and the reply still carries everything ``last`` read."""
    h = Harness(tmp_path / "repo", models_dir, models=())
    (tmp_path / "procs").mkdir()
    (tmp_path / "procs" / "holder.py").write_text(HOLDER)
    assert sorted(h.processors.load_directory(tmp_path / "procs")) == ["big", "gate", "use"]
    import sys
    mod = sys.modules["inferd_user_processors.holder"]
    replies = Replies()
    try:
        h.write("rel", RELEASE.format(executor=executor))
        x = np.arange(4, dtype=np.float32)
        h.graphs.executor("rel").submit(replies.ticket(Request("r", Op.INFER, model="rel",
                                                               inputs={"x": x})))
        _until(lambda: len(mod.REFS) == 1 and mod.REFS[0]() is None, 5)
        assert "r" not in replies.got  # still in flight: held at the gate
    finally:
        mod.GATE.set()
    try:
        (reply,) = replies.wait("r")
        assert reply.error is None, reply.error
        assert reply.outputs["small"].tolist() == x.tolist()
        assert float(reply.outputs["n"]) == 256 * 1024
    finally:
        h.stop()


def test_an_edge_releases_a_value_once_its_readers_took_the_packet() -> None:
    """The pipeline's edge: consumer ``a`` reads ``x``, ``b`` reads ``meta``, ``c``
    (not named) reads everything. Each is given what it reads; once ``a`` and ``c``
    took the packet, the copy held for ``b`` no longer holds ``x``."""
    from inferd.daemon.executors import RELEASED, Packet

    edge = Edge("e", ["a", "b", "c"], 2, {"a": frozenset({"x"}), "b": frozenset({"meta"})})
    req = Request("r", Op.INFER, model="g", inputs={})
    values = {"x": np.zeros(3), "meta": 1}
    edge.put(Packet(LocalTicket(req, lambda r: None), values))
    got = edge.get("a").values
    assert got["x"] is values["x"] and got["meta"] is RELEASED
    assert edge.get("c").values is values  # c reads all: the packet as put
    held = edge.get("b").values
    assert held["meta"] == 1 and held["x"] is RELEASED
    assert values["x"] is not RELEASED and edge.held() == 0


AHEAD = """
import threading, weakref
import numpy as np
PASS = threading.Semaphore(0)
REFS, ALIVE = [], []
def make():
    def step(values):
        x = np.ones((256, 1024), np.float32)
        REFS.append(weakref.ref(x))
        ALIVE.append(sum(r() is not None for r in REFS))
        return {"big": x}
    return step
def slow():
    def step(values):
        PASS.acquire()
        return {"n": np.asarray(float(values["big"][0, 0]))}
    return step
PROCESSORS = {"make": make, "slow": slow}
"""

AHEAD_GRAPH = """executor = "pipeline"
queue_size = 1
inputs = ["x"]
[outputs]
n = "slow.n"
[[nodes]]
name = "make"
processor = "make"
inputs = { x = "input.x" }
[[nodes]]
name = "slow"
processor = "slow"
inputs = { big = "make.big" }
"""


def test_a_pipeline_node_does_not_make_a_frame_its_full_edge_cannot_take(
        tmp_path: Path, models_dir: Path) -> None:
    """Issue 21 part 3: with queue_size 1, a producer waits for room before it takes its
    next frame, so one frame waits for the slow consumer and none more sits finished in
    the producer's hands: at most two of ``make``'s frames are alive at once (the one
    ``slow`` holds, the one on the edge). Before, a third one waited in ``put``."""
    h = Harness(tmp_path / "repo", models_dir, models=())
    (tmp_path / "procs").mkdir()
    (tmp_path / "procs" / "ahead.py").write_text(AHEAD)
    assert sorted(h.processors.load_directory(tmp_path / "procs")) == ["make", "slow"]
    import sys
    mod = sys.modules["inferd_user_processors.ahead"]
    replies = Replies()
    try:
        h.write("ahead", AHEAD_GRAPH)
        ex = h.graphs.executor("ahead")
        for i in range(5):
            ex.submit(replies.ticket(Request(f"r{i}", Op.INFER, model="ahead",
                                             inputs={"x": np.zeros(1, np.float32)})))
        for i in range(5):
            _until(lambda: len(mod.REFS) >= min(5, i + 2))  # the edge holds the next
            mod.PASS.release()
            replies.wait(f"r{i}")
        assert len(mod.ALIVE) == 5 and max(mod.ALIVE) <= 2, mod.ALIVE
    finally:
        for _ in range(5):
            mod.PASS.release()
        h.stop()
