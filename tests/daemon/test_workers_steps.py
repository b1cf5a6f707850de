"""Processor steps in the processors worker without a daemon: how values cross (numeric
arrays as channel tensors at any depth, the rest pickled, inputs given back by name), and
steps built, run, failing and released in a real worker of a pool."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from inferd.daemon.processors import Context, ProcessorRegistry, release
from inferd.daemon.repository import Repository
from inferd.daemon.workers.pool import WorkerDied
from inferd.daemon.workers.steps import PROCESSORS, RemoteStep, RemoteSteps, pack, unpack
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from tests.daemon.test_workers import new_pool
from tests.e2e.test_cache_reload import poll


def test_numeric_arrays_cross_as_tensors_at_any_depth_and_the_rest_pickled() -> None:
    big = np.arange(300_000, dtype=np.float32).reshape(300, 1000)
    crops = [np.full((4, 5, 3), i, np.uint8) for i in range(3)]
    values = {"x": big, "crops": crops, "meta": {"ratio": (0.5, 2), "name": "a"},
              "texts": np.array(["un", "deux"]), "n": np.float32(3.5), "none": None,
              "objects": np.array([b"raw", "text"], dtype=object)}
    tensors = pack(values)
    skeleton = tensors["values"]
    assert skeleton.nbytes < 2000  # the arrays are not in it
    assert {k for k in tensors if k != "values"} == {"0", "1", "2", "3"}
    back = unpack(dict(tensors))
    np.testing.assert_array_equal(back["x"], big)
    assert [c.tolist() for c in back["crops"]] == [c.tolist() for c in crops]
    assert back["meta"] == values["meta"] and back["none"] is None
    assert back["texts"].tolist() == ["un", "deux"] and back["n"] == np.float32(3.5)
    assert back["objects"].tolist() == [b"raw", "text"]


def test_an_input_given_back_is_named_not_sent_again() -> None:
    x = np.ones((100, 100), np.float32)
    sent = pack({"x": x, "k": 1})
    received = {k: a.copy() for k, a in sent.items()}
    values = unpack(dict(received))
    inputs = {id(a): k for k, a in received.items()}
    answer = pack({**values, "y": values["x"] * 2}, inputs)
    assert set(answer) == {"values", "0"}  # y only: x is named as input 0
    out = unpack(dict(answer), {k: a for k, a in sent.items() if k != "values"})
    assert out["x"] is x and out["k"] == 1
    np.testing.assert_array_equal(out["y"], x * 2)


def test_a_reference_to_an_input_where_none_was_sent_is_refused() -> None:
    x = np.ones(3)
    answer = pack({"x": x}, {id(x): "0"})
    with pytest.raises(pickle.UnpicklingError):
        unpack(answer, None)


@pytest.fixture
def remote():  # type: ignore[no-untyped-def]
    pool = new_pool(idle_exit_s=1.0)
    yield RemoteSteps(pool, "/nonexistent", True, 30.0)
    pool.close()


def test_steps_run_in_the_processors_worker_and_it_ends_once_they_are_released(
        remote: RemoteSteps, tmp_path: Path) -> None:
    registry = ProcessorRegistry(remote=remote)
    ctx = Context(None, "model m", Repository(tmp_path))
    softmax = registry.build({"op": "softmax", "input": "x"}, ctx, "model m: post[0]")
    topk = registry.build({"op": "topk", "input": "x", "k": 1, "labels": ["a", "b"]}, ctx,
                          "model m: post[1]")
    assert isinstance(softmax, RemoteStep) and softmax.worker.pid != 0
    assert softmax.worker is topk.worker and remote.pool.pids() == {
        PROCESSORS: softmax.worker.pid}
    x = np.array([[1.0, 3.0]], np.float32)
    here = ProcessorRegistry().build({"op": "softmax", "input": "x"}, Context(), "here")
    np.testing.assert_array_equal(softmax({"x": x})["x"], here({"x": x})["x"])
    out = topk(softmax({"x": x}))
    assert out["topk_labels"].tolist() == [["b"]], out
    # a processor's own error keeps its code and names it; an unknown name lists those
    # available (in the worker: the daemon imports no processor)
    with pytest.raises(InferdError) as e:
        softmax({"y": x})
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and "needs value 'x'" in e.value.message
    with pytest.raises(ModelError) as e:
        registry.build({"op": "no.such"}, ctx, "graph g: node n")
    assert e.value.message.startswith("graph g: node n: unknown processor 'no.such'; "
                                      "available: ") and "ocr.det_pre" in e.value.message
    release([("post[0]", softmax), ("post[1]", topk)])
    poll(lambda: not softmax.worker.alive, 20)  # idle_exit_s after the last release
    assert remote.pool.restarts == {} and remote.pool.pids() == {}


def test_a_step_whose_worker_died_is_built_again(remote: RemoteSteps) -> None:
    registry = ProcessorRegistry(remote=remote)
    step = registry.build({"op": "sleep", "ms": 0}, Context(), "graph g: node s")
    x = {"x": np.zeros(3)}
    assert step(x)["x"] is x["x"]  # given back as it came: the daemon's own array
    first = step.worker
    remote.pool.kill(first, "killed by the test")
    poll(lambda: not first.alive, 20)
    assert step(x)["x"] is x["x"]
    assert step.worker is not first and step.worker.alive
    release([step])
    with pytest.raises(ModelError, match="processor sleep was released"):
        remote.pool.kill(step.worker, "killed by the test")
        poll(lambda: not step.worker.alive, 20)
        step(x)


def test_a_step_that_kills_its_worker_fails_with_the_death_named(remote) -> None:
    step = ProcessorRegistry(remote=remote).build({"op": "sleep", "ms": 60_000}, Context(),
                                                  "graph g: node s")
    try:
        def kill_once_running() -> None:
            poll(lambda: bool(step.worker.running), 20)
            remote.pool.kill(step.worker, "killed by the test")

        killer = threading.Thread(target=kill_once_running)
        killer.start()
        with pytest.raises(WorkerDied) as e:
            step({"x": np.zeros(1)})
        killer.join()
        assert e.value.message == (f"processors (worker {step.worker.pid}) killed by the "
                                   f"test while running processor sleep")
    finally:
        release([step])


KEEPER = '''
def make_keeper():
    kept = []

    def step(values):
        kept.append(values["x"])  # kept past the call: a step with state
        return {"x": kept[0]}
    return step


PROCESSORS = {"keeper": make_keeper}
'''


def test_a_value_a_step_keeps_past_its_call_stays_as_it_came(tmp_path: Path) -> None:
    (tmp_path / "keeper.py").write_text(KEEPER)
    pool = new_pool()
    try:
        remote = RemoteSteps(pool, str(tmp_path), False, 30.0)
        step = ProcessorRegistry(remote=remote).build({"op": "keeper"}, Context(), "g: n")
        big = [np.full(100_000, i, np.float32) for i in range(3)]  # through the arena
        for x in big:
            np.testing.assert_array_equal(step({"x": x})["x"], big[0])
        release([step])
    finally:
        pool.close()
