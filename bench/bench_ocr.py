"""OCR and dynamic batching through a real daemon:

1. the OCR graph: 50 generated images streamed through the daemon (all submitted at
   once, answered as the pipeline finishes them) vs RapidOCR 1.4.4's own sequential
   pipeline in-process on the same images (its defaults: onnxruntime with all cores);
   images/s ratio, target >= 1.3, and how many images gave the same texts;
2. dynamic batching on vs off for ocr-cls with 16 concurrent clients (each its own
   connection, one 1x3x48x192 request at a time): requests/s ratio, target >= 1.5.

The daemon runs with its defaults (onnxruntime intra-op threads = 1 per model). The
two engines never run at the same time. Run: .venv/bin/python bench/bench_ocr.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "bench"))

from common import DaemonProcess, cls_client, rapidocr, run_client_processes  # noqa: E402
from inferd.ipc import Client  # noqa: E402
from ocr_images import render  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.links import link_tree  # noqa: E402  (hard links: the daemon refuses symlinks out)

MODELS = ROOT / "models"
FONTS = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf"]
WORDS = ("edge daemon model graph pipeline thread batch tensor socket kernel device "
         "invoice total amount serial number camera sensor frame label order").split()


def images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(2026)
    out = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS, 3)) + f" {rng.integers(10, 9999)}"
                 for _ in range(1 + i % 3)]
        out.append(render(lines, FONTS[i % len(FONTS)], int(rng.integers(22, 40)),
                          rotation=[0, 0, 0, 3, 180][i % 5]))
    return out


def ocr(tmp: Path) -> None:
    batch = images(50)
    rapid_s, reference = rapidocr(batch)
    # a second baseline, for honesty: RapidOCR with onnxruntime on one thread (its
    # default uses every core, which spins badly on a busy 2-vCPU machine); first 10
    # images only, to keep the benchmark short
    rapid1_s, _ = rapidocr(batch[:10], intra_op_num_threads=1, inter_op_num_threads=1)
    rapid1_rate = 10 / rapid1_s

    daemon = DaemonProcess("--models", str(MODELS), "--preload", "ocr-det",
                           "--preload", "ocr-cls", "--preload", "ocr-rec")
    try:
        with Client(daemon.endpoint, timeout=300) as c:
            for im in batch[:2]:
                c.infer("ocr", {"image": im})
            t0 = time.perf_counter()
            pending = [c.submit("infer", "ocr", inputs={"image": im}) for im in batch]
            texts = [p.result()["texts"].tolist() for p in pending]
            inferd_s = time.perf_counter() - t0
    finally:
        daemon.stop()
    same = sum(a == b for a, b in zip(texts, reference))
    ratio = rapid_s / inferd_s
    print(f"OCR, {len(batch)} images: RapidOCR sequential {len(batch) / rapid_s:.2f} img/s, "
          f"inferd graph streamed {len(batch) / inferd_s:.2f} img/s")
    print(f"  ratio {ratio:.2f} (target >= 1.3: {'met' if ratio >= 1.3 else 'MISSED'}); "
          f"same texts on {same}/{len(batch)} images")
    print(f"  RapidOCR with 1 onnxruntime thread: {rapid1_rate:.2f} img/s (10 images); "
          f"inferd / that = {len(batch) / inferd_s / rapid1_rate:.2f}")
    for i, (a, b) in enumerate(zip(texts, reference)):
        if a != b:
            print(f"  image {i}: inferd {a} vs RapidOCR {b}")


def batching(tmp: Path) -> None:
    """Batching on vs off, at two thread budgets, the same budget in both arms.

    With one onnxruntime thread this model's cost per row hardly falls with the batch
    size on a CPU, so batching cannot pay; with as many threads as cores, a batch gives
    the threads enough work to share while one image does not (measured in process:
    0.88 ms/row at batch 1, 0.45 ms/row at batch 16, 2 threads).
    """
    clients, per_client = 16, 80
    x = np.random.default_rng(0).standard_normal((1, 3, 48, 192)).astype(np.float32)
    modes = {"off": "", "on, delay 0": "max_batch = 16\nmax_delay_ms = 0\n",
             "on, delay 2 ms": "max_batch = 16\nmax_delay_ms = 2.0\n"}
    shipped = (ROOT / "config" / "inferd.toml").read_text()
    cores = os.cpu_count() or 1
    # (threads, spinning): one thread; then every core, with onnxruntime's spin-waiting
    # (its default) and without it. Spinning threads take the cores from 16 client
    # processes and starve the unbatched arm, which flatters batching.
    for threads, spin in ((1, True), (cores, True), (cores, False)):
        config = tmp / f"inferd-{threads}-{spin}.toml"
        config.write_text(shipped.replace("intra_op_threads = 1",
                                          f"intra_op_threads = {threads}")
                          .replace("allow_spinning = true",
                                   f"allow_spinning = {str(spin).lower()}"))
        rates: dict[str, float] = {}
        for round_ in range(2):  # alternate the modes; the best of two rounds each
            for i, (mode, toml) in enumerate(modes.items()):
                repo = tmp / f"repo-{threads}-{spin}-{round_}-{i}"
                (repo / "ocr-cls").mkdir(parents=True)
                link_tree(MODELS / "ocr-cls" / "1", repo / "ocr-cls" / "1")
                (repo / "ocr-cls" / "model.toml").write_text(toml)
                daemon = DaemonProcess("--models", str(repo), "--preload", "ocr-cls",
                                       config=config)
                try:
                    elapsed = run_client_processes(
                        cls_client, [(daemon.endpoint, x, per_client)] * clients)
                finally:
                    daemon.stop()
                rates[mode] = max(rates.get(mode, 0.0), clients * per_client / elapsed)
        print(f"ocr-cls, {clients} concurrent clients x {per_client} requests, "
              f"intra_op_threads = {threads}, allow_spinning = {str(spin).lower()} in both "
              f"arms (best of 2): "
              + ", ".join(f"batching {m} {r:.0f} req/s" for m, r in rates.items()))
        for mode in list(modes)[1:]:
            ratio = rates[mode] / rates["off"]
            print(f"  {mode}: ratio {ratio:.2f} (target >= 1.5: "
                  f"{'met' if ratio >= 1.5 else 'MISSED'})")


if __name__ == "__main__":
    tmp = Path(tempfile.mkdtemp(prefix="inferd-b", dir="/tmp"))
    try:
        if "batching" not in sys.argv[1:]:
            ocr(tmp)
        if "ocr" not in sys.argv[1:]:
            batching(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
