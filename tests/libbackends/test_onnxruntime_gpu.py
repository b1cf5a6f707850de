"""The onnxruntime GPU backend up to the hardware boundary (this machine has no NVIDIA
GPU): the probe's reason with the CPU build, and with the real onnxruntime-gpu wheel
(which lists CUDA and TensorRT, then silently makes CPU sessions): the probe and every
load report the library that is missing, no "gpu" model runs on the CPU, and a daemon
places such a model along its preference list.

The wheel is the one `make deb` packages (.cache/wheels/onnxruntime-gpu/, fetched by
`make wheels`); without it those tests skip, unless INFERD_REQUIRE_GPU_WHEEL=1 (.ci/run
sets it) makes the skip a failure. On an NVIDIA machine, bench/device_check.sh runs the
contract suite on this backend for real.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.links import link_tree

from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_gpu import (
    OnnxRuntimeGpuBackend, captured_output, why_not_on_gpu,
)

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "wheels" / "onnxruntime-gpu"
MODEL = ROOT / "models" / "ocr-cls" / "1" / "model.onnx"


def test_the_cpu_build_is_unavailable_with_the_reason() -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this venv holds onnxruntime-gpu")
    probe = OnnxRuntimeGpuBackend().probe()
    assert not probe.available
    assert f"onnxruntime {onnxruntime.__version__} (" in probe.reason
    assert "is a build without CUDA (providers: " in probe.reason
    assert "needs onnxruntime-gpu in its place" in probe.reason


def test_the_reason_is_the_library_onnxruntime_could_not_load() -> None:
    # what onnxruntime-gpu 1.31 printed on this machine (ANSI colours removed)
    printed = (
        "2026-11-30 14:45:32.301 [E:onnxruntime:Default, provider_bridge_ort.cc:2458 "
        "operator()] /onnxruntime_src/onnxruntime/core/session/provider_bridge_ort.cc:2043 "
        "onnxruntime::Provider& onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : "
        "1 : FAIL : Failed to load library /venv/onnxruntime/capi/libonnxruntime_providers_"
        "cuda.so with error: libcublasLt.so.13: cannot open shared object file: No such "
        "file or directory\n2026-11-30 14:45:32.301 [W:onnxruntime:Default, onnxruntime_"
        "pybind_state.cc:1295 CreateExecutionProviderFactoryInstance] Failed to create "
        "CUDAExecutionProvider. Require cuDNN 9.* and CUDA 13.*.\n")
    assert why_not_on_gpu(printed) == (
        "cannot load libonnxruntime_providers_cuda.so: libcublasLt.so.13: cannot open "
        "shared object file: No such file or directory")
    assert why_not_on_gpu(printed.split("\n", 1)[1]).startswith(
        "Failed to create CUDAExecutionProvider. Require cuDNN 9.*")
    assert why_not_on_gpu("") == "onnxruntime printed no reason"


def test_captured_output_takes_native_stderr_and_passes_it_on(
        capfd: pytest.CaptureFixture[str]) -> None:
    with captured_output() as text:
        os.write(2, b"\x1b[1;31mfrom native code\x1b[m\n")
        print("from python")
    assert text == ["from native code\nfrom python\n"]
    assert "from native code" in capfd.readouterr().err


@pytest.mark.parametrize("options,words", [
    ({"device": 0}, "[onnxruntime-gpu] device: unknown key; known keys: device_id"),
    ({"device_id": -1}, "[onnxruntime-gpu] device_id = -1: expected an integer >= 0"),
    ({"provider": "rocm"}, "provider = 'rocm': expected one of cuda, tensorrt"),
    ({"fp16": 1}, "[onnxruntime-gpu] fp16 = 1: expected true or false"),
    ({"cache_dir": "cache"}, "cache_dir = 'cache': expected an absolute directory path"),
])
def test_a_bad_key_names_it(options: dict[str, Any], words: str) -> None:
    with pytest.raises(InferdError) as info:
        OnnxRuntimeGpuBackend().load(MODEL, LoadOptions(options=options))
    assert words in info.value.message


# ----------------------------------------------------------- with the real GPU wheel


@pytest.fixture(scope="module")
def gpu_site() -> Path:
    """The onnxruntime-gpu wheel unpacked once into .cache (as the Debian package
    vendors it)."""
    # this machine's architecture: make deb ARCH=arm64 downloads the aarch64 wheel beside it
    wheels = sorted(WHEELS.glob(f"onnxruntime_gpu-*-cp{sys.version_info[0]}"
                                f"{sys.version_info[1]}-*_{platform.machine()}.whl"))
    if not wheels:
        message = f"no onnxruntime-gpu wheel in {WHEELS}: run `make wheels`"
        if os.environ.get("INFERD_REQUIRE_GPU_WHEEL"):
            pytest.fail(message)
        pytest.skip(message)
    site = WHEELS / ("site-" + wheels[-1].stem)
    if not (site / ".complete").exists():
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(site)
        (site / ".complete").touch()
    return site


PROBE_SCRIPT = """
import json, sys
from pathlib import Path
import onnxruntime
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend
b = OnnxRuntimeGpuBackend()
out = {"ort": onnxruntime.__file__, "providers": onnxruntime.get_available_providers(),
       "probe": b.probe().reason}
