"""Memory that stays inside the budget (issue 12, item 10), against RapidOCR in the same
run, each engine in its own process, peak RSS of the whole process (VmHWM from /proc):

0. the floor: ocr-det alone on the detector input of these images (1x3x736x2048, as
   RapidOCR sizes it), each engine in a bare process (python, numpy, the engine):
   what no daemon serving this graph can go under;
1. the OCR graph on 6 generated 1000x360 four-line images: the daemon's peak RSS vs
   RapidOCR 1.4.4's (its defaults, in a process of its own), target <= 0.7x, at
   images/s >= 1.3x RapidOCR's; once per arena policy (docs/cache.md), the shipped
   defaults first, then with every model placed on OpenVINO (the detector with
   ``[openvino] static_shapes = 2``);
2. the cache's figure for the loaded models (``inferctl status``: cache used) vs what
   they really add to the process (peak RSS while serving minus the idle daemon's
   RSS), target within 25 %;
3. with ``cache.max_memory = 256MiB``, the four demo models and then the graph served in
   turn: the daemon's peak RSS vs budget + idle RSS + 10 % (and the same at 320MiB, a
   budget that the detector's working memory on these images fits).

Every figure is printed, met or not; nothing fails on a timing.
Run: .venv/bin/python bench/bench_memory.py [policies]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import DaemonProcess  # noqa: E402
from inferd.ipc import Client  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.links import link_tree  # noqa: E402  (hard links: the daemon refuses symlinks out)

MODELS = ROOT / "models"
FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FONTS = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf"]
WORDS = ("edge daemon model graph pipeline thread batch tensor socket kernel device "
         "invoice total amount serial number camera sensor frame label order").split()
N_IMAGES = 6
MiB = 2**20

# name -> inferd.toml text; the shipped defaults first
POLICIES = {
    "shipped defaults (shared arena, shrinkage, mmap threshold 4MiB)": "",
    "onnxruntime's defaults (own arena per model, powers of two, kept)":
        '[onnxruntime]\narena_extend_strategy = "next_power_of_two"\n'
        'arena_shrinkage = false\n[cache]\nmalloc_mmap_threshold = "auto"\n',
    "own arena per model + shrinkage":
        '[onnxruntime]\narena_extend_strategy = "next_power_of_two"\n',
    "arena off": "[onnxruntime]\nmemory_arena = false\n",
    "shared arena + shrinkage, glibc's sliding mmap threshold":
        '[cache]\nmalloc_mmap_threshold = "auto"\n',
}


def images(n: int = N_IMAGES) -> list[np.ndarray]:
    """n 1000x360 white images with four lines of black text each (uint8 BGR)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(12)
    out = []
    for i in range(n):
        font = ImageFont.truetype(str(FONT_DIR / FONTS[i % len(FONTS)]), 34)
        img = Image.new("RGB", (1000, 360), "white")
        draw = ImageDraw.Draw(img)
        for line in range(4):
            text = " ".join(rng.choice(WORDS, 3)) + f" {rng.integers(10, 9999)}"
            draw.text((30, 20 + line * 85), text, font=font, fill="black")
        out.append(np.array(img)[:, :, ::-1].copy())
    return out


def peak_rss(pid: int | str = "self") -> tuple[int, int]:
    """(current, peak) resident bytes of a process."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return rss, hwm


class PeakSampler:
    """The peak RSS of another process: its VmHWM, and RSS polled every 5 ms (the daemon
    resets its own VmHWM while it measures a model's working memory)."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-peak", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        page = 4096
        path = f"/proc/{self.pid}/statm"
        while not self._stop.wait(0.005):
            try:
                with open(path) as f:
                    self.peak = max(self.peak, int(f.read().split()[1]) * page)
            except (OSError, ValueError, IndexError):
                return

    def read(self) -> int:
        return max(self.peak, peak_rss(self.pid)[1])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


RAPID_CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
from bench_memory import images, peak_rss
from common import rapidocr
elapsed, texts = rapidocr(images())
print(json.dumps({{"seconds": elapsed, "peak": peak_rss()[1], "texts": texts}}))
"""


FLOOR_CHILD = """
import json, sys, time
import numpy as np
engine = sys.argv[1]
def rss():
    out = {{}}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]
