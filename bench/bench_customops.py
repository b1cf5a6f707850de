"""Custom ops and partitioned models (issue 11), all measured in this run:

1. the cost of one partition boundary per request: a small onnxruntime model run whole
   vs the same model cut into 2 and 3 onnxruntime sub-graphs (a backend that refuses
   one node type; the remainder falls back to onnxruntime), µs per cut (p50);
2. cstSigmoid on a 1M-element float32 tensor: numpy itself (the baseline), the Python
   op, the native CPU op (examples/customops, kernel chosen for this CPU, 1 thread) and
   the native OpenCL op (pocl: buffers copied in and out), p50;
3. the window split: the native CPU op on 1 thread vs 2 threads (the same 1M
   elements as 1024 rows), speed-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_note, fmt_us, median  # noqa: E402

from inferd.libbackends.contract import LoadOptions  # noqa: E402
from inferd.libbackends.customops.contract import BindContext, OpRegistry  # noqa: E402
from inferd.libbackends.customops.discovery import load_folders  # noqa: E402
from inferd.libbackends.customops.plan import load_model  # noqa: E402
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend  # noqa: E402

PY_OP = '''
import numpy as np
from inferd.libbackends.customops import get_attr


class CstSigmoid:
    op_type = "cstSigmoid"

    def shape_infer(self, node, in_shapes, in_dtypes):
        return [in_shapes[0]], [in_dtypes[0]]

    def compute(self, node, inputs):
        alpha = np.float32(get_attr(node, "alpha", 1.0))
        return [1 / (1 + np.exp(-alpha * inputs[0]))]
'''


class Refuses(OnnxRuntimeCpuBackend):
    """onnxruntime refusing some op types, to force cuts."""

    id = "refuses"

    def __init__(self, refused: set[str]) -> None:
        super().__init__()
        self.refused = refused

    def supported_nodes(self, model: Any) -> list[str]:
        return ["refused" if n.op_type in self.refused else "" for n in model.graph.node]


def timed(fn: Callable[[], Any], repeat: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times)


def boundary(tmp: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1000])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1000])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["a"]),
                           helper.make_node("Neg", ["a"], ["b"]),
                           helper.make_node("Abs", ["b"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp / "chain.onnx"
    onnx.save(m, str(path))
    ort = OnnxRuntimeCpuBackend()
    data = {"x": np.random.default_rng(0).standard_normal((1, 1000)).astype(np.float32)}
    whole = load_model(ort, path, LoadOptions(), model="whole", fallbacks=[ort])
    one = load_model(Refuses({"Abs"}), path, LoadOptions(), model="one", fallbacks=[ort])
    two = load_model(Refuses({"Neg"}), path, LoadOptions(), model="two", fallbacks=[ort])
    cuts = {"whole": 0, "one": one.describe()["plan"]["cuts"],
            "two": two.describe()["plan"]["cuts"]}
    t = {}
    for _ in range(3):  # interleaved rounds, best of each
        for name, model in (("whole", whole), ("one", one), ("two", two)):
            v = timed(lambda model=model: model.run(data), 2000)
            t[name] = min(t.get(name, v), v)
    print("1. one partition boundary per request (1x1000 float32, Relu -> Neg -> Abs, p50 "
          "of 2000, best of 3)")
    print(f"   whole model on onnxruntime ......... {fmt_us(t['whole'])}")
    for name in ("one", "two"):
        extra = (t[name] - t["whole"]) / cuts[name]
        print(f"   cut into {cuts[name] + 1} sub-graphs ({cuts[name]} cut{'s' * (cuts[name] > 1)})"
              f" .... {fmt_us(t[name])}  = {fmt_us(extra)} per cut "
              f"({t[name] / t['whole']:.2f}x the whole model)")
    for model in (whole, one, two):
        model.unload()


def build_examples(tmp: Path) -> Path:
    build = tmp / "ex"
    subprocess.run(["make", "-s", "-C", str(ROOT / "examples" / "customops"),
                    f"BUILD={build}"], check=True)
    return build


def bound(folder: Path, threads: int) -> Any:
    from onnx import helper

    reg = OpRegistry()
    load_folders([folder], reg)
    node = helper.make_node("cstSigmoid", ["x"], ["y"], alpha=0.7)
    op = reg.find(node)
    assert op is not None, f"no cstSigmoid in {folder}: {reg.view()}"
    return op.bind(node, BindContext("bench", threads))


def ops(tmp: Path, build: Path) -> None:
    py = tmp / "py"
    py.mkdir()
    (py / "sigmoid.py").write_text(PY_OP)
    x = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)
    a = np.float32(0.7)
    ref = (1 / (1 + np.exp(-a * x))).astype(np.float32)
    arms: list[tuple[str, Callable[[], Any], Any]] = [
        ("numpy (baseline)", lambda: 1 / (1 + np.exp(-a * x)), None)]
    closers = []
    for label, folder in (("Python op", py), ("native CPU op, 1 thread", build / "cpu")):
        b = bound(folder, 1)
        closers.append(b)
        arms.append((label + (f" [{b.detail}]" if b.detail else ""),
                     lambda b=b: b.compute([x]), b))
    gpu_note = ""
    try:
        b = bound(build / "gpu", 1)
        closers.append(b)
        arms.append((f"native OpenCL op [{b.detail}]", lambda b=b: b.compute([x]), b))
    except Exception as e:  # noqa: BLE001  no OpenCL here: say so, measure the rest
        gpu_note = f"   native OpenCL op: not measured ({e})"
    for label, fn, b in arms:
        if b is not None:
            err = float(np.abs(fn()[0] - ref).max())
            assert err < 1e-5, f"{label}: max error {err}"
    t: dict[str, float] = {}
    for _ in range(3):
        for label, fn, _ in arms:
            v = timed(fn, 30)
            t[label] = min(t.get(label, v), v)
    base = t[arms[0][0]]
    print("\n2. cstSigmoid on 1M float32 elements (p50 of 30, best of 3)")
    for label, _, _ in arms:
        print(f"   {label:<60} {t[label] * 1e3:7.2f} ms  {base / t[label]:5.2f}x numpy's "
              f"speed")
    if gpu_note:
        print(gpu_note)
    cpu1 = next(b for _, _, b in arms[2:3])
    cpu2 = bound(build / "cpu", 2)
    closers.append(cpu2)
    w: dict[int, float] = {}
    for _ in range(3):
        for n, b in ((1, cpu1), (2, cpu2)):
            v = timed(lambda b=b: b.compute([x]), 30)
            w[n] = min(w.get(n, v), v)
    print("\n3. window split, native CPU op, 1M elements as 1024 rows (p50 of 30, best of 3)")
    print(f"   1 thread {w[1] * 1e3:.2f} ms, 2 threads {w[2] * 1e3:.2f} ms: speed-up "
          f"{w[1] / w[2]:.2f}x (load average now {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs: a busy machine has no second core to give)")
    for b in closers:
        b.close()


def main() -> int:
    print(f"{cpu_note()}, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="inferd-bench-cst-") as d:
        tmp = Path(d)
        os.environ.setdefault("POCL_CACHE_DIR", str(tmp / "pocl"))
        os.environ.setdefault("XDG_CACHE_HOME", str(tmp / "xdg"))
        boundary(tmp)
        ops(tmp, build_examples(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
