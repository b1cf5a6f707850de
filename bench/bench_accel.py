"""Accelerator backends (issue 10), every figure measured in this run:

1. OpenVINO vs onnxruntime, 1 thread, batch 1: latency on ocr-cls, ocr-rec, ocr-det
   (each engine in its own process, never both at once; best of 2 rounds);
2. batching on OpenVINO: cost per row at batch 1, 8 and 16 on both engines (in process,
   1 thread), then ocr-cls through the daemon on OpenVINO from 16 client processes with
   dynamic batching off and on;
3. target: the OCR graph vs RapidOCR's own pipeline, same images, images/s ratio (target
   >= 2.5) and how many gave the same texts, for hand-made placements (every model on
   onnxruntime; every model on OpenVINO, the faster engine in 1; the same with the
   detector, the pipeline's slowest stage, on every core) and the demo models as
   shipped (measured placement, issue 24: target >= 0.95x the best hand-made one);
4. target: ocr-cls from 16 client processes through the daemon, batching on, OpenVINO,
   vs an application calling onnxruntime itself at batch 1 (1 thread), requests/s ratio
   (target >= 1.5); the same baseline with every core given to onnxruntime, for honesty.

On the GPU machine (bench/device_check.sh) the same script adds onnxruntime-gpu to 1
when its probe finds a usable GPU. Run: .venv/bin/python bench/bench_accel.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (  # noqa: E402
    MODELS, DaemonProcess, cls_client, cpu_note, ocr_stream, placements, rapidocr,
    run_client_processes,
    settle_placement, toml_with, verdict,
)

from inferd.ipc import Client  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.links import link_tree  # noqa: E402  (hard links: the daemon refuses symlinks out)

SHAPES = {"ocr-cls": (1, 3, 48, 192), "ocr-rec": (1, 3, 48, 320), "ocr-det": (1, 3, 640, 640)}
RUNS = {"ocr-cls": 200, "ocr-rec": 40, "ocr-det": 8}

ENGINE_SCRIPT = """
import json, sys, time
from pathlib import Path
import numpy as np
from inferd.libbackends.contract import LoadOptions
engine = sys.argv[1]
shapes, runs, batches = (json.loads(a) for a in sys.argv[2:5])
if engine == "openvino":
    from inferd.libbackends.openvino_backend import OpenVinoBackend as B
elif engine == "onnxruntime-gpu":
    from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend as B
