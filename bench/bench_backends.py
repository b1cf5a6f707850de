"""Backend plugin benchmarks (issue 3), all measured in this run. The issue sets no
numeric target; these show what the isolation and the C ABI cost.

1. boot: loading 8 native plugins through the loader (each opened, checked and probed
   in its own child process, in parallel, then opened in process) vs opening and
   probing the same 8 in process only (no isolation);
2. one run() of the C example backend (examples/backends, x -> Relu -> Sigmoid) through
   the ctypes wrapper vs the built-in onnxruntime on the same model, for 4 and for
   1 048 576 float32 elements (p50).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_note, fmt_us, median, pct  # noqa: E402

from inferd.libbackends.contract import LoadOptions  # noqa: E402
from inferd.libbackends.loader import Loader  # noqa: E402
from inferd.libbackends.native import open_native  # noqa: E402
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend  # noqa: E402
from inferd.libbackends.registry import Registry  # noqa: E402

N_PLUGINS = 8


def build(tmp: Path) -> tuple[Path, Path, Path]:
    plugins = tmp / "backends"
    plugins.mkdir()
    src = ROOT / "tests" / "libbackends" / "plugins" / "broken_backend.c"
    inc = ROOT / "libbackends" / "include"
    for i in range(N_PLUGINS):
        subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", f"-I{inc}",
                        f'-DPLUGIN_ID="bench{i}"', "-o",
                        str(plugins / f"libbench{i}_backend.so"), str(src)], check=True)
    subprocess.run(["make", "-s", "-C", str(ROOT / "examples" / "backends"),
                    f"BUILD={tmp / 'ex'}"], check=True)
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                           helper.make_node("Sigmoid", ["h"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(tmp / "model.onnx"))
    return plugins, tmp / "ex" / "libelementwise_backend.so", tmp / "model.onnx"


def boot(plugins: Path) -> None:
    isolated, direct = [], []
    for _ in range(3):
        t = time.perf_counter()
        r = Registry()
        Loader(r, builtins=()).load([plugins])
        isolated.append(time.perf_counter() - t)
        assert len(r.available()) == N_PLUGINS, [c.reason for c in r.candidates]
        t = time.perf_counter()
        for so in sorted(plugins.iterdir()):
            open_native(so).probe()
        direct.append(time.perf_counter() - t)
    a, b = median(isolated), median(direct)
    print(f"boot, {N_PLUGINS} native plugins: loader with child probes {a * 1000:.0f} ms, "
          f"in-process only {b * 1000:.1f} ms (baseline); ratio {a / b:.0f}x; "
          f"{a / N_PLUGINS * 1000:.0f} ms per plugin (no target in issue 3)")


def _p50(model: Any, x: np.ndarray, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        model.run({"x": x})
        samples.append(time.perf_counter() - t)
    return pct(samples, 0.5)


def runs(so: Path, model_path: Path) -> None:
    # Each backend is measured on its own, the results compared afterwards.
    sizes = ((4, 2000), (1 << 20, 30))
    inputs = {n: np.random.default_rng(0).standard_normal(n).astype(np.float32)
              for n, _ in sizes}
    c_model = open_native(so).load(model_path, LoadOptions())
    c_times = {n: _p50(c_model, inputs[n], reps) for n, reps in sizes}
    ort_model = OnnxRuntimeCpuBackend().load(model_path, LoadOptions())
    ort_times = {n: _p50(ort_model, inputs[n], reps) for n, reps in sizes}
    for n, _ in sizes:
        np.testing.assert_allclose(c_model.run({"x": inputs[n]})["y"],
                                   ort_model.run({"x": inputs[n]})["y"], rtol=1e-5)
        print(f"run() p50, {n} float32: elementwise-c (C ABI) {fmt_us(c_times[n])}, "
              f"onnxruntime {fmt_us(ort_times[n])} (baseline); ratio "
              f"{c_times[n] / ort_times[n]:.2f} (no target in issue 3)")
    c_model.unload()
    ort_model.unload()


def main() -> None:
    print(f"# bench_backends ({cpu_note()})")
    tmp = Path(tempfile.mkdtemp(prefix="inferd-bb"))
    try:
        plugins, so, model = build(tmp)
        boot(plugins)
        runs(so, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
