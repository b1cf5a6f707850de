"""Accelerator backends in a real daemon: models pinned to OpenVINO and onnxruntime at the
same time, the OCR graph split across the two engines, placement shown by inferctl and
the journal line, the fallback along a model's preference list, and a clear load error
for every bad input while the daemon keeps serving the other models.

OpenVINO runs on this machine's CPU; its GPU and NPU devices are really absent here, so
their errors are OpenVINO's own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from inferd.ipc import RequestError
from inferd.ipc.errors import ErrorCode
from tests.links import link_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ocr_images import CASES, fonts_available, render  # noqa: E402

ov = pytest.importorskip("openvino", reason="pip openvino is in the test extras")
pytestmark = pytest.mark.slow

CORES = sorted(os.sched_getaffinity(0))


def _link(repo: Path, models_dir: Path, name: str, toml: str = "", as_name: str = "") -> None:
    (repo / (as_name or name)).mkdir(parents=True)
    link_tree(models_dir / name / "1", repo / (as_name or name) / "1")
    if toml:
        (repo / (as_name or name) / "model.toml").write_text(toml)


def inferctl(endpoint: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                          *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _ort(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, inputs)))


def test_cls_on_openvino_and_vad_on_onnxruntime_at_once_each_pinned(
        start_daemon: Any, short_tmp: Path, models_dir: Path,
        demo_inputs: dict[str, dict[str, np.ndarray]]) -> None:
    repo = short_tmp / "repo"
    _link(repo, models_dir, "ocr-cls", f'backends = ["openvino"]\ncpu_affinity = '
                                       f'[{CORES[0]}]\nmax_batch = 8\n')
    _link(repo, models_dir, "vad", f'backends = ["onnxruntime"]\ncpu_affinity = '
                                   f'[{CORES[-1]}]\n')
    daemon = start_daemon("--models", str(repo), "--preload", "ocr-cls",
                          "--preload", "vad")
    rng = np.random.default_rng(3)
    cls_x = rng.random((2, 3, 48, 192), dtype=np.float32)
    vad_in = dict(demo_inputs["vad"], input=rng.standard_normal((1, 512)).astype(np.float32))
    want_cls = _ort(models_dir / "ocr-cls" / "1" / "model.onnx", {"x": cls_x})
    want_vad = _ort(models_dir / "vad" / "1" / "model.onnx", vad_in)
    errors: list[str] = []

    def hammer(model: str, inputs: dict[str, np.ndarray], want: dict[str, np.ndarray]
               ) -> None:
        with daemon.client() as c:
            for _ in range(30):
                got = c.infer(model, inputs)
                for k, v in want.items():
                    if not np.allclose(got[k], v, atol=1e-4, rtol=0):
                        errors.append(f"{model} {k} differs by {np.abs(got[k] - v).max()}")
                        return

    threads = [threading.Thread(target=hammer, args=a) for a in
               (("ocr-cls", {"x": cls_x}, want_cls), ("vad", vad_in, want_vad))] * 1
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    with daemon.client() as c:
        models = {m["name"]: m for m in c.models(verbose=True)}
        view = c.backends()
    cls, vad = models["ocr-cls"], models["vad"]
    assert (cls["backend"], cls["device"], cls["device_kind"]) == ("openvino", "CPU", "cpu")
    assert cls["chosen"] == "entry 1 ('openvino') of model.toml backends = ['openvino']"
    assert (vad["backend"], vad["device"]) == ("onnxruntime", "CPU")
    for m, core in ((cls, CORES[0]), (vad, CORES[-1])):
        infer = [p for p in m["placement"] if p["stage"] == "infer"]
        assert infer and all(p["affinity"] == [core] for p in infer), m["placement"]
        assert all(p["backend"] == m["backend"] for p in infer)
    placed = {m["name"]: m for m in view["models"]}
    assert placed["ocr-cls"]["device"] == "CPU" and placed["vad"]["backend"] == "onnxruntime"
    openvino = next(b for b in view["backends"] if b["id"] == "openvino")
    assert openvino["status"] == "registered" and openvino["kinds"] == ["cpu"]

    table = inferctl(daemon.endpoint, "models", "-v")
    assert any(line.split()[:5] == ["ocr-cls", "ready", "1", "openvino", "CPU"]
               for line in table.splitlines()), table
    assert ("placement: backend openvino, device CPU; chosen: entry 1 ('openvino') of "
            "model.toml backends = ['openvino']") in table
    backends = inferctl(daemon.endpoint, "backends")
    assert any(line.split()[:4] == ["ocr-cls", "1", "openvino", "CPU"]
               for line in backends.splitlines()), backends
    log = daemon.log()
    assert "model ocr-cls version 1 loaded on openvino, device CPU, in " in log
    assert "chosen: entry 1 ('openvino') of model.toml backends = ['openvino']" in log


@pytest.mark.skipif(not fonts_available(), reason="DejaVu fonts missing (fonts-dejavu-core)")
def test_ocr_graph_with_det_on_openvino_and_rec_on_onnxruntime(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    split, plain = short_tmp / "split", short_tmp / "plain"
    cls_toml = (models_dir / "ocr-cls" / "model.toml").read_text()
    for repo, det, rec in ((split, "openvino", "onnxruntime"),
                           (plain, "onnxruntime", "onnxruntime")):
        _link(repo, models_dir, "ocr-det", f'backends = ["{det}"]\n')
        _link(repo, models_dir, "ocr-rec", f'backends = ["{rec}"]\n')
        _link(repo, models_dir, "ocr-cls", cls_toml)
        (repo / "ocr").mkdir()
        shutil.copy(models_dir / "ocr" / "graph.toml", repo / "ocr")
    images = [render(*case) for case in CASES[:4]]
    results = {}

    def serve(name: str, repo: Path) -> None:
        workdir = short_tmp / name
        workdir.mkdir(exist_ok=True)
        daemon = start_daemon("--models", str(repo), workdir=workdir)
        with daemon.client(timeout=120) as c:
            results[name] = [c.infer("ocr", {"image": im}) for im in images]
            models = {m["name"]: m for m in c.models()}
        assert models["ocr-det"]["backend"] == ("openvino" if name == "split"
                                                else "onnxruntime")
        assert models["ocr-rec"]["backend"] == "onnxruntime"
        daemon.stop()

    # the two daemons at once: each one's start and loads are mostly one thread's work
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(serve, "split", split), pool.submit(serve, "plain", plain)]:
            done.result()
    for got, want in zip(results["split"], results["plain"]):
        assert got["texts"].tolist() == want["texts"].tolist()
        assert got["texts"].size > 0
        np.testing.assert_allclose(got["boxes"], want["boxes"], atol=1.0)
        np.testing.assert_allclose(got["scores"], want["scores"], atol=1e-3)


def _ir(folder: Path, models_dir: Path) -> Path:
    folder.mkdir(parents=True)
    xml = folder / "model.xml"
    ov.save_model(ov.Core().read_model(str(models_dir / "ocr-cls" / "1" / "model.onnx")),
                  str(xml), compress_to_fp16=False)
    return xml


def test_bad_inputs_are_clear_load_errors_and_the_daemon_keeps_serving(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    repo = short_tmp / "repo"
    _link(repo, models_dir, "ocr-cls")
    # a device that is absent, no fallback allowed
    _link(repo, models_dir, "ocr-cls", 'backends = ["openvino"]\n[openvino]\ndevice = "GPU"\n',
          as_name="on-gpu")
    # the same, with a fallback: passed over with OpenVINO's reason, then onnxruntime
    # (placement "first": its backend and chosen text are asserted, nothing measured)
    _link(repo, models_dir, "ocr-cls", 'backends = ["gpu", "openvino", "cpu"]\n'
                                       'placement = "first"\n[openvino]\n'
                                       'device = "GPU"\n', as_name="gpu-or-cpu")
    # an IR whose .bin is missing
    _ir(repo / "no-bin" / "1", models_dir).with_suffix(".bin").unlink()
    (repo / "no-bin" / "model.toml").write_text('backends = ["openvino"]\n')
    # an IR written by another OpenVINO (a newer IR version)
    xml = _ir(repo / "future-ir" / "1", models_dir)
    xml.write_text(xml.read_text().replace('version="11"', 'version="12"', 1))
    (repo / "future-ir" / "model.toml").write_text('backends = ["openvino"]\n')
    # a compiled Rockchip model given to OpenVINO
    (repo / "rknn" / "1").mkdir(parents=True)
    (repo / "rknn" / "1" / "model.rknn").write_bytes(b"RKNN\0\0\0\0" * 8)
    (repo / "rknn" / "model.toml").write_text('backends = ["openvino"]\n')
    daemon = start_daemon("--models", str(repo))
    x = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    expected = {
        "on-gpu": (ErrorCode.UNAVAILABLE, "openvino cannot compile", "for device GPU: "),
        "no-bin": (ErrorCode.NOT_FOUND, "its weights file model.bin is missing", ""),
        "future-ir": (ErrorCode.UNSUPPORTED, "it is IR version 12", "reads IR versions"),
        "rknn": (ErrorCode.UNAVAILABLE, "compiled for a Rockchip NPU (backend rknn)",
                 "no backend can run it"),
    }
    with daemon.client(timeout=60) as c:
        for name, (code, words, more) in expected.items():
            with pytest.raises(RequestError) as info:
                c.infer(name, x)
            assert info.value.code is code, (name, info.value.message)
            assert words in info.value.message and more in info.value.message, \
                (name, info.value.message)
            assert c.infer("ocr-cls", x)["save_infer_model/scale_0.tmp_1"].shape == (1, 2)
        got = c.infer("gpu-or-cpu", x)["save_infer_model/scale_0.tmp_1"]
        assert got.shape == (1, 2)
        models = {m["name"]: m for m in c.models()}
    fallback = models["gpu-or-cpu"]
    assert (fallback["backend"], fallback["device"]) == ("onnxruntime", "CPU")
    assert fallback["chosen"].startswith("entry 3 ('cpu') of model.toml backends")
    assert "passed over: " in fallback["chosen"]
    assert "openvino (cpu): openvino cannot compile" in fallback["chosen"]
    assert "onnxruntime-gpu: unavailable" in fallback["chosen"]
    assert models["on-gpu"]["state"] == "failed"
    log = daemon.log()
    assert "model gpu-or-cpu: backend openvino (cpu) failed to load it: openvino cannot " \
           "compile" in log
    assert "model gpu-or-cpu: passed over backend onnxruntime-gpu: unavailable" in log
    assert daemon.stop() == 0


def test_inferctl_json_backends_lists_the_kinds(start_daemon: Any, short_tmp: Path,
                                                models_dir: Path) -> None:
    repo = short_tmp / "repo"
    _link(repo, models_dir, "ocr-cls")
    daemon = start_daemon("--models", str(repo))
    view = json.loads(inferctl(daemon.endpoint, "--json", "backends"))
    by_id = {b["id"]: b for b in view["backends"]}
    assert by_id["openvino"]["devices"] == list(ov.Core().available_devices)
    gpu = by_id["onnxruntime-gpu"]
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert gpu["status"] == "unavailable" and "build without CUDA" in gpu["reason"]
