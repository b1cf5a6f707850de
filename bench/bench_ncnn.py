"""The ncnn backend (issue 22), every figure measured in this run:

1. ncnn on the CPU (fp32, 1 thread) vs onnxruntime (1 thread), batch 1: latency on
   ocr-cls, ocr-rec and ocr-det, each engine in its own process (never both at once),
   best of 2 rounds; the ratio ncnn / onnxruntime and ncnn's largest difference from
   onnxruntime's outputs. For information: ncnn's CPU path may be the better CPU default
   on Arm boards (its NEON kernels); under qemu that is measured for correctness only
   (make deb-test-arm64), never for speed.
2. ncnn on the Vulkan device, fp32 and fp16, for information: here that is lavapipe, a
   software device 20-50x slower than onnxruntime (lavapipe gets every core).
3. the OCR graph through the daemon with the best placement that includes ncnn's CPU
   path (every model on ncnn, and ocr-det on ncnn with the rest on onnxruntime) vs
   RapidOCR's own pipeline, same images: images/s ratio and how many gave the same texts;
   the graph on onnxruntime alone, measured in the same run, beside it.

Run: .venv/bin/python bench/bench_ncnn.py [latency] [vulkan] [ocr]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from common import MODELS, DaemonProcess, cpu_note, ocr_stream, rapidocr  # noqa: E402
from tests.links import link_tree  # noqa: E402  (hard links: the daemon refuses symlinks out)

from inferd.ipc import Client  # noqa: E402

SHAPES = {"ocr-cls": (1, 3, 48, 192), "ocr-rec": (1, 3, 48, 320), "ocr-det": (1, 3, 640, 640)}
RUNS = {"ocr-cls": 200, "ocr-rec": 40, "ocr-det": 8}
VULKAN_RUNS = {"ocr-cls": 10, "ocr-rec": 3}
REC_SHAPES = {"x": [[1, 3, 48, 320], [1, 3, 48, 640]]}

ENGINE_SCRIPT = """
import json, sys, time
from pathlib import Path
import numpy as np
from inferd.libbackends.contract import DeviceKind, LoadOptions
engine, kind, precision = sys.argv[1].split(":")
shapes, runs, cache, models = json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], \\
    Path(sys.argv[5])
if engine == "ncnn":
    from inferd.libbackends.ncnn_backend import NcnnBackend
    backend = NcnnBackend()
    backend.configure({"allow_software_vulkan": True})
else:
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
    backend = OnnxRuntimeCpuBackend()