for provider in ("cuda", "tensorrt"):
    try:
        b.load(Path(sys.argv[1]), LoadOptions(options={"provider": provider}))
        out[provider] = "loaded"
    except Exception as e:
        out[provider] = [str(e.code), e.message]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_gpu_wheel_without_a_gpu_never_gives_a_cpu_session(gpu_site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(gpu_site)}
    proc = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(MODEL)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # nothing else on stdout: onnxruntime's prints captured
    assert out["ort"].startswith(str(gpu_site))
    assert "CUDAExecutionProvider" in out["providers"]  # listed, yet unusable here
    assert out["probe"].startswith("CUDA provider unusable (cannot load "
                                   "libonnxruntime_providers_cuda.so: libcublas")
    assert "onnxruntime would run on CPUExecutionProvider only" in out["probe"]
    for provider, lib in (("cuda", "cuda"), ("tensorrt", "tensorrt")):
        code, message = out[provider]
        assert code == str(ErrorCode.UNAVAILABLE)
        assert f"onnxruntime-gpu will not run {MODEL} on the CPU: " in message
        assert f"cannot load libonnxruntime_providers_{lib}.so: lib" in message
        assert "the session got CPUExecutionProvider" in message
    assert "libcublasLt.so" in proc.stderr  # what onnxruntime printed is passed on


@pytest.mark.slow
def test_a_daemon_with_the_gpu_wheel_places_gpu_models_on_the_cpu_only_if_allowed(
        gpu_site: Path, start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    repo = short_tmp / "repo"
    for name, toml in (("gpu-only", 'backends = ["onnxruntime-gpu"]\n'),
                       ("gpu-then-cpu", 'backends = ["gpu", "cpu"]\n')):
        (repo / name).mkdir(parents=True)
        link_tree(models_dir / "ocr-cls" / "1", repo / name / "1")
        (repo / name / "model.toml").write_text(toml)
    daemon = start_daemon("--models", str(repo), env={"PYTHONPATH": str(gpu_site)})
    x = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    with daemon.client(timeout=60) as c:
        gpu = next(b for b in c.backends()["backends"] if b["id"] == "onnxruntime-gpu")
        assert gpu["status"] == "unavailable" and "libcublas" in gpu["reason"]
        with pytest.raises(InferdError) as info:
            c.infer("gpu-only", x)
        assert info.value.code is ErrorCode.UNAVAILABLE
        assert "onnxruntime-gpu: unavailable (CUDA provider unusable (cannot load " \
               "libonnxruntime_providers_cuda.so: libcublas" in info.value.message
        assert c.infer("gpu-then-cpu", x)["save_infer_model/scale_0.tmp_1"].shape == (1, 2)
        placed = {m["name"]: m for m in c.models()}["gpu-then-cpu"]
    assert (placed["backend"], placed["device"]) == ("onnxruntime", "CPU")
    assert placed["chosen"].startswith("entry 2 ('cpu') of model.toml backends")
    assert "passed over: onnxruntime-gpu: unavailable (CUDA provider unusable" in \
        placed["chosen"]
