"""One contract suite, stamped onto every backend: the built-in onnxruntime, OpenVINO
(its CPU device) and onnxruntime-gpu, the Python example
(examples/backends/onnx_reference.py), the C example (examples/backends/elementwise,
compiled with gcc by its Makefile during the test) and the rknn backend in simulator
mode (out of process, in the .venv-rknn interpreter; marked slow and rknn, skipped
without that venv unless INFERD_TEST_RKNN=1), and ncnn (its plugin,
packaging/backends/ncnn) on the CPU and on Vulkan (lavapipe here; skipped without ncnn,
pnnx or a Vulkan device unless INFERD_TEST_VULKAN=1).

Each backend is obtained the way the daemon gets it: through the loader, from a
backends directory holding only that plugin (the built-ins from no directory at all).
onnxruntime-gpu runs only where its probe finds a usable GPU (bench/device_check.sh on
an NVIDIA machine, which sets INFERD_REQUIRE_GPU=1 to make the skip a failure); here
tests/libbackends/test_onnxruntime_gpu.py tests it up to the hardware boundary.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tests.libbackends import ncnn_kit
from tests.libbackends.plugin_kit import copy_into, expected_relu_sigmoid
from tests.libbackends.rknn_kit import install_plugin, simulator_python

from inferd.ipc.errors import InferdError
from inferd.libbackends.contract import (
    API_VERSION, Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)
from inferd.libbackends.loader import BUILTINS, Loader
from inferd.libbackends.registry import CandidateStatus, Registry

BACKENDS = ["onnxruntime", "openvino", "onnxruntime-gpu", "onnx-reference", "elementwise-c",
            pytest.param("rknn", marks=[pytest.mark.slow, pytest.mark.rknn]),
            "ncnn", "ncnn-vulkan"]
# Relative tolerance of each backend's results (the RKNN simulator computes in fp16).
RTOL = {"rknn": 2e-3}
BUILT_IN = {"onnxruntime", "openvino", "onnxruntime-gpu"}


def close(backend: Backend, got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.allclose(got, want, rtol=RTOL.get(backend.id, 1e-6),
                            atol=RTOL.get(backend.id, 0)))


@pytest.fixture(scope="session")
def rknn_simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """The rknn plugin through the loader, once per session (its probe imports
    rknn-toolkit2 in a host: seconds)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("INFERD_RKNN_PYTHON", simulator_python())
    backends = tmp_path_factory.mktemp("rknn-backends")
    install_plugin(backends)
    registry = Registry()
    Loader(registry, builtins=()).load([backends])
    [candidate] = registry.candidates
    assert candidate.status is CandidateStatus.REGISTERED, candidate
    yield registry.records["rknn"].backend
    mp.undo()


class Placed(Backend):
    """A backend whose loads get what the daemon's placement gives them: the device
    kind chosen and the config file's section (here ncnn's conversion cache)."""

    def __init__(self, backend: Backend, kind: DeviceKind, options: dict[str, object]
                 ) -> None:
        self._backend = backend
        self._kind = kind
        self._options = options
        self.id, self.version, self.kind = backend.id, backend.version, backend.kind
        self.api_version = backend.api_version

    def probe(self) -> Probe:
        return self._backend.probe()

    def supports(self, model_path: Path) -> tuple[bool, str]:
        return self._backend.supports(model_path)

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        return self._backend.load(model_path, LoadOptions(
            options={**self._options, **options.options}, kind=options.kind or self._kind))