out = {}
for name, n in runs.items():
    options = {"cache_dir": cache, "precision": precision}
    if name == "ocr-rec":
        options["input_shapes"] = %s
    model = backend.load(models / name / "1" / "model.onnx",
                         LoadOptions(1, 1, options=options if engine == "ncnn" else {},
                                     kind=DeviceKind(kind)))
    x = np.random.default_rng(0).random(shapes[name], dtype=np.float32)
    for _ in range(2):
        y = model.run({"x": x})
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        model.run({"x": x})
        times.append(time.perf_counter() - t0)
    np.save(Path(cache) / f"{engine}-{kind}-{precision}-{name}.npy", next(iter(y.values())))
    out[name] = sorted(times)[len(times) // 2]
    model.unload()
print(json.dumps(out))
""" % json.dumps(REC_SHAPES)


def engine_latency(engine: str, runs: dict[str, int], cache: Path,
                   env: dict[str, str] | None = None) -> dict[str, float]:
    """Median seconds per run of each model, 1 thread, batch 1, in a process of its own
    (``engine``: ``onnxruntime:cpu:fp32``, ``ncnn:cpu:fp32``, ``ncnn:gpu:fp16``...); the
    last outputs are left in ``cache``."""
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, engine, json.dumps(SHAPES),
                           json.dumps(runs), str(cache), str(MODELS)],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"{engine} benchmark failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def max_diff(cache: Path, engine: str, name: str) -> float:
    import numpy as np

    ref = np.load(cache / f"onnxruntime-cpu-fp32-{name}.npy")
    return float(np.abs(np.load(cache / f"{engine.replace(':', '-')}-{name}.npy") - ref).max())


def latency(cache: Path) -> None:
    best: dict[str, dict[str, float]] = {"onnxruntime:cpu:fp32": {}, "ncnn:cpu:fp32": {}}
    for _ in range(2):
        for engine, found in best.items():
            for name, value in engine_latency(engine, RUNS, cache).items():
                found[name] = min(found.get(name, value), value)
    ort, ncnn = best["onnxruntime:cpu:fp32"], best["ncnn:cpu:fp32"]
    print("\n1. latency, CPU, 1 thread, batch 1, median (best of 2 rounds, engines apart):")
    for name in SHAPES:
        print(f"   {name:8s} onnxruntime {ort[name] * 1e3:7.2f} ms   ncnn fp32 "
              f"{ncnn[name] * 1e3:7.2f} ms   ncnn / onnxruntime = "
              f"{ncnn[name] / ort[name]:.2f}   max diff "
              f"{max_diff(cache, 'ncnn:cpu:fp32', name):.1e}")


def vulkan(cache: Path) -> None:
    import ncnn

    from inferd.libbackends.ncnn_backend import list_vulkan_devices

    devices = list_vulkan_devices(ncnn.__file__)
    if not devices:
        print("\n2. Vulkan: no Vulkan device here (apt-get install mesa-vulkan-drivers)")
        return
    print(f"\n2. Vulkan on {devices[0].label()}, batch 1, median (for information):")
    ort = engine_latency("onnxruntime:cpu:fp32", VULKAN_RUNS, cache)
    for precision in ("fp32", "fp16"):
        engine = f"ncnn:gpu:{precision}"
        got = engine_latency(engine, VULKAN_RUNS, cache, {"LP_NUM_THREADS": str(os.cpu_count())})
        for name, value in got.items():
            print(f"   {name:8s} {precision} {value * 1e3:8.1f} ms   / onnxruntime "
                  f"{value / ort[name]:5.1f}x   max diff {max_diff(cache, engine, name):.1e}")


def _graph_repo(tmp: Path, label: str, placement: dict[str, str]) -> Path:
    repo = tmp / f"ocr-repo-{label}"
    for name in ("ocr-det", "ocr-cls", "ocr-rec"):
        (repo / name).mkdir(parents=True)
        link_tree(MODELS / name / "1", repo / name / "1")
        extra = (MODELS / name / "model.toml").read_text() \
            if (MODELS / name / "model.toml").exists() else ""
        if name == "ocr-rec":
            extra += "[ncnn]\ninput_shapes = {x = [[1, 3, 48, 320], [1, 3, 48, 640]]}\n"
        (repo / name / "model.toml").write_text(f'backends = ["{placement[name]}"]\n{extra}')
    (repo / "ocr").mkdir()
    shutil.copy(MODELS / "ocr" / "graph.toml", repo / "ocr")
    return repo


def ocr(tmp: Path) -> None:
    from bench_ocr import images

    batch = images(30)
    rapid_s, reference = rapidocr(batch)
    plugin = tmp / "backends" / "ncnn"
    shutil.copytree(ROOT / "packaging" / "backends" / "ncnn", plugin,
                    ignore=shutil.ignore_patterns("__pycache__", "vendor"))
    os.environ["INFERD_BACKENDS_PATH"] = str(tmp / "backends")
    config = tmp / "inferd.toml"
    # no software Vulkan: ncnn's only kind is the CPU here
    config.write_text(f'[ncnn]\ncache_dir = "{tmp / "ncnn-cache"}"\n')
    arms = {"onnxruntime": {"ocr-det": "onnxruntime", "ocr-cls": "onnxruntime",
                            "ocr-rec": "onnxruntime"},
            "ncnn": {"ocr-det": "ncnn", "ocr-cls": "ncnn", "ocr-rec": "ncnn"},
            "det on ncnn": {"ocr-det": "ncnn", "ocr-cls": "onnxruntime",
                            "ocr-rec": "onnxruntime"}}
    rates, same, placed = {}, {}, {}
    for label, placement in arms.items():
        daemon = DaemonProcess("--models", str(_graph_repo(tmp, label, placement)),
                               "--preload", "ocr-det", "--preload", "ocr-cls",
                               "--preload", "ocr-rec", config=config)
        try:
            with Client(daemon.endpoint, timeout=600) as c:
                placed[label] = {m["name"]: m["backend"] for m in c.models()
                                 if m.get("backend")}
                for im in batch[:2]:
                    c.infer("ocr", {"image": im})
                seconds, texts = ocr_stream(c, batch)
                rates[label] = len(batch) / seconds
                same[label] = sum(a == b for a, b in zip(texts, reference))
        finally:
            daemon.stop()
    rapid = len(batch) / rapid_s
    print(f"\n3. OCR graph, {len(batch)} images, 1 thread per model, vs RapidOCR sequential "
          f"{rapid:.2f} img/s:")
    for label in arms:
        print(f"   {label:12s} {placed[label]}: {rates[label]:.2f} img/s, ratio to RapidOCR "
              f"{rates[label] / rapid:.2f}, same texts {same[label]}/{len(batch)}")
    bestn = max(("ncnn", "det on ncnn"), key=lambda k: rates[k])
    print(f"   best placement with ncnn: {bestn}, {rates[bestn] / rates['onnxruntime']:.2f}x "
          f"the graph on onnxruntime alone")


if __name__ == "__main__":
    print(f"machine: {cpu_note()}, load average {os.getloadavg()[0]:.1f} at the start")
    tmp = Path(tempfile.mkdtemp(prefix="inferd-b", dir="/tmp"))
    parts = set(sys.argv[1:]) or {"latency", "vulkan", "ocr"}
    try:
        if "latency" in parts:
            latency(tmp)
        if "vulkan" in parts:
            vulkan(tmp)
        if "ocr" in parts:
            ocr(tmp)
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
