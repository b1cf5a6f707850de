"""The OpenVINO backend on this machine's CPU: the demo models give onnxruntime's results
(within 1e-4), f32 unless model.toml says otherwise, IR beside model.onnx, the devices
it probes, and a clear load error for every bad input: a device that is absent, an IR
whose .bin is missing, an IR from another OpenVINO version, an .rknn file, a bad
[openvino] key. The devices absent here (GPU, NPU) are really absent: their errors are
OpenVINO's own."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import BatchSizes, DeviceKind, LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend

ov = pytest.importorskip("openvino", reason="pip openvino is in the test extras")

from inferd.libbackends.openvino_backend import OpenVinoBackend, ir_info  # noqa: E402

MODELS = Path(__file__).resolve().parents[2] / "models"
RNG = np.random.default_rng(7)
INPUTS = {
    "ocr-cls": {"x": RNG.random((4, 3, 48, 192), dtype=np.float32)},
    "ocr-rec": {"x": RNG.random((2, 3, 48, 320), dtype=np.float32)},
    "ocr-det": {"x": RNG.random((1, 3, 320, 320), dtype=np.float32)},
}


@pytest.fixture(scope="module")
def backend() -> OpenVinoBackend:
    return OpenVinoBackend()


def _model(name: str) -> Path:
    path = MODELS / name / "1" / "model.onnx"
    if not path.exists():
        pytest.skip(f"{path} missing: run make setup")
    return path


def test_probe_lists_openvinos_devices_and_registers_only_their_kinds(
        backend: OpenVinoBackend) -> None:
    probe = backend.probe()
    devices = ov.Core().available_devices
    assert probe.available and probe.devices == tuple(devices)
    assert DeviceKind.CPU in probe.kinds
    for kind, prefix in ((DeviceKind.GPU, "GPU"), (DeviceKind.NPU, "NPU")):
        assert (kind in probe.kinds) == any(d.startswith(prefix) for d in devices)


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_results_match_onnxruntime(backend: OpenVinoBackend, name: str) -> None:
    path = _model(name)
    model = backend.load(path, LoadOptions())
    reference = OnnxRuntimeCpuBackend().load(path, LoadOptions())
    try:
        assert model.device == "CPU"
        assert [s.name for s in model.inputs] == [s.name for s in reference.inputs]
        assert [s.name for s in model.outputs] == [s.name for s in reference.outputs]
        got, want = model.run(INPUTS[name]), reference.run(INPUTS[name])
        for key in want:
            assert got[key].shape == want[key].shape
            np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0)
    finally:
        model.unload()
        reference.unload()


@pytest.mark.slow
def test_the_probe_leaves_the_device_plugins_out_of_this_process(tmp_path: Path) -> None:
    # Listing the devices loads every device plugin (the GPU plugin brings OpenCL and its
    # ICD, pocl with LLVM here: 96 MiB); the probe lists them in a child process.
    import subprocess
    import sys

    code = ("from inferd.libbackends.openvino_backend import OpenVinoBackend\n"
            "p = OpenVinoBackend().probe()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(p.available, list(p.devices), 'intel_gpu_plugin' in maps, 'LLVM' in maps)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == "True" and "CPU" in out[1]
    assert out[2:] == ["False", "False"]


@pytest.mark.slow
def test_static_shapes_compile_one_copy_per_shape_up_to_the_limit(
        backend: OpenVinoBackend) -> None:
    path = _model("ocr-cls")
    reference = OnnxRuntimeCpuBackend().load(path, LoadOptions())
    model = backend.load(path, LoadOptions(options={"static_shapes": 2}))
    dynamic = backend.load(path, LoadOptions())
    try:
        assert dynamic.describe() == {}
        assert model.describe() == {"static_shapes": [], "static_shapes_limit": 2}
        assert model.batch_sizes() == BatchSizes(frozenset(), 2)
        for rows in (1, 3, 1, 5, 3):  # 1 and 3 get copies; 5 comes after the limit
            x = {"x": RNG.random((rows, 3, 48, 192), dtype=np.float32)}
            got = model.run(x)
            for key, want in reference.run(x).items():
                np.testing.assert_allclose(got[key], want, atol=1e-4, rtol=0)
                np.testing.assert_array_equal(got[key], dynamic.run(x)[key])
        assert model.describe()["static_shapes"] == ["x=1x3x48x192", "x=3x3x48x192"]
        # for adaptive batching: the sizes compiled cost no switch; the dynamic compile
        # re-plans at each change of size, so none is free there
        assert model.batch_sizes() == BatchSizes(frozenset({1, 3}), 0)
        assert dynamic.batch_sizes() == BatchSizes()
        copy = model._static[(("x", (1, 3, 48, 192)),)].compiled
        assert [d.get_length() for d in copy.inputs[0].get_partial_shape()] == [1, 3, 48, 192]
        assert copy.get_property("INFERENCE_NUM_THREADS") == \
            dynamic.compiled.get_property("INFERENCE_NUM_THREADS")
    finally:
        for m in (model, dynamic, reference):
            m.unload()


def test_inputs_from_the_wire_give_the_same_results(
        backend: OpenVinoBackend) -> None:
    # frames from the wire are read-only and need not be aligned (docs/protocol.md)
    path = _model("ocr-cls")
    model = backend.load(path, LoadOptions())
    try:
        x = RNG.random((2, 3, 48, 192), dtype=np.float32)
        want = model.run({"x": x})
        raw = bytes(3) + x.tobytes()
        unaligned = np.frombuffer(raw, np.float32, offset=3).reshape(x.shape)
        assert unaligned.ctypes.data % 4 and not unaligned.flags.writeable
        for arr in (unaligned, np.asfortranarray(x), x[:, :, :, ::-1][:, :, :, ::-1]):
            got = model.run({"x": arr})
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        # the outputs are copies: the next run does not change them
        before = {k: v.copy() for k, v in want.items()}
        model.run({"x": RNG.random((2, 3, 48, 192), dtype=np.float32)})
        for key in want:
            np.testing.assert_array_equal(want[key], before[key])
    finally:
        model.unload()


def test_f32_by_default_and_precision_overrides(backend: OpenVinoBackend) -> None:
    path = _model("ocr-cls")
    f32 = backend.load(path, LoadOptions())
    assert str(f32.compiled.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
    # OpenVINO's own thread pinning would fight the model's cpu_affinity
    assert f32.compiled.get_property("ENABLE_CPU_PINNING") is False
    hint = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    other = "f16" if str(hint) == "<Type: 'float32'>" else "bf16"
    m = backend.load(path, LoadOptions(options={"precision": other, "threads": 2,
                                                "streams": 1}))
    assert m.compiled.get_property("INFERENCE_NUM_THREADS") == 2
    assert str(m.compiled.get_property("INFERENCE_PRECISION_HINT")) != \
        str(f32.compiled.get_property("INFERENCE_PRECISION_HINT")) or other == "f16"
    f32.unload()
    m.unload()


def test_reads_the_ir_beside_model_onnx(backend: OpenVinoBackend, tmp_path: Path) -> None:
    src = _model("ocr-cls")
    folder = tmp_path / "1"
    folder.mkdir()
    shutil.copy(src, folder / "model.onnx")
    ov.save_model(ov.Core().read_model(str(src)), str(folder / "model.xml"),
                  compress_to_fp16=False)
    assert ir_info(folder / "model.xml")[0] == 11
    model = backend.load(folder / "model.onnx", LoadOptions())
    assert model._path == folder / "model.xml"  # type: ignore[attr-defined]
    x = INPUTS["ocr-cls"]
    want = OnnxRuntimeCpuBackend().load(src, LoadOptions()).run(x)
    for key, value in model.run(x).items():
        np.testing.assert_allclose(value, want[key], atol=1e-4, rtol=0)


def _ir(tmp_path: Path) -> Path:
    folder = tmp_path / "1"
    folder.mkdir(exist_ok=True)
    ov.save_model(ov.Core().read_model(str(_model("ocr-cls"))), str(folder / "model.xml"),
                  compress_to_fp16=False)
    return folder / "model.xml"


def test_an_ir_whose_bin_is_missing_is_a_clear_load_error(backend: OpenVinoBackend,
                                                          tmp_path: Path) -> None:
    xml = _ir(tmp_path)
    xml.with_suffix(".bin").unlink()
    with pytest.raises(InferdError) as info:
        backend.load(xml, LoadOptions())
    assert info.value.code is ErrorCode.NOT_FOUND
    assert f"openvino cannot load {xml}: its weights file model.bin is missing" in \
        info.value.message


def test_an_ir_of_another_openvino_version_is_a_clear_load_error(backend: OpenVinoBackend,
                                                                 tmp_path: Path) -> None:
    xml = _ir(tmp_path)
    text = xml.read_text()
    # what a future OpenVINO would write: a newer IR version and its own name in rt_info
    xml.write_text(text.replace('version="11"', 'version="12"', 1)
                   .replace(f'value="{ov.__version__}"', 'value="2031.1.0-1-abc"'))
    with pytest.raises(InferdError) as info:
        backend.load(xml, LoadOptions())
    assert info.value.code is ErrorCode.UNSUPPORTED
    assert (f"it is IR version 12, written by OpenVINO 2031.1.0-1-abc; this OpenVINO "
            f"{backend.version} reads IR versions 10 and 11") in info.value.message
    # an operator set this OpenVINO lacks, in an IR of a known version: OpenVINO's own
    # reason, and which version wrote the file
    xml.write_text(text.replace('version="opset1"', 'version="opset99"', 1)
                   .replace(f'value="{ov.__version__}"', 'value="2031.1.0-1-abc"'))
    with pytest.raises(InferdError) as info:
        backend.load(xml, LoadOptions())
    assert "unsupported opset: opset99" in info.value.message
    assert "the IR was written by OpenVINO 2031.1.0" in info.value.message


def test_an_rknn_file_is_refused_with_the_reason(backend: OpenVinoBackend,
                                                 tmp_path: Path) -> None:
    rknn = tmp_path / "model.rknn"
    rknn.write_bytes(b"RKNN\0\0\0\0")
    ok, why = backend.supports(rknn)
    assert not ok and "compiled for a Rockchip NPU (backend rknn)" in why
    with pytest.raises(InferdError) as info:
        backend.load(rknn, LoadOptions())
    assert info.value.code is ErrorCode.UNSUPPORTED and str(rknn) in info.value.message


@pytest.mark.parametrize("kind,device", [(DeviceKind.GPU, None), (DeviceKind.NPU, None),
                                         (DeviceKind.CPU, "GPU.1")])
def test_an_absent_device_is_a_load_error_quoting_openvino(
        backend: OpenVinoBackend, kind: DeviceKind, device: str | None) -> None:
    name = device or {DeviceKind.GPU: "GPU", DeviceKind.NPU: "NPU"}[kind]
    if any(d.startswith(name) for d in ov.Core().available_devices):
        pytest.skip(f"this machine has an OpenVINO {name} device")
    options = LoadOptions(kind=kind, options={"device": device} if device else {})
    with pytest.raises(InferdError) as info:
        backend.load(_model("ocr-cls"), options)
    assert info.value.code is ErrorCode.UNAVAILABLE
    message = info.value.message
    assert f"openvino cannot compile {_model('ocr-cls')} for device {name}: " in message
    assert "(available devices: CPU" in message
    # OpenVINO's reason, without its source-file trace lines
    assert "Exception from src/" not in message and len(message) > 120


@pytest.mark.parametrize("options,words", [
    ({"devices": "CPU"}, "[openvino] devices: unknown key; known keys: device, precision"),
    ({"device": "TPU"}, "[openvino] device = 'TPU': expected an OpenVINO device name"),
    ({"precision": "f8"}, "[openvino] precision = 'f8': expected one of f32, f16, bf16"),
    ({"threads": 0}, "[openvino] threads = 0: expected an integer >= 1"),
    ({"static_shapes": -1}, "[openvino] static_shapes = -1: expected an integer >= 0"),
])
def test_a_bad_openvino_key_names_it(backend: OpenVinoBackend, options: dict[str, object],
                                     words: str) -> None:
    with pytest.raises(InferdError) as info:
        backend.load(_model("ocr-cls"), LoadOptions(options=options))
    assert words in info.value.message


def test_vad_is_refused_with_openvinos_reason(backend: OpenVinoBackend) -> None:
    # OpenVINO's ONNX frontend cannot convert Silero VAD (If + dynamic ranks): a load
    # error with the ops it names, so the model's preference list falls back.
    with pytest.raises(InferdError) as info:
        backend.load(_model("vad"), LoadOptions())
    assert "openvino cannot read" in info.value.message
    assert "Conv" in info.value.message