@pytest.fixture(scope="session")
def ncnn_plugin(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    """The ncnn plugin through the loader, with software Vulkan allowed (as CI's config
    says), once per session."""
    ncnn_kit.require_vulkan()
    backends = tmp_path_factory.mktemp("ncnn-backends")
    ncnn_kit.install_plugin(backends)
    registry = Registry()
    Loader(registry, builtins=(),
           settings={"ncnn": {"allow_software_vulkan": True}}).load([backends])
    [candidate] = registry.candidates
    assert candidate.status is CandidateStatus.REGISTERED, candidate
    assert DeviceKind.GPU in registry.records["ncnn"].kinds
    return registry.records["ncnn"].backend


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Backend:
    """Each backend through the loader once for the module's tests, as the daemon holds
    one instance of each for all its loads (a load through the loader probes the
    plugin in a child process: 1-2 s a test when each test loaded its own)."""
    ident = request.param
    if ident == "rknn":
        return request.getfixturevalue("rknn_simulator")
    if ident.startswith("ncnn"):
        cache = str(tmp_path_factory.getbasetemp() / "ncnn-cache")
        return Placed(request.getfixturevalue("ncnn_plugin"),
                      DeviceKind.GPU if ident == "ncnn-vulkan" else DeviceKind.CPU,
                      {"cache_dir": cache})
    registry = Registry()
    if ident in BUILT_IN:
        Loader(registry, builtins=[b for b in BUILTINS if b.name == ident]).load([])
        [candidate] = registry.candidates
        if ident == "onnxruntime-gpu" and candidate.status is CandidateStatus.UNAVAILABLE \
                and not os.environ.get("INFERD_REQUIRE_GPU"):
            pytest.skip(f"no usable NVIDIA GPU here: {candidate.reason}")
    else:
        src = (request.getfixturevalue("python_example") if ident == "onnx-reference"
               else request.getfixturevalue("elementwise_so"))
        backends = tmp_path_factory.mktemp("backends")
        copy_into(src, backends)
        Loader(registry, builtins=()).load([backends])
    [candidate] = [c for c in registry.candidates if c.backend == ident]
    assert candidate.status is CandidateStatus.REGISTERED, candidate
    return registry.records[ident].backend


def test_identity(backend: Backend) -> None:
    assert isinstance(backend.id, str) and backend.id
    assert isinstance(backend.version, str) and backend.version
    assert backend.kind in set(DeviceKind)
    major, minor = backend.api_version
    assert major == API_VERSION[0] and minor <= API_VERSION[1]


def test_probe_finds_the_cpu(backend: Backend) -> None:
    probe = backend.probe()
    assert isinstance(probe, Probe)
    assert probe.available, probe.reason
    assert probe.devices and all(isinstance(d, str) and d for d in probe.devices)


def test_supports_the_test_model(backend: Backend, elementwise_model: Path) -> None:
    assert backend.supports(elementwise_model) == (True, "")


def test_refuses_a_file_that_is_no_model_with_a_reason(backend: Backend,
                                                       tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    ok, why = backend.supports(text)
    assert not ok and why


def test_load_describes_inputs_and_outputs(backend: Backend,
                                           elementwise_model: Path) -> None:
    model = backend.load(elementwise_model, LoadOptions())
    try:
        assert isinstance(model, LoadedModel)
        assert [(s.name, s.dtype, len(s.shape)) for s in model.inputs] == \
            [("x", "float32", 2)]
        assert [(s.name, s.dtype, len(s.shape)) for s in model.outputs] == \
            [("y", "float32", 2)]
        assert all(isinstance(s, TensorSpec) for s in model.inputs + model.outputs)
        assert model.inputs[0].shape[1] == 4
        mem = model.memory_bytes()
        assert mem is None or (isinstance(mem, int) and mem >= 0)
    finally:
        model.unload()


def test_run_computes_the_model(backend: Backend, elementwise_model: Path) -> None:
    model = backend.load(elementwise_model, LoadOptions())
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    try:
        out = model.run({"x": x})
        assert list(out) == ["y"]
        assert out["y"].dtype == np.float32 and out["y"].shape == (3, 4)
        assert close(backend, out["y"], expected_relu_sigmoid(x))
        assert list(model.run({"x": x}, ["y"])) == ["y"]
    finally:
        model.unload()


def test_two_loads_are_independent(backend: Backend, elementwise_model: Path) -> None:
    a = backend.load(elementwise_model, LoadOptions())
    b = backend.load(elementwise_model, LoadOptions())
    a.unload()
    x = np.ones((1, 4), np.float32)
    assert close(backend, b.run({"x": x})["y"], expected_relu_sigmoid(x))
    b.unload()


def test_runs_from_several_threads(backend: Backend, elementwise_model: Path) -> None:
    model = backend.load(elementwise_model, LoadOptions())
    errors: list[str] = []

    def work(seed: int) -> None:
        x = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
        for _ in range(20):
            y = model.run({"x": x})["y"]
            if not close(backend, y, expected_relu_sigmoid(x)):
                errors.append(f"thread {seed}: wrong result")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model.unload()
    assert errors == []


def test_load_of_a_broken_file_raises_an_inferd_error(backend: Backend,
                                                      tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a model")
    with pytest.raises(InferdError) as info:
        backend.load(bad, LoadOptions())
    assert str(bad) in info.value.message


def test_builtins_are_the_ones_the_suite_covers() -> None:
    # A new built-in backend must be added to BACKENDS above.
    names = {b if isinstance(b, str) else b.values[0] for b in BACKENDS}
    assert {b.name for b in BUILTINS} <= names
