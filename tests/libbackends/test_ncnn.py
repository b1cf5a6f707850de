"""The ncnn backend on this machine: the CPU, and Mesa's lavapipe as its Vulkan device.

The demo models give onnxruntime's results (fp32 within 1e-5 on ocr-cls and ocr-rec, on
the CPU and on Vulkan; fp16 within the documented tolerance), converted with pnnx at
first load and cached by the ONNX file's hash and the shapes; the probe lists the Vulkan
devices with their types and counts a software one for gpu placement only when allowed;
with Vulkan hidden (``VK_ICD_FILENAMES`` naming no driver) there is no gpu kind and a
gpu load says why; every bad input is a clear load error. Inputs stay small: lavapipe
is 20-50x slower than onnxruntime.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tests.libbackends.ncnn_kit import require_ncnn, require_vulkan

from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import DeviceKind, LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend

MODELS = Path(__file__).resolve().parents[2] / "models"
RNG = np.random.default_rng(22)
REC_SHAPES = {"x": [[1, 3, 48, 160], [1, 3, 48, 320]]}


@pytest.fixture(scope="module")
def backend():  # -> NcnnBackend
    require_ncnn()
    from inferd.libbackends.ncnn_backend import NcnnBackend

    b = NcnnBackend()
    b.configure({"allow_software_vulkan": True})
    return b


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ncnn-cache")


def _model(name: str) -> Path:
    path = MODELS / name / "1" / "model.onnx"
    if not path.exists():
        pytest.fail(f"{path} missing: run make setup")
    return path


def _options(cache: Path, kind: DeviceKind = DeviceKind.CPU, **extra: object) -> LoadOptions:
    return LoadOptions(kind=kind, options={"cache_dir": str(cache), **extra})


def _compare(model: object, path: Path, x: np.ndarray, atol: float) -> float:
    reference = OnnxRuntimeCpuBackend().load(path, LoadOptions())
    want = reference.run({"x": x})
    got = model.run({"x": x})  # type: ignore[attr-defined]
    worst = 0.0
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == np.float32
        worst = max(worst, float(np.abs(got[key] - value).max()))
    assert worst <= atol, f"max difference {worst:.3g} over {atol:g}"
    reference.unload()
    return worst


def test_probe_lists_the_vulkan_devices_and_counts_software_only_when_allowed(
        backend) -> None:
    require_vulkan()
    from inferd.libbackends.ncnn_backend import NcnnBackend

    allowed = backend.probe()
    assert allowed.available and allowed.devices[0] == "cpu"
    lavapipe = [d for d in allowed.devices if "llvmpipe" in d]
    assert lavapipe and all("(software, Vulkan type cpu)" in d for d in lavapipe), \
        allowed.devices
    assert allowed.kinds == (DeviceKind.CPU, DeviceKind.GPU)
    assert "used for gpu placement ([ncnn] allow_software_vulkan = true)" in allowed.reason
    plain = NcnnBackend()
    plain.configure({})
    refused = plain.probe()
    assert refused.available and refused.devices == allowed.devices
    assert refused.kinds == (DeviceKind.CPU,)
    assert ("is a software Vulkan device, not an accelerator: not used for gpu placement "
            "unless [ncnn] allow_software_vulkan = true") in refused.reason


def test_the_probe_leaves_vulkan_out_of_this_process() -> None:
    # Creating a Vulkan instance loads the loader and lavapipe (59 MiB here): the probe
    # lists the devices in a child process.
    require_vulkan()
    code = ("from inferd.libbackends.ncnn_backend import NcnnBackend\n"
            "b = NcnnBackend(); b.configure({'allow_software_vulkan': True})\n"
            "p = b.probe()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(len(p.devices) > 1, 'libvulkan' in maps, 'lvp' in maps)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["True", "False", "False"]


def test_with_vulkan_hidden_there_is_no_gpu_kind_and_a_gpu_load_says_why(
        backend, cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    require_ncnn()
    from inferd.libbackends.ncnn_backend import NcnnBackend

    monkeypatch.setenv("VK_ICD_FILENAMES", str(tmp_path / "no-such-icd.json"))
    hidden = NcnnBackend()
    hidden.configure({"allow_software_vulkan": True})
    probe = hidden.probe()
    assert probe.available and probe.devices == ("cpu",) and probe.kinds == (DeviceKind.CPU,)
    assert probe.reason == (f"gpu placement off: no Vulkan driver answered "
                            f"(VK_ICD_FILENAMES={tmp_path / 'no-such-icd.json'})")
    # this process already made its Vulkan instance (or not): a fresh one decides
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from inferd.libbackends.ncnn_backend import NcnnBackend\n"
            "from inferd.libbackends.contract import DeviceKind, LoadOptions\n"
            "from inferd.ipc.errors import InferdError\n"
            "b = NcnnBackend(); b.configure({'allow_software_vulkan': True})\n"
            "try:\n"
            f"    b.load(Path({str(_model('ocr-cls'))!r}), LoadOptions(kind=DeviceKind.GPU, "
            f"options={{'cache_dir': {str(cache)!r}}}))\n"
            "except InferdError as e:\n"
            "    print(e.code, e.message)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert out.startswith("UNAVAILABLE ncnn: no Vulkan device for gpu placement: no "
                          "Vulkan driver answered"), out


@pytest.mark.slow
@pytest.mark.parametrize("kind", [DeviceKind.CPU, DeviceKind.GPU])
def test_cls_and_rec_in_fp32_are_within_1e_5_of_onnxruntime(
        backend, cache: Path, kind: DeviceKind) -> None:
    if kind is DeviceKind.GPU:
        require_vulkan()
    cls = backend.load(_model("ocr-cls"), _options(cache, kind))
    rec = backend.load(_model("ocr-rec"), _options(cache, kind, input_shapes=REC_SHAPES))
    try:
        where = "vulkan:0 llvmpipe" if kind is DeviceKind.GPU else "cpu"
        assert cls.device.startswith(where) and rec.device.startswith(where)
        # the ONNX model's names, dtypes and shapes, batch axis included
        assert [(s.name, s.dtype, s.shape) for s in cls.inputs] == \
            [("x", "float32", (None, 3, None, None))]
        assert [(s.name, s.shape) for s in rec.outputs] == \
            [("softmax_11.tmp_0", (None, None, 6625))]
        _compare(cls, _model("ocr-cls"), RNG.random((3, 3, 48, 192), dtype=np.float32), 1e-5)
        rows = 2 if kind is DeviceKind.CPU else 1
        _compare(rec, _model("ocr-rec"), RNG.random((rows, 3, 48, 160), dtype=np.float32),
                 1e-5)
    finally:
        cls.unload()
        rec.unload()


@pytest.mark.slow
def test_det_on_the_cpu_matches_onnxruntime(backend, cache: Path) -> None:
    det = backend.load(_model("ocr-det"), _options(cache))
    try:
        assert [(s.name, s.shape) for s in det.outputs] == \
            [("sigmoid_0.tmp_0", (None, 1, None, None))]
        _compare(det, _model("ocr-det"), RNG.random((1, 3, 96, 128), dtype=np.float32), 1e-5)
    finally:
        det.unload()


def test_a_pool_per_run_and_the_direct_convolution_match_onnxruntime(
        backend, cache: Path) -> None:
    """``memory_pool = "run"`` (each row's buffers in pools of its own, freed when the
    row ends), with and without winograd and sgemm: the same results, batches included
    (a row's pools must not be freed under the next row), run after run."""
    det = backend.load(_model("ocr-det"), _options(cache, memory_pool="run", winograd=False,
                                                   sgemm=False))
    cls = backend.load(_model("ocr-cls"), _options(cache, memory_pool="run"))
    try:
        for _ in range(2):
            _compare(det, _model("ocr-det"), RNG.random((2, 3, 64, 96), dtype=np.float32),
                     1e-5)
            _compare(cls, _model("ocr-cls"), RNG.random((3, 3, 48, 192), dtype=np.float32),
                     1e-5)
    finally:
        det.unload()
        cls.unload()


@pytest.mark.slow
def test_a_trace_that_crashes_pnnx_says_which_shapes_and_what_to_give(
        backend, tmp_path: Path) -> None:
    """ocr-rec's height and width are free in its ONNX file: traced at the default
    320x320 a Reshape that needs height 48 fails inside pnnx (a crash); the message
    names the shapes and the model.toml key, without pnnx's colour codes."""
    with pytest.raises(InferdError) as info:
        backend.load(_model("ocr-rec"), _options(tmp_path))
    message = info.value.message
    assert info.value.code is ErrorCode.INTERNAL
    assert "pnnx cannot convert " in message and "\x1b" not in message, message
    assert "traced at input shapes [1,3,320,320] and [1,3,640,640]: " in message, message
    assert message.endswith("converts with them in model.toml [ncnn] input_shapes "
                            "(docs/backends.md)"), message


RUN_POOL_CHILD = """
import ctypes, sys
import numpy as np
from inferd.libbackends.contract import DeviceKind, LoadOptions
from inferd.libbackends.ncnn_backend import NcnnBackend
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
model = NcnnBackend().load(__import__("pathlib").Path(sys.argv[1]), LoadOptions(
    kind=DeviceKind.CPU, options={"cache_dir": sys.argv[2], "memory_pool": sys.argv[3]}))
x = np.random.default_rng(1).random((1, 3, 640, 640), dtype=np.float32)
before = rss()
for _ in range(3):
    model.run({"x": x})
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(before, rss())
"""


@pytest.mark.slow
def test_a_pool_per_run_gives_the_working_memory_back_when_the_run_ends(
        backend, cache: Path) -> None:
    """ocr-det at 640x640 (over 100 MiB of buffers): with ncnn's own pool
    (``memory_pool = "net"``) the net keeps them after its runs; with a pool per run
    they go back to malloc, which gives them back to the system (each side in a process
    of its own: resident sizes, no timings)."""
    kept = {}
    for pool in ("net", "run"):
        out = subprocess.run([sys.executable, "-c", RUN_POOL_CHILD, str(_model("ocr-det")),
                              str(cache), pool], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert "FATAL" not in out.stderr, out.stderr  # ncnn: a pool freed too early
        loaded, after = map(int, out.stdout.split())
        kept[pool] = after - loaded
    assert kept["net"] > 64 * 2**20 and kept["run"] < kept["net"] / 4, kept


@pytest.mark.slow
def test_fp16_on_vulkan_is_within_the_documented_tolerance(backend, cache: Path) -> None:
    # docs/backends.md: fp16 differs by up to ~2e-3 on ocr-cls's probabilities
    require_vulkan()
    model = backend.load(_model("ocr-cls"), _options(cache, DeviceKind.GPU, precision="fp16"))
    try:
        x = RNG.random((2, 3, 48, 192), dtype=np.float32)
        worst = _compare(model, _model("ocr-cls"), x, 1e-2)
        assert worst > 1e-6  # really half precision: fp32 stays under 1e-6 here
    finally:
        model.unload()


@pytest.mark.slow
def test_the_conversion_is_cached_by_the_files_hash_and_the_shapes(
        backend, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from inferd.libbackends.ncnn_convert import cache_key, file_digest

    onnx = _model("ocr-cls")
    with caplog.at_level(logging.INFO, logger="inferd.libbackends"):
        backend.load(onnx, _options(tmp_path)).unload()
        backend.load(onnx, _options(tmp_path)).unload()
        backend.load(onnx, _options(tmp_path, input_shapes={"x": [1, 3, 48, 192]})).unload()
    converted = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
    cached = [r.getMessage() for r in caplog.records if "conversion cache" in r.getMessage()]
    assert len(converted) == 2 and len(cached) == 1, (converted, cached)
    digest = file_digest(onnx)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == sorted([cache_key(digest, (((1, 3, 320, 320),), ((1, 3, 640, 640),))),
                              cache_key(digest, (((1, 3, 48, 192),),))])
    for folder in folders:
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == \
            ["model.ncnn.bin", "model.ncnn.json", "model.ncnn.param"]
    sidecar = json.loads((tmp_path / folders[0] / "model.ncnn.json").read_text())
    assert sidecar["sha256"] == digest and sidecar["inputs"][0]["name"] == "x"


def test_inputs_from_the_wire_give_the_same_results(backend, cache: Path) -> None:
    # frames from the wire are read-only and need not be aligned (docs/protocol.md)
    model = backend.load(_model("ocr-cls"), _options(cache))
    try:
        x = RNG.random((2, 3, 48, 192), dtype=np.float32)
        want = model.run({"x": x})
        unaligned = np.frombuffer(bytes(3) + x.tobytes(), np.float32, offset=3).reshape(x.shape)
        assert unaligned.ctypes.data % 4 and not unaligned.flags.writeable
        for arr in (unaligned, np.asfortranarray(x)):
            for key, value in model.run({"x": arr}).items():
                np.testing.assert_array_equal(value, want[key])
    finally:
        model.unload()


@pytest.mark.slow
def test_runs_on_vulkan_from_several_threads(backend, cache: Path) -> None:
    require_vulkan()
    model = backend.load(_model("ocr-cls"), _options(cache, DeviceKind.GPU))
    x = RNG.random((4, 3, 48, 192), dtype=np.float32)
    want = model.run({"x": x})["save_infer_model/scale_0.tmp_1"]
    errors: list[str] = []

    def work(row: int) -> None:
        for _ in range(3):
            got = model.run({"x": x[row:row + 1]})["save_infer_model/scale_0.tmp_1"]
            if not np.allclose(got, want[row:row + 1], atol=1e-6):
                errors.append(f"thread {row}: {got} != {want[row]}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model.unload()
    assert errors == []


@pytest.mark.slow
def test_ncnn_files_beside_the_onnx_are_used_without_pnnx(
        backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a board without pnnx: `inferd-convert ncnn` wrote the files on a development machine
    version = tmp_path / "ocr-cls" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(_model("ocr-cls").read_bytes())
    out = subprocess.run([sys.executable, "-m", "inferd.libbackends.rknn_convert", "ncnn",
                          str(tmp_path / "ocr-cls"), "--input-shape", "x=1,3,48,192"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["param"] == str(version / "model.ncnn.param")
    assert result["input_shapes"] == [[[1, 3, 48, 192]]]
    assert sorted(p.name for p in version.iterdir()) == \
        ["model.ncnn.bin", "model.ncnn.json", "model.ncnn.param", "model.onnx"]
    monkeypatch.setenv("INFERD_PNNX", str(tmp_path / "no-pnnx"))
    for path in (version / "model.onnx", version / "model.ncnn.param"):
        assert backend.supports(path) == (True, "")
        model = backend.load(path, _options(tmp_path / "unused-cache"))
        assert model._path == version / "model.ncnn.param"  # type: ignore[attr-defined]
        _compare(model, _model("ocr-cls"), RNG.random((1, 3, 48, 192), dtype=np.float32), 1e-5)
        model.unload()
    assert not (tmp_path / "unused-cache").exists()
    # and without them, the missing pnnx is the reason
    for name in ("model.ncnn.param", "model.ncnn.bin", "model.ncnn.json"):
        (version / name).unlink()
    with pytest.raises(InferdError) as info:
        backend.load(version / "model.onnx", _options(tmp_path / "cache"))
    assert info.value.code is ErrorCode.NOT_FOUND
    assert f"ncnn cannot convert {version / 'model.onnx'}: cannot run " in info.value.message


def _copy_converted(backend, cache: Path, dest: Path) -> Path:
    """ocr-cls converted, its three files in a version folder of its own."""
    from inferd.libbackends.ncnn_convert import BIN, PARAM, SIDECAR

    model = backend.load(_model("ocr-cls"), _options(cache))
    source = model._path.parent  # type: ignore[attr-defined]
    model.unload()
    dest.mkdir(parents=True)
    for name in (PARAM, BIN, SIDECAR):
        (dest / name).write_bytes((source / name).read_bytes())
    return dest / PARAM


def test_a_corrupt_param_is_a_clear_load_error(backend, cache: Path, tmp_path: Path) -> None:
    param = _copy_converted(backend, cache, tmp_path / "1")
    text = param.read_text()
    cases = {
        "not ncnn": ("hello\n", f"ncnn cannot load {param}: not an ncnn .param file (its "
                                f"first line is b'hello', not the magic 7767517)"),
        "truncated": (text[:3000], f"ncnn cannot load {param}: load_param failed (a corrupt "
                                   f"or truncated .param"),
        "unknown layer": (text.replace("\nConvolution ", "\nFrobnicate ", 1),
                          f"ncnn cannot load {param}: load_param failed"),
    }
    for name, (content, message) in cases.items():
        param.write_text(content)
        with pytest.raises(InferdError) as info:
            backend.load(param, _options(cache))
        assert info.value.message.startswith(message), (name, info.value.message)
    param.write_text(text)
    param.with_name("model.ncnn.bin").write_bytes(b"\0" * 100)
    with pytest.raises(InferdError) as info:
        backend.load(param, _options(cache))
    assert info.value.message.startswith(f"ncnn cannot load {param.with_name('model.ncnn.bin')}"
                                         f": load_model failed (a truncated .bin")
    param.with_name("model.ncnn.bin").unlink()
    with pytest.raises(InferdError) as info:
        backend.load(param, _options(cache))
    assert info.value.code is ErrorCode.NOT_FOUND and "its weights model.ncnn.bin are " \
        "missing" in info.value.message


def test_bad_options_and_models_are_clear_load_errors(backend, cache: Path) -> None:
    cls = _model("ocr-cls")
    cases = [
        ({"precision": "fp8"}, "model.toml [ncnn] precision = 'fp8': expected 'fp32' or "
                               "'fp16'"),
        ({"threads": 0}, "model.toml [ncnn] threads = 0: expected an integer >= 1"),
        ({"memory_pool": "arena"}, "model.toml [ncnn] memory_pool = 'arena': expected 'net' "
                                   "or 'run'"),
        ({"winograd": "no"}, "model.toml [ncnn] winograd = 'no': expected true or false"),
        ({"sgemm": 0}, "model.toml [ncnn] sgemm = 0: expected true or false"),
        ({"colour": "blue"}, "model.toml [ncnn] colour: unknown key; known keys: precision, "),
        ({"input_shapes": {"y": [1, 3, 48, 192]}}, "names inputs ['y']; the model's inputs "
                                                   "are ['x']"),
        ({"input_shapes": {"x": [2, 3, 48, 192]}}, "the batch axis must be 1"),
        ({"input_shapes": {"x": [1, 4, 48, 192]}}, "expected one or two shapes that fit the "
                                                   "model's [None, 3, None, None]"),
    ]
    for extra, message in cases:
        with pytest.raises(InferdError) as info:
            backend.load(cls, _options(cache, **extra))
        assert message in info.value.message, (extra, info.value.message)
    # VAD: int64 and scalar inputs, If and LSTM: not ncnn's
    with pytest.raises(InferdError) as info:
        backend.load(_model("vad"), _options(cache))
    assert info.value.code is ErrorCode.UNSUPPORTED
    assert "ncnn runs float32 tensors only" in info.value.message or \
        "ncnn needs a batch axis first" in info.value.message
    assert backend.supports(cls.with_name("model.rknn"))[0] is False


def test_gpu_loads_refuse_a_software_device_unless_allowed(backend, cache: Path) -> None:
    require_vulkan()
    cls = _model("ocr-cls")
    with pytest.raises(InferdError) as info:
        backend.load(cls, _options(cache, DeviceKind.GPU, allow_software_vulkan=False))
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert "ncnn: the only Vulkan devices are software ones (vulkan:0 llvmpipe" in \
        info.value.message
    with pytest.raises(InferdError) as info:
        backend.load(cls, _options(cache, DeviceKind.GPU, device=7))
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert "ncnn: no Vulkan device 7 (model.toml [ncnn] device); there are vulkan:0 " in \
        info.value.message


def test_the_placements_threads_win_over_the_ncnn_table(backend) -> None:
    """LoadOptions.threads (model.toml threads, or measured within a graph) is the
    engine's thread count; without it the [ncnn] table's (default 1)."""
    assert backend._settings(LoadOptions(threads=3, options={"threads": 2}))["threads"] == 3
    assert backend._settings(LoadOptions(options={"threads": 2}))["threads"] == 2
    assert backend._settings(LoadOptions())["threads"] == 1
def test_ncnns_threads_run_on_the_cores_of_the_thread_that_runs_the_model(
        backend, cache: Path) -> None:
    # the daemon pins a model's infer threads (model.toml cpu_affinity); ncnn's OpenMP
    # threads are started from them and must keep to those cores
    import os

    model = backend.load(_model("ocr-cls"), _options(cache, threads=2))
    core = max(os.sched_getaffinity(0))
    before = set(os.listdir("/proc/self/task"))
    seen: dict[str, str] = {}

    def work() -> None:
        os.sched_setaffinity(threading.get_native_id(), {core})
        model.run({"x": RNG.random((1, 3, 48, 192), dtype=np.float32)})
        for tid in set(os.listdir("/proc/self/task")) - before:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
            seen[tid] = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                             if line.startswith("Cpus_allowed_list"))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    model.unload()
    assert len(seen) >= 2, seen  # the runner and at least one OpenMP thread
    assert set(seen.values()) == {str(core)}, seen
