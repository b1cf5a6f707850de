"""Model cache: first-request latency on a cold model vs a warm one, and what each demo
model costs in memory against its file size.

A real daemon serves the demo models (symlinked into a temporary repository, budget
unlimited). Per model, ``ROUNDS`` times: unload it, time the first request (load +
run), then time ``WARM`` more requests; medians are printed. The baseline for the cold
path is bare onnxruntime in this process (session creation + first run); for memory it
is the model file size. The issue sets no numeric target: the ratios are for reading.
Run alone: ``.venv/bin/python bench/bench_cache.py``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import DaemonProcess  # noqa: E402
from inferd.ipc import Client  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.links import link_tree  # noqa: E402  (hard links: the daemon refuses symlinks out)

ROUNDS = 5
WARM = 20
INPUTS = {
    "ocr-cls": {"x": np.random.rand(1, 3, 48, 192).astype(np.float32)},
    "ocr-det": {"x": np.random.rand(1, 3, 320, 320).astype(np.float32)},
    "ocr-rec": {"x": np.random.rand(1, 3, 48, 320).astype(np.float32)},
    "vad": {"input": np.random.rand(1, 512).astype(np.float32),
            "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000, np.int64)},
}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cold_and_warm(reset: Callable[[], object], first: Callable[[], object],
                  again: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of ``first()`` after ``reset()``, and of ``again()`` after it."""
    colds, warms = [], []
    for _ in range(ROUNDS):
        reset()
        colds.append(timed(first))
        warms += [timed(again) for _ in range(WARM)]
    return statistics.median(colds), statistics.median(warms)


def bare_onnxruntime(path: Path, inputs: dict[str, np.ndarray]) -> tuple[float, float]:
    """(session creation + first run, warm run) with onnxruntime alone."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    session: list[object] = []

    def first() -> None:
        session[:] = [ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])]
        session[0].run(None, inputs)  # type: ignore[attr-defined]

    return cold_and_warm(session.clear, first,
                         lambda: session[0].run(None, inputs))  # type: ignore[attr-defined]


def main() -> int:
    models = ROOT / "models"
    work = Path(tempfile.mkdtemp(prefix="inferd-b", dir="/tmp"))
    repo = work / "repo"
    for name in INPUTS:
        link_tree(models / name / "1", repo / name / "1")
    (work / "inferd.toml").write_text('[cache]\nmax_memory = "unlimited"\n')
    daemon = DaemonProcess("--models", str(repo), config=work / "inferd.toml")
    endpoint = daemon.endpoint
    try:
        # A first load pays for onnxruntime's one-off set-up; keep that out of the rows.
        with Client(endpoint, timeout=60) as c:
            c.infer("ocr-cls", INPUTS["ocr-cls"])
            c.unload("ocr-cls")
        print(f"first request on a cold model (load + run) vs a warm one, median of "
              f"{ROUNDS} cold / {ROUNDS * WARM} warm; baseline: bare onnxruntime "
              f"(session + first run) in the bench process")
        print(f"{'model':8} {'cold':>11} {'warm':>11} {'cold/warm':>9}   "
              f"{'bare cold':>11} {'bare warm':>11} {'cold/bare':>9}")
        memory = {}
        with Client(endpoint, timeout=60) as c:
            def measured(name: str) -> None:
                row = next(m for m in c.models() if m["name"] == name)
                if row["memory_bytes"]:
                    memory.setdefault(name, []).append(row["memory_bytes"])

            for name, inputs in INPUTS.items():
                def reset(name: str = name) -> None:
                    measured(name)  # what the previous round's load cost
                    c.unload(name)

                def infer(name: str = name, inputs: dict = inputs) -> None:
                    c.infer(name, inputs)

                cold, warm = cold_and_warm(reset, infer, infer)
                measured(name)
                path = repo / name / "1" / "model.onnx"
                bare_cold, bare_warm = bare_onnxruntime(path, inputs)
                print(f"{name:8} {ms(cold)} {ms(warm)} {cold / warm:8.1f}x   "
                      f"{ms(bare_cold)} {ms(bare_warm)} {cold / bare_cold:8.2f}x")
        print("\nmemory each model costs (measured by the daemon at load: RSS delta, "
              "median of the rounds) vs its file size")
        print(f"{'model':8} {'file':>10} {'measured':>10} {'min..max':>17} {'ratio':>6}")
        for name, values in memory.items():
            size = (repo / name / "1" / "model.onnx").resolve().stat().st_size
            med = statistics.median(values)
            print(f"{name:8} {size / 2**20:7.1f} MiB {med / 2**20:7.1f} MiB "
                  f"{min(values) / 2**20:6.1f}..{max(values) / 2**20:5.1f} MiB "
                  f"{med / size:5.1f}x")
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