else:
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend as B
backend = B()
out = {}
for name, shape in shapes.items():
    model = backend.load(Path(sys.argv[5]) / name / "1" / "model.onnx", LoadOptions(1, 1))
    for batch in ([1] + (batches if name == "ocr-cls" else [])):
        x = np.random.default_rng(0).random((batch, *shape[1:]), dtype=np.float32)
        for _ in range(3):
            model.run({"x": x})
        times = []
        for _ in range(max(3, runs[name] // batch)):
            t0 = time.perf_counter()
            model.run({"x": x})
            times.append(time.perf_counter() - t0)
        out[f"{name} b{batch}"] = sorted(times)[len(times) // 2]
    model.unload()
print(json.dumps(out))
"""


def engine_latency(engine: str, batches: list[int]) -> dict[str, float]:
    """Median seconds per run of each model (and each batch of ocr-cls), 1 thread, in a
    process of its own."""
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, engine, json.dumps(SHAPES),
                           json.dumps(RUNS), json.dumps(batches), str(MODELS)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} benchmark failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def gpu_usable() -> bool:
    try:
        from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend

        return OnnxRuntimeGpuBackend().probe().available
    except Exception:  # noqa: BLE001  no onnxruntime at all: no GPU arm
        return False


def latency() -> None:
    engines = ["onnxruntime", "openvino"] + (["onnxruntime-gpu"] if gpu_usable() else [])
    best: dict[str, dict[str, float]] = {e: {} for e in engines}
    for _ in range(2):
        for e in engines:
            for key, value in engine_latency(e, [8, 16]).items():
                best[e][key] = min(best[e].get(key, value), value)
    ort, ov = best["onnxruntime"], best["openvino"]
    print("\n1. latency, 1 thread, batch 1, median (best of 2 rounds, engines apart):")
    for name in SHAPES:
        key = f"{name} b1"
        line = (f"   {name:8s} onnxruntime {ort[key] * 1e3:7.2f} ms   openvino "
                f"{ov[key] * 1e3:7.2f} ms   onnxruntime / openvino = {ort[key] / ov[key]:.2f}")
        if "onnxruntime-gpu" in best:
            line += f"   onnxruntime-gpu {best['onnxruntime-gpu'][key] * 1e3:7.2f} ms"
        print(line)
    print("\n2. batching: cost per row of ocr-cls (1 thread, in process)")
    for b in (1, 8, 16):
        key = f"ocr-cls b{b}"
        print(f"   batch {b:2d}: onnxruntime {ort[key] / b * 1e3:6.3f} ms/row   openvino "
              f"{ov[key] / b * 1e3:6.3f} ms/row")


def cls_daemon(tmp: Path, toml: str, clients: int = 16, per_client: int = 150,
               config: str = "") -> float:
    """Requests/s of ocr-cls through a daemon whose model.toml is ``toml`` and whose
    inferd.toml is ``config``."""
    repo = Path(tempfile.mkdtemp(prefix="inferd-r", dir=tmp))
    (repo / "ocr-cls").mkdir()
    link_tree(MODELS / "ocr-cls" / "1", repo / "ocr-cls" / "1")
    (repo / "ocr-cls" / "model.toml").write_text(toml)
    (repo / "inferd.toml").write_text(config)
    daemon = DaemonProcess("--models", str(repo), "--preload", "ocr-cls",
                           config=repo / "inferd.toml")
    x = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
    try:
        elapsed = run_client_processes(cls_client, [(daemon.endpoint, x, per_client)] *
                                       clients)
    finally:
        daemon.stop()
    return clients * per_client / elapsed


def cls_inprocess(threads: int, n: int = 960) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(str(MODELS / "ocr-cls" / "1" / "model.onnx"), so,
                             providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
    for _ in range(10):
        s.run(None, {"x": x})
    t0 = time.perf_counter()
    for _ in range(n):
        s.run(None, {"x": x})
    return n / (time.perf_counter() - t0)


def batching(tmp: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    ov = 'backends = ["openvino"]\n'
    static = "[openvino]\nstatic_shapes = 16\n"
    pinned = ("cpu_affinity = [1]\n", "[server]\ncpu_affinity = [0]\n")
    arms: dict[str, tuple[str, str]] = {
        "off": (ov, ""),
        "on (max_batch 16, delay 0)": (ov + "max_batch = 16\n", ""),
        "on (max_batch 16, delay 2 ms)": (ov + "max_batch = 16\nmax_delay_ms = 2.0\n", ""),
        f"on, {cores} threads": (ov + f"max_batch = 16\n[openvino]\nthreads = {cores}\n", ""),
        "off, static shapes": (ov + static, ""),
        "on (max_batch 16), static shapes": (ov + "max_batch = 16\n" + static, ""),
    }
    if cores >= 2:
        arms["off, static shapes, pinned"] = (ov + pinned[0] + static, pinned[1])
    rates: dict[str, float] = {}
    base1 = baseall = 0.0
    for _ in range(3):  # alternate the arms; best of three rounds each (a noisy machine)
        base1 = max(base1, cls_inprocess(1))
        baseall = max(baseall, cls_inprocess(cores))
        for arm, (toml, config) in arms.items():
            rates[arm] = max(rates.get(arm, 0.0), cls_daemon(tmp, toml, config=config))
    print("\n   ocr-cls through the daemon on OpenVINO, 16 client processes x 150 requests "
          "(best of 3; static shapes: [openvino] static_shapes = 16; pinned: the model's "
          "thread on core 1, the daemon's I/O thread on core 0, the clients anywhere):")
    for arm, rate in rates.items():
        print(f"   batching {arm:34s} {rate:7.0f} req/s   x{rate / rates['off']:.2f} vs off")
    best_arm = max(rates, key=lambda a: rates[a])
    print(f"\n4. ocr-cls, 16 client processes through the daemon (OpenVINO, batching "
          f"{best_arm}) {rates[best_arm]:.0f} req/s vs in-process onnxruntime batch 1, "
          f"1 thread {base1:.0f} req/s")
    print(f"   {verdict(rates[best_arm] / base1, 1.5, higher_is_better=True)}")
    print(f"   (in-process onnxruntime batch 1 with {cores} threads: {baseall:.0f} req/s; "
          f"ratio {rates[best_arm] / baseall:.2f})")


def ocr_arm(tmp: Path, label: str, backend: str | None, det_threads: int,
            batch: list[np.ndarray], state: Path) -> tuple[float, list[list[str]], str, str]:
    """One placement of the OCR graph, in a daemon of its own: ``backend`` for every
    model (a hand-made placement: that backend alone, ``det_threads`` for the
    detector when > 0), or None for the demo models as shipped (measured placement,
    its decisions kept in ``state`` across rounds). Returns images/s over ``batch``
    streamed, the texts, where each model ran, and what measuring cost (shipped)."""
    repo = tmp / f"ocr-repo-{len(list(tmp.iterdir()))}"
    for name in ("ocr-det", "ocr-cls", "ocr-rec"):
        (repo / name).mkdir(parents=True)
        link_tree(MODELS / name / "1", repo / name / "1")
        shipped = MODELS / name / "model.toml"
        extra = shipped.read_text() if shipped.exists() else ""
        if backend is not None:
            extra = f'backends = ["{backend}"]\n{extra}'
            if name == "ocr-det" and det_threads:
                extra = toml_with(extra, backend, f"threads = {det_threads}")
        (repo / name / "model.toml").write_text(extra)
    (repo / "ocr").mkdir()
    shutil.copy(MODELS / "ocr" / "graph.toml", repo / "ocr")
    config = tmp / f"{repo.name}.toml"
    config.write_text(f'[placement]\ndirectory = "{state}"\n')
    daemon = DaemonProcess("--models", str(repo), "--preload", "ocr-det",
                           "--preload", "ocr-cls", "--preload", "ocr-rec", config=config)
    try:
        settle_s, _ = settle_placement(
            daemon.endpoint, lambda c: [c.infer("ocr", {"image": im}) for im in batch[:2]])
        placed = placements(daemon.endpoint)
        with Client(daemon.endpoint, timeout=300) as c:
            seconds, texts = ocr_stream(c, batch)
            rate = len(batch) / seconds
    finally:
        daemon.stop()
    cost = f"placement settled {settle_s:.0f} s after its first requests"
    return rate, texts, ", ".join(f"{k} {v}" for k, v in sorted(placed.items())), cost


def ocr(tmp: Path, rounds: int = 2) -> None:
    """Target 3 (>= 2.5x RapidOCR) and issue 24's: the shipped configuration >= 0.95x
    the best hand-made placement, all measured in this run, arms in turns."""
    from bench_ocr import images

    batch = images(30)
    rapid_s, reference = rapidocr(batch)
    cores = len(os.sched_getaffinity(0))
    arms: dict[str, tuple[str | None, int]] = {
        "every model on onnxruntime (the placement before issue 10)": ("onnxruntime", 0),
        "every model on OpenVINO, 1 thread each": ("openvino", 0),
        f"every model on OpenVINO, the detector on {cores} threads": ("openvino", cores),
        "as shipped (measured placement)": (None, 0),
    }
    state = tmp / "placement-state"
    best: dict[str, float] = {}
    seen: dict[str, tuple[list[list[str]], str, str]] = {}
    for r in range(rounds):  # the arms in turns; the best round of each
        for label, (backend, threads) in arms.items():
            rate, texts, placed, cost = ocr_arm(tmp, label, backend, threads, batch, state)
            if rate > best.get(label, 0.0):
                best[label] = rate
            if label not in seen or r == 0:
                seen[label] = (texts, placed, cost)
    rapid = len(batch) / rapid_s
    print(f"\n3. OCR graph, {len(batch)} images streamed, vs RapidOCR sequential "
          f"{rapid:.2f} img/s (best of {rounds} rounds per arm, arms in turns):")
    for label, rate in best.items():
        texts, placed, cost = seen[label]
        same = sum(a == b for a, b in zip(texts, reference))
        print(f"   {label:58s} {rate:5.2f} img/s  x{rate / rapid:.2f} RapidOCR, same "
              f"texts {same}/{len(batch)}; {placed}"
              + (f" ({cost} in round 1)" if "shipped" in label else ""))
    shipped = best["as shipped (measured placement)"]
    hand = {k: v for k, v in best.items() if "shipped" not in k}
    top = max(hand, key=lambda k: hand[k])
    print(f"   the shipped configuration: {verdict(shipped / rapid, 2.5, higher_is_better=True)}"
          f" (vs RapidOCR)")
    print(f"   the shipped configuration vs the best hand-made placement ({top}): "
          f"{verdict(shipped / hand[top], 0.95, higher_is_better=True)}")


if __name__ == "__main__":
    print(f"machine: {cpu_note()}, load average {os.getloadavg()[0]:.1f} at the start")
    tmp = Path(tempfile.mkdtemp(prefix="inferd-b", dir="/tmp"))
    parts = set(sys.argv[1:]) or {"latency", "ocr", "batching"}
    try:
        if "latency" in parts:
            latency()
        if "ocr" in parts:
            ocr(tmp)
        if "batching" in parts:
            batching(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