x = np.random.default_rng(0).random((1, 3, 736, 2048), dtype=np.float32)
path = {model!r}
if engine.startswith("onnxruntime"):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = engine == "onnxruntime"
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    run = lambda: s.run(None, {{"x": x}})
else:
    import openvino as ov
    core = ov.Core()
    m = core.read_model(path)
    if engine.endswith("static"):
        m.reshape({{"x": list(x.shape)}})
    c = core.compile_model(m, "CPU", {{"INFERENCE_PRECISION_HINT": "f32",
                                     "ENABLE_CPU_PINNING": False}})
    r = c.create_infer_request()
    run = lambda: r.infer({{"x": x}})
run()
run()
print(json.dumps(rss()[1]))
"""
FLOOR_ENGINES = {"onnxruntime": "onnxruntime, arena on (RapidOCR's configuration)",
                 "onnxruntime-noarena": "onnxruntime, arena off",
                 "openvino": "OpenVINO, dynamic shapes",
                 "openvino-static": "OpenVINO, static shape"}


def floor() -> dict[str, int]:
    """Peak RSS of a bare process running ocr-det on this detector input, per engine."""
    out = {}
    for engine in FLOOR_ENGINES:
        code = FLOOR_CHILD.format(model=str(MODELS / "ocr-det" / "1" / "model.onnx"))
        proc = subprocess.run([sys.executable, "-c", code, engine], capture_output=True,
                              text=True, cwd=ROOT)
        if proc.returncode == 0:
            out[engine] = int(proc.stdout.strip().splitlines()[-1])
    return out


def openvino_repo(tmp: Path) -> Path:
    """The demo repository with every OCR model placed on OpenVINO first, the detector
    with static shapes (one camera, one size)."""
    repo = tmp / "repo-openvino"
    for name in ("ocr-det", "ocr-cls", "ocr-rec", "vad"):
        (repo / name).mkdir(parents=True)
        link_tree(MODELS / name / "1", repo / name / "1")
        toml = (MODELS / name / "model.toml").read_text() \
            if (MODELS / name / "model.toml").exists() else ""
        if name != "vad":
            toml = 'backends = ["openvino", "cpu"]\n' + toml
        if name == "ocr-det":
            toml += "[openvino]\nstatic_shapes = 2\n"
        (repo / name / "model.toml").write_text(toml)
    (repo / "ocr").mkdir()
    shutil.copy(MODELS / "ocr" / "graph.toml", repo / "ocr")
    return repo


def rapidocr() -> dict[str, Any]:
    """RapidOCR in a process of its own: images/s and that process's peak RSS."""
    out = subprocess.run([sys.executable, "-c", RAPID_CHILD.format(bench=str(ROOT / "bench"))],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def inferd_graph(tmp: Path, name: str, toml: str, batch: list[np.ndarray],
                 models: Path = MODELS) -> dict[str, Any]:
    config = tmp / f"policy-{abs(hash(name))}.toml"
    config.write_text('[metrics]\ntextfile = ""\n' + toml)
    daemon = DaemonProcess("--models", str(models), config=config)
    sampler = PeakSampler(daemon.proc.pid)
    try:
        idle = daemon.rss()
        with Client(daemon.endpoint, timeout=600) as c:
            for m in ("ocr-det", "ocr-cls", "ocr-rec"):
                c.load(m)
            c.infer("ocr", {"image": batch[0]})  # warm: first run of each shape class
            t0 = time.perf_counter()
            pending = [c.submit("infer", "ocr", inputs={"image": im}) for im in batch]
            texts = [p.result()["texts"].tolist() for p in pending]
            elapsed = time.perf_counter() - t0
            cache = c.status()["cache"]["used_bytes"]
        rss, peak = peak_rss(daemon.proc.pid)[0], sampler.read()
    finally:
        sampler.stop()
        daemon.stop()
    return {"seconds": elapsed, "peak": peak, "rss_after": rss, "idle": idle,
            "cache": cache, "texts": texts}


DEMO_INPUTS = {
    "ocr-cls": {"x": np.zeros((6, 3, 48, 192), np.float32)},
    "ocr-det": {"x": np.zeros((1, 3, 736, 736), np.float32)},
    "ocr-rec": {"x": np.zeros((6, 3, 48, 320), np.float32)},
    "vad": {"input": np.zeros((1, 512), np.float32),
            "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000, np.int64)},
}


def budget_run(tmp: Path, batch: list[np.ndarray], mib: int = 256) -> None:
    config = tmp / f"budget-{mib}.toml"
    config.write_text(f'[metrics]\ntextfile = ""\n[cache]\nmax_memory = "{mib}MiB"\n')
    daemon = DaemonProcess("--models", str(MODELS), config=config)
    sampler = PeakSampler(daemon.proc.pid)
    budget = mib * MiB
    steps = []
    try:
        idle = daemon.rss()
        with Client(daemon.endpoint, timeout=600) as c:
            for name, inputs in DEMO_INPUTS.items():
                for _ in range(3):
                    c.infer(name, inputs)
                steps.append((name, sampler.read(), c.status()["cache"]))
            errors = 0
            for im in batch:
                try:
                    c.infer("ocr", {"image": im})
                except Exception as e:  # report, do not stop: the figure is the point
                    errors += 1
                    print(f"  graph request failed: {e}")
            steps.append(("ocr graph", sampler.read(), c.status()["cache"]))
            models = {m["name"]: m for m in c.models()}
    finally:
        sampler.stop()
        daemon.stop()
    limit = (budget + idle) * 1.1
    print(f"budget {mib} MiB, idle daemon {idle / MiB:.0f} MiB, limit (budget + idle) x 1.1 = "
          f"{limit / MiB:.0f} MiB")
    for name, peak, cache in steps:
        print(f"  after {name:9s}: peak RSS {peak / MiB:6.0f} MiB, cache says "
              f"{cache['used_bytes'] / MiB:6.1f} MiB")
    peak = max(p for _, p, _ in steps)
    print(f"  peak {peak / MiB:.0f} MiB vs limit {limit / MiB:.0f} MiB: "
          f"{'MET' if peak <= limit else 'MISSED'}; graph errors: {errors}/{len(batch)}")
    for m in models.values():
        if m.get("memory_bytes"):
            print(f"    {m['name']:8s} counts {m['memory_bytes'] / MiB:6.1f} MiB "
                  f"(working {(m.get('memory_working_bytes') or 0) / MiB:.1f} MiB)")


def main() -> None:
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    batch = images()
    tmp = Path(tempfile.mkdtemp(prefix="inferd-b", dir="/tmp"))
    try:
        rapid = rapidocr()
        rapid_rate = N_IMAGES / rapid["seconds"]
        print(f"RapidOCR 1.4.4 (own process, its defaults): {rapid_rate:.2f} img/s, "
              f"peak RSS {rapid['peak'] / MiB:.0f} MiB; 0.7x of it: "
              f"{0.7 * rapid['peak'] / MiB:.0f} MiB")
        print("the floor: ocr-det alone on 1x3x736x2048 in a bare process (python, numpy, "
              "the engine), peak RSS:")
        for engine, peak in floor().items():
            print(f"  {FLOOR_ENGINES[engine]:45s} {peak / MiB:5.0f} MiB "
                  f"({peak / rapid['peak']:.2f}x RapidOCR)")
        arms = [(name, toml, MODELS) for name, toml in POLICIES.items()]
        arms.append(("every OCR model on OpenVINO, the detector with static shapes", "",
                     openvino_repo(tmp)))
        for name, toml, models in arms:
            if only and not any(o in name for o in only):
                continue
            r = inferd_graph(tmp, name, toml, batch, models)
            rate = N_IMAGES / r["seconds"]
            mem, speed = r["peak"] / rapid["peak"], rate / rapid_rate
            added = r["peak"] - r["idle"]
            same = sum(a == b for a, b in zip(r["texts"], rapid["texts"]))
            print(f"inferd, {name}:")
            print(f"  {rate:.2f} img/s ({speed:.2f}x RapidOCR, target >= 1.3: "
                  f"{'MET' if speed >= 1.3 else 'MISSED'}); peak RSS {r['peak'] / MiB:.0f} "
                  f"MiB ({mem:.2f}x RapidOCR, target <= 0.7: "
                  f"{'MET' if mem <= 0.7 else 'MISSED'}); same texts {same}/{N_IMAGES}")
            off = r["cache"] / added - 1 if added > 0 else float("inf")
            print(f"  idle {r['idle'] / MiB:.0f} MiB, models add {added / MiB:.0f} MiB at "
                  f"peak ({(r['rss_after'] - r['idle']) / MiB:.0f} MiB after); cache "
                  f"figure {r['cache'] / MiB:.1f} MiB ({off:+.0%}, target within 25 %: "
                  f"{'MET' if abs(off) <= 0.25 else 'MISSED'})")
        if "--no-budget" not in sys.argv:
            budget_run(tmp, batch)  # the target
            budget_run(tmp, batch, 320)  # a budget the detector's working memory fits
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
