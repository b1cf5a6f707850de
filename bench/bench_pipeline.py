"""Pipeline and graph executor benchmarks (in-process, real models):

1. a 3-stage model pipeline (pre 20 ms, infer = ocr-rec on 1x3x48x320, post 20 ms)
   streaming 60 requests: throughput vs 1 / (slowest stage), target >= 0.85;
2. a graph with two independent branches (ocr-det on 1x3x480x480 | ocr-rec on a
   1x3x48x640 line): task-parallel executor vs the same executor with one thread
   (sequential), per-request latency ratio (no target in the issue; 2 cores cap it).

Run: .venv/bin/python bench/bench_pipeline.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "daemon"))
sys.path.insert(0, str(ROOT))  # the test helpers import tests.links

from inferd.daemon.fairqueue import FairQueue  # noqa: E402
from inferd.daemon.model_settings import check_settings  # noqa: E402
from inferd.daemon.pipeline import parse_spec  # noqa: E402
from inferd.daemon.processors import ProcessorRegistry  # noqa: E402
from inferd.daemon.worker import Workers, WorkItem  # noqa: E402
from inferd.ipc.replies import LocalTicket, ReplySink  # noqa: E402
from inferd.ipc.protocol import Op, Request  # noqa: E402
from inferd.libbackends.contract import LoadOptions  # noqa: E402
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend  # noqa: E402

MODELS = ROOT / "models"
STAGE_MS = 20.0


def three_stage() -> None:
    model = OnnxRuntimeCpuBackend().load(MODELS / "ocr-rec" / "1" / "model.onnx",
                                         LoadOptions(1, 1))
    x = np.random.default_rng(0).standard_normal((1, 3, 48, 320)).astype(np.float32)
    for _ in range(3):
        model.run({"x": x})
    t0 = time.perf_counter()
    for _ in range(10):
        model.run({"x": x})
    infer_s = (time.perf_counter() - t0) / 10
    slowest = max(STAGE_MS / 1000, infer_s)
    n = 60
    done = threading.Semaphore(0)
    work = FairQueue()
    spec = parse_spec("rec3", check_settings("rec3", {
        "pre": [{"op": "sleep", "ms": STAGE_MS}], "post": [{"op": "sleep", "ms": STAGE_MS}]}),
        ProcessorRegistry())
    workers = Workers("rec3", model, work, ReplySink(), 1, spec=spec)
    workers.start()
    t0 = time.perf_counter()
    for i in range(n):
        work.put(WorkItem(Request(str(i), Op.INFER, model="rec3", inputs={"x": x}),
                          LocalTicket(str(i), lambda r: done.release())))
    for _ in range(n):
        done.acquire()
    elapsed = time.perf_counter() - t0
    workers.stop(30)
    throughput = n / elapsed
    sequential = 1 / (2 * STAGE_MS / 1000 + infer_s)
    ratio = throughput / (1 / slowest)
    print(f"3-stage pipeline: pre {STAGE_MS:.0f} ms, infer {infer_s * 1000:.1f} ms, "
          f"post {STAGE_MS:.0f} ms; {n} requests in {elapsed:.2f} s")
    print(f"  throughput {throughput:.1f}/s; 1/slowest stage {1 / slowest:.1f}/s; "
          f"sequential would be {sequential:.1f}/s")
    print(f"  ratio vs 1/slowest: {ratio:.2f} (target >= 0.85: "
          f"{'met' if ratio >= 0.85 else 'MISSED'})")


GRAPH = """
executor = "task"
task_threads = {threads}
inputs = ["image", "line"]
[outputs]
map = "det.map"
probs = "rec.probs"
[[nodes]]
name = "det"
model = "ocr-det"
inputs = {{ x = "input.image" }}
rename = {{ "sigmoid_0.tmp_0" = "map" }}
[[nodes]]
name = "rec"
model = "ocr-rec"
inputs = {{ x = "input.line" }}
rename = {{ "softmax_11.tmp_0" = "probs" }}
"""


def two_branches() -> None:
    from test_graph import Harness  # the in-process model + graph managers of the tests

    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(Path(tmp) / "repo", MODELS, ("ocr-det", "ocr-rec"))
        h.write("parallel", GRAPH.format(threads=2))
        h.write("sequential", GRAPH.format(threads=1))
        rng = np.random.default_rng(1)
        inputs = {"image": rng.standard_normal((1, 3, 480, 480)).astype(np.float32),
                  "line": rng.standard_normal((1, 3, 48, 640)).astype(np.float32)}
        try:
            times = {}
            for graph in ("sequential", "parallel"):
                for _ in range(2):
                    r = h.call(graph, inputs)
                    assert r.ok, r.error
            for graph in ("sequential", "parallel", "sequential", "parallel"):
                t0 = time.perf_counter()
                for _ in range(8):
                    reply = h.call(graph, inputs)
                    assert reply.ok, reply.error
                times.setdefault(graph, []).append((time.perf_counter() - t0) / 8)
        finally:
            h.stop()
    seq, par = min(times["sequential"]), min(times["parallel"])
    print("two independent branches (ocr-det 480x480 | ocr-rec 48x640), 8 requests each:")
    print(f"  sequential {seq * 1000:.0f} ms/request, task-parallel {par * 1000:.0f} "
          f"ms/request; speed-up {seq / par:.2f}x (no target; at most 2x on 2 cores)")


if __name__ == "__main__":
    three_stage()
    two_branches()
