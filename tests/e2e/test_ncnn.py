"""The ncnn backend in a real daemon, on a real Vulkan device (Mesa's lavapipe here):
ocr-cls placed on gpu is served by ncnn on the Vulkan device, shown by ``inferctl models``
and ``inferctl backends``; with Vulkan hidden (``VK_ICD_FILENAMES`` naming no driver) the
same placement falls back to the CPU with the reason; a corrupt ``.param`` is a clear
load error and the daemon serves on; the OCR graph with ocr-cls and ocr-rec on ncnn
gives RapidOCR's texts.

The plugin is the source tree's (packaging/backends/ncnn) in a backends folder of the
test's own; the config says ``[ncnn] allow_software_vulkan = true`` (lavapipe is no
accelerator) and keeps the conversion cache in the test's folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.libbackends.ncnn_kit import LP_THREADS, install_plugin, require_vulkan
from tests.links import link_tree

from inferd.ipc import RequestError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ocr_images import CASES, fonts_available, rapidocr_reads, render  # noqa: E402

pytestmark = pytest.mark.slow
CLS_OUT = "save_infer_model/scale_0.tmp_1"
REC_TOML = '[ncnn]\ninput_shapes = {x = [[1, 3, 48, 320], [1, 3, 48, 640]]}\n'


def _setup(short_tmp: Path) -> tuple[Path, dict[str, str]]:
    """A backends folder with the ncnn plugin and a config allowing lavapipe: the
    daemon's arguments' environment, and the repository folder to fill."""
    require_vulkan()
    install_plugin(short_tmp / "backends")
    config = short_tmp / "inferd.toml"
    config.write_text(f'[ncnn]\nallow_software_vulkan = true\ncache_dir = '
                      f'"{short_tmp / "ncnn-cache"}"\n')
    env = {"INFERD_BACKENDS_PATH": str(short_tmp / "backends"), "INFERD_CONFIG": str(config),
           "LP_NUM_THREADS": LP_THREADS}
    return short_tmp / "repo", env


def _link(repo: Path, models_dir: Path, name: str, toml: str, as_name: str = "") -> Path:
    folder = repo / (as_name or name)
    (folder / "1").parent.mkdir(parents=True)
    link_tree(models_dir / name / "1", folder / "1")
    (folder / "model.toml").write_text(toml)
    return folder / "1"


def inferctl(endpoint: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                          *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _ort(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


def test_cls_on_gpu_is_served_by_ncnn_on_vulkan_and_a_corrupt_param_fails_alone(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    repo, env = _setup(short_tmp)
    _link(repo, models_dir, "ocr-cls", 'backends = ["gpu", "cpu"]\n')
    broken = _link(repo, models_dir, "ocr-cls", 'backends = ["ncnn"]\n', as_name="broken")
    shutil.rmtree(broken)
    broken.mkdir()
    (broken / "model.ncnn.param").write_text("7767517\n3 3\nInput in0 0 1 in0\nnonsense\n")
    (broken / "model.ncnn.bin").write_bytes(b"\0" * 64)
    (broken / "model.ncnn.json").write_text(json.dumps({
        "input_shapes": [[[1, 4]]], "inputs": [{"name": "x", "dtype": "float32",
                                                 "shape": [None, 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [None, 4]}]}))
    daemon = start_daemon("--models", str(repo), "--preload", "ocr-cls", env=env)
    x = np.random.default_rng(5).random((2, 3, 48, 192), dtype=np.float32)
    want = _ort(models_dir / "ocr-cls" / "1" / "model.onnx", x)
    with daemon.client(timeout=120) as c:
        got = c.infer("ocr-cls", {"x": x})[CLS_OUT]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        models = {m["name"]: m for m in c.models(verbose=True)}
        with pytest.raises(RequestError) as info:
            c.infer("broken", {"x": np.zeros((1, 4), np.float32)})
        # the daemon serves on
        np.testing.assert_allclose(c.infer("ocr-cls", {"x": x})[CLS_OUT], want, atol=1e-5)
    cls = models["ocr-cls"]
    assert (cls["backend"], cls["device_kind"]) == ("ncnn", "gpu")
    assert cls["device"].startswith("vulkan:0 llvmpipe") and \
        cls["device"].endswith("(software, Vulkan type cpu)")
    assert cls["chosen"].startswith("entry 1 ('gpu') of model.toml backends = ['gpu', 'cpu']")
    assert info.value.code == "INTERNAL"
    assert f"ncnn cannot load {broken / 'model.ncnn.param'}: load_param failed" in \
        info.value.message
    table = inferctl(daemon.endpoint, "models", "-v")
    assert "placement: backend ncnn, device vulkan:0 llvmpipe" in table
    backends = inferctl(daemon.endpoint, "backends")
    row = next(line for line in backends.splitlines() if line.startswith("ncnn "))
    assert "cpu,gpu" in row and "vulkan:0 llvmpipe" in row and \
        "used for gpu placement ([ncnn] allow_software_vulkan = true)" in row
    log = daemon.log()
    assert "model ocr-cls version 1 loaded on ncnn, device vulkan:0 llvmpipe" in log
    assert "ncnn: converted " in log


def test_with_vulkan_hidden_the_gpu_placement_falls_back_with_the_reason(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    repo, env = _setup(short_tmp)
    # placement "first": the cpu entry's backend and the chosen text are asserted below
    # (measured placement may move it to openvino and say why instead)
    _link(repo, models_dir, "ocr-cls", 'backends = ["gpu", "cpu"]\nplacement = "first"\n')
    icd = short_tmp / "no-such-icd.json"
    daemon = start_daemon("--models", str(repo), "--preload", "ocr-cls",
                          env={**env, "VK_ICD_FILENAMES": str(icd)})
    x = np.random.default_rng(6).random((1, 3, 48, 192), dtype=np.float32)
    with daemon.client(timeout=120) as c:
        got = c.infer("ocr-cls", {"x": x})[CLS_OUT]
        cls = next(m for m in c.models(verbose=True) if m["name"] == "ocr-cls")
        ncnn = next(b for b in c.backends()["backends"] if b["id"] == "ncnn")
    np.testing.assert_allclose(got, _ort(models_dir / "ocr-cls" / "1" / "model.onnx", x),
                               atol=1e-5)
    assert cls["device_kind"] == "cpu" and cls["backend"] in ("onnxruntime", "ncnn")
    reason = f"gpu placement off: no Vulkan driver answered (VK_ICD_FILENAMES={icd})"
    assert (ncnn["kinds"], ncnn["devices"], ncnn["reason"]) == (["cpu"], ["cpu"], reason)
    assert f"; gpu: no backend found a gpu device (ncnn: {reason})" in \
        cls["chosen"], cls["chosen"]
    assert f"model ocr-cls: passed over backend gpu: no backend found a gpu device (ncnn: " \
           f"{reason})" in daemon.log()


@pytest.mark.skipif(not fonts_available(), reason="DejaVu fonts missing (fonts-dejavu-core)")
def test_the_ocr_graph_with_cls_and_rec_on_ncnn_gives_rapidocrs_texts(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    pytest.importorskip("rapidocr_onnxruntime")
    repo, env = _setup(short_tmp)
    cls_toml = (models_dir / "ocr-cls" / "model.toml").read_text()
    _link(repo, models_dir, "ocr-det", 'backends = ["onnxruntime"]\n')
    # the backend id alone: its most specialised kind, the Vulkan device
    _link(repo, models_dir, "ocr-cls", f'backends = ["ncnn"]\n{cls_toml}')
    _link(repo, models_dir, "ocr-rec", f'backends = ["ncnn"]\n{REC_TOML}')
    (repo / "ocr").mkdir()
    shutil.copy(models_dir / "ocr" / "graph.toml", repo / "ocr")
    daemon = start_daemon("--models", str(repo), env=env)
    with daemon.client(timeout=300) as c:
        for k, case in enumerate(CASES[:3]):
            image = render(*case)
            want, _ = rapidocr_reads(k)
            assert want, f"RapidOCR read nothing in {case}"
            assert c.infer("ocr", {"image": image})["texts"].tolist() == want, case
        models = {m["name"]: m for m in c.models(verbose=True)}
    for name in ("ocr-cls", "ocr-rec"):
        assert (models[name]["backend"], models[name]["device_kind"]) == ("ncnn", "gpu")
