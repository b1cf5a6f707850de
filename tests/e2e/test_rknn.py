"""End to end on the RKNN simulator: a real daemon with the rknn plugin (out of process,
in the .venv-rknn interpreter) serves ocr-cls on the simulator next to the same model on
onnxruntime; results within 1e-3; bad rknn models fail their load with a clear reason
while the daemon keeps serving. Skipped without the simulator's venv (failed under CI,
which sets INFERD_TEST_RKNN=1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from tests.e2e.ocr_images import fonts_available, render
from tests.libbackends.rknn_kit import install_plugin, simulator_python

from inferd.ipc import RequestError

pytestmark = [pytest.mark.slow, pytest.mark.rknn]


def cls_crops() -> np.ndarray:
    """Four text-line images as PP-OCR's classifier takes them: 3x48x192, (x/255-.5)/.5;
    two of them upside down."""
    assert fonts_available(), "fonts-dejavu-core is missing"
    crops = []
    for i, (text, rotation) in enumerate([("Hello world 123", 0), ("Invoice 4711", 180),
                                          ("inferd serves", 0), ("Total 99.50", 180)]):
        img = render([text], "DejaVuSans.ttf", 32, rotation, width=360)
        img = cv2.resize(img[10:80 + i % 2], (192, 48)).astype(np.float32)
        crops.append(((img / 255.0 - 0.5) / 0.5).transpose(2, 0, 1))
    return np.stack(crops).astype(np.float32)


def write_model(repo: Path, name: str, onnx: Path, toml: str) -> Path:
    version = repo / name / "1"
    version.mkdir(parents=True)
    shutil.copy(onnx, version / "model.onnx")
    (repo / name / "model.toml").write_text(toml)
    return version


def test_a_daemon_serves_ocr_cls_on_the_rknn_simulator(tmp_path: Path, start_daemon,
                                                        models_dir: Path) -> None:
    python = simulator_python()
    onnx = models_dir / "ocr-cls" / "1" / "model.onnx"
    repo = tmp_path / "models"
    rknn_table = '[rknn]\ncore_mask = "0_1"\ninput_shapes = {x = [1, 3, 48, 192]}\n'
    write_model(repo, "cls-npu", onnx, f'backends = ["rknn"]\n{rknn_table}')
    write_model(repo, "cls-cpu", onnx, 'backends = ["onnxruntime"]\n')
    write_model(repo, "cls-bad-mask", onnx, 'backends = ["rknn"]\n[rknn]\ncore_mask = "3"\n')
    write_model(repo, "cls-free-dims", onnx, 'backends = ["rknn"]\n')
    # A model.rknn a board would run, written by inferd-convert with the simulator's
    # toolkit: on x86 it cannot run, and the daemon says so.
    board = write_model(repo, "cls-board", onnx, f'backends = ["rknn"]\n{rknn_table}')
    proc = subprocess.run([sys.executable, "-m", "inferd.libbackends.rknn_convert", "rknn",
                           str(repo / "cls-board"), "--python", python],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done["rknn"] == str(board / "model.rknn") and done["bytes"] > 100_000
    sidecar = json.loads((board / "model.rknn.json").read_text())
    assert sidecar["inputs"] == [{"name": "x", "dtype": "float32",
                                  "shape": [None, 3, 48, 192]}]

    backends = tmp_path / "backends"
    install_plugin(backends)
    d = start_daemon("--models", str(repo), "--backends-dir", str(backends),
                     env={"INFERD_RKNN_PYTHON": python})
    x = cls_crops()
    with d.client(timeout=300) as c:
        [rknn] = [b for b in c.backends()["backends"] if b["id"] == "rknn"]
        assert rknn["status"] == "registered" and rknn["devices"] == ["rk3588 simulator"]
        assert rknn["version"] == "2.5.0 (simulator)"
        want = c.infer("cls-cpu", {"x": x})
        got = c.infer("cls-npu", {"x": x})
        [name] = list(want)
        assert got[name].shape == (4, 2)
        diff = float(np.abs(got[name] - want[name]).max())
        assert diff <= 1e-3, f"rknn simulator vs onnxruntime: max diff {diff}"
        assert list(got[name].argmax(1)) == list(want[name].argmax(1))
        models = {m["name"]: m for m in c.models()}
        assert models["cls-npu"]["backend"] == "rknn"

        for model, words in [
            ("cls-bad-mask", "model.toml [rknn] core_mask = '3': expected one of"),
            ("cls-free-dims", "RKNN needs fixed shapes: set model.toml [rknn] input_shapes"),
            ("cls-board", "a .rknn file cannot run in the simulator"),
        ]:
            with pytest.raises(RequestError) as info:
                c.infer(model, {"x": x[:1]})
            assert words in info.value.message, info.value.message
        # ... and the daemon keeps serving, on both backends.
        again = c.infer("cls-npu", {"x": x})
        assert float(np.abs(again[name] - want[name]).max()) <= 1e-3
        assert c.infer("cls-cpu", {"x": x})[name].shape == (4, 2)
    assert "a .rknn file cannot run in the simulator" in d.log()
