"""The RKNN simulator (rknn backend, out of process), for information: what one run
through a backend host costs (any out-of-process backend), how long
``inferd-convert rknn`` takes on ocr-cls, the simulated latency of one row through the
backend host against onnxruntime (1 thread) in this process, both in the same run, and
the largest difference between their results. The simulator computes on the CPU (fp16
emulated): it says nothing about the speed of a real NPU.

Needs the simulator's venv (`make venv-rknn`); without it, says so and exits 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ONNX = ROOT / "models" / "ocr-cls" / "1" / "model.onnx"
RUNS = 20


def timed(fn, runs: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def host_round_trip() -> None:
    """The pattern's own cost: one run through a backend host (this interpreter, a numpy
    backend) against the same backend called in this process."""
    from inferd.libbackends.contract import DeviceKind, LoadOptions
    from inferd.libbackends.hosted import HostedBackend, HostSpec

    target = ROOT / "tests" / "libbackends" / "plugins" / "hosted_target.py"
    spec = importlib.util.spec_from_file_location("hosted_target", target)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    onnx = Path(__file__)  # any file: the test backend does not read it
    direct = module.create_backend().load(onnx, LoadOptions())
    hosted = HostedBackend("hosted-test", DeviceKind.CPU, "0",
                           HostSpec(sys.executable, f"{target}:create_backend"))
    model = hosted.load(onnx, LoadOptions())
    for rows in (1, 1024):
        x = {"x": np.ones((rows, 4), np.float32)}
        model.run(x)
        far = statistics.median(timed(lambda: model.run(x), 200))
        near = statistics.median(timed(lambda: direct.run(x), 200))
        print(f"backend host round trip, {rows}x4 float32: {far * 1e6:.0f} µs vs "
              f"{near * 1e6:.0f} µs in process (+{(far - near) * 1e6:.0f} µs)")
    model.unload()


def main() -> int:
    host_round_trip()
    python = os.environ.get("INFERD_RKNN_PYTHON") or str(ROOT / ".venv-rknn" / "bin" / "python")
    if not Path(python).is_file():
        print(f"skipped: no RKNN simulator venv ({python}); run `make venv-rknn`")
        return 0
    import onnxruntime as ort

    from inferd.libbackends.contract import LoadOptions
    from tests.e2e.test_rknn import cls_crops
    from tests.libbackends.rknn_kit import PLUGIN

    os.environ["INFERD_RKNN_PYTHON"] = python
    tmp = Path(tempfile.mkdtemp(prefix="inferd-bench-rknn-"))
    try:
        version = tmp / "cls" / "1"
        version.mkdir(parents=True)
        shutil.copy(ONNX, version / "model.onnx")
        (tmp / "cls" / "model.toml").write_text(
            "[rknn]\ninput_shapes = {x = [1, 3, 48, 192]}\n")
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "inferd.libbackends.rknn_convert",
                               "rknn", str(tmp / "cls"), "--python", python],
                              capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        done = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"inferd-convert rknn ocr-cls: build {done['convert_s']:.1f} s, "
              f"{wall:.1f} s with the interpreter start; model.rknn {done['bytes']} bytes")
        (version / "model.rknn").unlink()

        spec = importlib.util.spec_from_file_location("rknn_plugin", PLUGIN / "__init__.py")
        assert spec and spec.loader
        plugin = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plugin)
        backend = plugin.create_backend()
        t = time.perf_counter()
        probe = backend.probe()
        print(f"probe (a host importing rknn-toolkit2): {time.perf_counter() - t:.1f} s, "
              f"{probe}")
        t = time.perf_counter()
        model = backend.load(version / "model.onnx", LoadOptions(
            options={"input_shapes": {"x": [1, 3, 48, 192]}}))
        print(f"load (host start + conversion + simulator init): "
              f"{time.perf_counter() - t:.1f} s; host RSS {model.memory_bytes() / 2**20:.0f} MiB")
        crops = cls_crops()
        x1 = crops[:1]
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        session = ort.InferenceSession(str(ONNX), so, providers=["CPUExecutionProvider"])
        name = session.get_outputs()[0].name
        model.run({"x": x1})
        session.run(None, {"x": x1})
        sim, cpu = [], []
        for _ in range(2):  # interleaved, so that both see the same machine load
            sim += timed(lambda: model.run({"x": x1}), RUNS // 2)
            cpu += timed(lambda: session.run(None, {"x": x1}), RUNS // 2)
        diff = float(np.abs(model.run({"x": crops})[name] - session.run(None, {"x": crops})[0])
                     .max())
        model.unload()
        s, c = statistics.median(sim), statistics.median(cpu)
        print(f"ocr-cls batch 1, median of {RUNS}: rknn simulator via host {s * 1e3:.1f} ms, "
              f"onnxruntime 1 thread {c * 1e3:.2f} ms: simulator/onnxruntime = {s / c:.1f}x")
        print(f"max |rknn simulator - onnxruntime| on 4 text crops: {diff:.2e} (fp16)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
