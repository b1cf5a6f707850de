"""A small request runs on the I/O thread (daemon/model_threads.py ``may_run_on_io_thread``,
``[models] io_run_max_us``): only after the model's last runs were all short, only for a
model without pre/post steps or batching delay, never for a pinned model on a thread
outside its cores; its reply, metrics and counts as for any other request. In-process on
the ocr-cls model run by onnxruntime, then against a real daemon."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from inferd.daemon.fairqueue import FairQueue
from inferd.daemon.model_settings import check_settings
from inferd.daemon.pipeline import parse_spec
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.model_threads import IO_RUN_AFTER, IO_RUN_MAX_BYTES, ModelThreads, Queued
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import LocalTicket, ReplySink
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from tests.daemon.test_metrics import families, value


@pytest.fixture(scope="module")
def cls_model(models_dir: Path) -> Any:
    model = OnnxRuntimeCpuBackend().load(models_dir / "ocr-cls" / "1" / "model.onnx",
                                         LoadOptions(1, 1))
    yield model
    model.unload()


def x() -> np.ndarray:
    return np.zeros((1, 3, 48, 192), np.float32)


class Replies:
    """Replies by request id, and the thread each was answered on."""

    def __init__(self) -> None:
        self.got: dict[str, tuple[Reply, str]] = {}
        self.cond = threading.Condition()

    def ticket(self, request: Request) -> LocalTicket:
        rid = request.id

        def deliver(reply: Reply) -> None:
            with self.cond:
                self.got[rid] = (reply, threading.current_thread().name)
                self.cond.notify_all()
        return LocalTicket(request, deliver)

    def wait(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, 60), self.got.keys()


def workers_for(model: Any, settings: dict[str, Any], max_s: float = 10.0,
                registry: ProcessorRegistry | None = None) -> tuple[ModelThreads, FairQueue]:
    spec = parse_spec("cls", check_settings("cls", settings), registry or ProcessorRegistry())
    work = FairQueue()
    workers = ModelThreads("cls", model, work, ReplySink(), 1, spec=spec, backend="onnxruntime",
                      io_run_max_s=max_s)
    workers.start()
    return workers, work


def item(rid: str, replies: Replies) -> Queued:
    return Queued(replies.ticket(Request(rid, Op.INFER, model="cls", inputs={"x": x()})))


def serve(work: FairQueue, replies: Replies, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        work.put(item(f"r{i}", replies))
    replies.wait(start + n)


def test_only_after_its_last_runs_were_short_and_then_on_the_calling_thread(cls_model):
    replies = Replies()
    workers, work = workers_for(cls_model, {}, max_s=10.0)  # every run is "short"
    try:
        serve(work, replies, IO_RUN_AFTER - 1)
        assert not workers.may_run_on_io_thread(1000)  # one run short of the count
        serve(work, replies, 1, IO_RUN_AFTER - 1)
        assert workers.may_run_on_io_thread(1000)
        assert not workers.may_run_on_io_thread(IO_RUN_MAX_BYTES + 1)  # too big a request
        workers.run_on_io_thread(item("here", replies))
        reply, thread = replies.got["here"]
        assert reply.ok and reply.outputs[next(iter(reply.outputs))].shape == (1, 2)
        assert thread == threading.current_thread().name and workers.io_thread_runs == 1
        assert {t for _, t in (replies.got[f"r{i}"] for i in range(IO_RUN_AFTER))} == {
            "inferd-cls-infer-0"}
    finally:
        assert workers.stop(30)


def test_a_long_run_sends_the_requests_back_to_the_models_threads(cls_model):
    replies = Replies()
    workers, work = workers_for(cls_model, {}, max_s=1e-9)  # no run is that short
    try:
        serve(work, replies, IO_RUN_AFTER + 4)
        assert not workers.may_run_on_io_thread(1000)
    finally:
        assert workers.stop(30)
    off, work = workers_for(cls_model, {}, max_s=0.0)  # io_run_max_us = 0: never
    try:
        serve(work, Replies(), IO_RUN_AFTER + 4)
        assert not off.may_run_on_io_thread(1000)
    finally:
        assert off.stop(30)


@pytest.mark.parametrize("settings", [
    {"pre": [{"op": "rename", "mapping": {}}]},
    {"max_batch": 4, "max_delay_ms": 5},
])
def test_not_for_pre_post_steps_or_a_batching_delay(cls_model, settings):
    workers, work = workers_for(cls_model, settings)
    try:
        serve(work, Replies(), IO_RUN_AFTER + 1)
        assert not workers.may_run_on_io_thread(1000)
    finally:
        assert workers.stop(30)


def test_a_pinned_model_only_where_this_threads_cores_are_its_own(cls_model):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two usable cores")
    for pinned, allowed in (([cores[0]], False), (cores, True)):
        workers, work = workers_for(cls_model, {"cpu_affinity": pinned})
        try:
            serve(work, Replies(), IO_RUN_AFTER)
            assert workers.may_run_on_io_thread(1000) is allowed, pinned
        finally:
            assert workers.stop(30)


def test_a_daemon_runs_small_requests_on_its_io_thread_and_counts_them(
        tmp_path, start_daemon, short_tmp):
    """Against a real daemon: a 16-byte identity request after the first runs is served
    on the I/O thread (``io_thread_runs`` in the models listing) with the same reply
    and the same request metrics; ``io_run_max_us = 0`` turns it off."""
    repo = tmp_path / "repo"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    proto.ir_version = 8
    (repo / "identity" / "1").mkdir(parents=True)
    onnx.save(proto, repo / "identity" / "1" / "model.onnx")
    n = 100
    for limit, on in ((1000000, True), (0, False)):  # 1 s: every run counts as short
        config = short_tmp / f"inferd-{limit}.toml"
        config.write_text(f'[models]\nio_run_max_us = {limit}\n[placement]\nmode = "first"\n')
        d = start_daemon("--models", str(repo), env={"INFERD_CONFIG": str(config)})
        with d.client() as c:
            c.load("identity")
            for i in range(n):
                sent = np.arange(4, dtype=np.float32) + i
                assert np.array_equal(c.infer("identity", {"x": sent})["y"], sent)
            row = next(m for m in c.models() if m["name"] == "identity")
            samples = families(c.call("metrics")["text"])
        assert row["requests"] == n and row["in_flight"] == 0
        assert value(samples, "inferd_requests_total", model="identity", code="OK") == n
        if on:
            assert 0 < row["io_thread_runs"] <= n - IO_RUN_AFTER, row
        else:
            assert row["io_thread_runs"] == 0, row
        d.stop()
