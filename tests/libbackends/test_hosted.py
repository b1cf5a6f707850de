"""Out-of-process backends: the proxy (libbackends/hosted.py) and real backend host
processes (libbackends/host.py), here running a test backend
(tests/libbackends/plugins/hosted_target.py) in this interpreter. Its crashes, hangs and
exits are real ones, of a real host process; each must come back as a clear reason
through the same path a failing plugin takes, and the model must serve again after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from tests.libbackends.plugin_kit import expected_relu_sigmoid

from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.libbackends.contract import DeviceKind, LoadOptions
from inferd.libbackends.hosted import HostedBackend, HostedModel, HostError, HostSpec
from inferd.libbackends.loader import Loader
from inferd.libbackends.registry import CandidateStatus, Registry

TARGET = Path(__file__).resolve().parent / "plugins" / "hosted_target.py"
X = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)


def backend(**spec: object) -> HostedBackend:
    fields: dict = {"python": sys.executable, "target": f"{TARGET}:create_backend", **spec}
    return HostedBackend("hosted-test", DeviceKind.CPU, "unprobed", HostSpec(**fields))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive either
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.slow
def test_probe_load_run_unload_through_a_host(elementwise_model: Path) -> None:
    b = backend()
    probe = b.probe()
    assert probe.available and probe.devices == ("cpu",)
    assert b.version == "0.1"  # the host's own backend version replaces "unprobed"
    assert b.supports(elementwise_model) == (True, "")
    assert b.supports(elementwise_model.with_suffix(".txt"))[0] is False
    model = b.load(elementwise_model, LoadOptions())
    assert isinstance(model, HostedModel)
    pid = model.host_pid
    assert pid is not None and pid != os.getpid() and alive(pid)
    assert [(s.name, s.dtype, s.shape) for s in model.inputs] == [("x", "float32", (None, 4))]
    assert model.device == "test cpu 0"  # what the hosted model says it runs on
    out = model.run({"x": X})
    np.testing.assert_allclose(out["y"], expected_relu_sigmoid(X), rtol=1e-6)
    assert model.memory_bytes() and model.memory_bytes() > 1 << 20  # the host's RSS
    model.unload()
    assert not alive(pid)


def test_a_model_error_in_the_host_keeps_its_code_and_the_host(elementwise_model: Path,
                                                                tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    with pytest.raises(ModelError) as info:
        backend().load(bad, LoadOptions())
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and str(bad) in info.value.message


def test_missing_interpreter_is_an_unavailable_backend(tmp_path: Path,
                                                       elementwise_model: Path) -> None:
    b = backend(python=str(tmp_path / "venv-absent" / "bin" / "python"))
    probe = b.probe()
    assert not probe.available
    assert f"host interpreter {tmp_path}/venv-absent/bin/python not found" in probe.reason
    with pytest.raises(HostError, match="not found"):
        b.load(elementwise_model, LoadOptions())
    # Through the loader, like any plugin: registered, unavailable, with the reason.
    plugins = tmp_path / "backends"
    plugins.mkdir()
    (plugins / "hosted.py").write_text(textwrap.dedent(f"""
        from inferd.libbackends.contract import DeviceKind
        from inferd.libbackends.hosted import HostedBackend, HostSpec
        def create_backend():
            return HostedBackend("hosted-test", DeviceKind.CPU, "0",
                                 HostSpec("/nonexistent/bin/python", "{TARGET}:create_backend"))
        """))
    registry = Registry()
    Loader(registry, builtins=()).load([plugins])
    [c] = registry.candidates
    assert c.status is CandidateStatus.UNAVAILABLE and c.stage == "probed"
    assert "host interpreter /nonexistent/bin/python not found" in c.reason


@pytest.mark.slow
def test_a_factory_that_raises_in_the_host_is_the_probe_reason() -> None:
    probe = backend(env={"HOSTED_TEST_FAIL": "factory"}).probe()
    assert not probe.available
    assert "RuntimeError: licence server unreachable" in probe.reason
    probe = backend(env={"HOSTED_TEST_FAIL": "probe"}).probe()
    assert (probe.available, probe.reason) == (False, "no device node /dev/hosted-test0")


@pytest.mark.slow
@pytest.mark.parametrize("value, code, words", [
    (1001, ErrorCode.UNAVAILABLE, "was killed by SIGSEGV during run"),
    pytest.param(1002, ErrorCode.DEADLINE_EXCEEDED, "hung: no answer within 1 s to run; "
                 "killed", marks=pytest.mark.slow),
    pytest.param(1003, ErrorCode.UNAVAILABLE, "exited with status 3 during run",
                 marks=pytest.mark.slow),
])
def test_a_host_that_dies_mid_run_fails_that_run_and_the_next_one_serves(
        elementwise_model: Path, value: int, code: ErrorCode, words: str) -> None:
    model = backend(run_timeout_s=1.0).load(elementwise_model, LoadOptions())
    first = model.host_pid
    assert first is not None
    with pytest.raises(HostError) as info:
        model.run({"x": np.full((1, 4), value, np.float32)})
    assert info.value.code is code
    assert words in info.value.message and "the next run starts a new host" in \
        info.value.message
    assert not alive(first)
    out = model.run({"x": X})  # a new host, the model loaded again
    np.testing.assert_allclose(out["y"], expected_relu_sigmoid(X), rtol=1e-6)
    assert model.host_pid not in (None, first)
    model.unload()


@pytest.mark.slow
def test_restarts_are_bounded(elementwise_model: Path) -> None:
    model = backend(max_restarts=1).load(elementwise_model, LoadOptions())
    crash = {"x": np.full((1, 4), 1001, np.float32)}
    with pytest.raises(HostError):
        model.run(crash)
    with pytest.raises(HostError):
        model.run(crash)  # restart 1 of 1, then crashes again
    with pytest.raises(HostError, match="died 2 times .*not restarted again"):
        model.run({"x": X})
    model.unload()


@pytest.mark.slow
def test_a_crash_during_load_is_a_load_error(elementwise_model: Path) -> None:
    with pytest.raises(InferdError, match="was killed by SIGSEGV during load"):
        backend().load(elementwise_model, LoadOptions(options={"crash_on_load": True}))


@pytest.mark.slow
def test_the_host_ends_when_the_daemon_dies(elementwise_model: Path, tmp_path: Path) -> None:
    # A stand-in daemon process loads a model in a host, prints the host's pid and dies
    # without unloading (os._exit): the host must not outlive it.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.libbackends.test_hosted import backend
        from inferd.libbackends.contract import LoadOptions
        from pathlib import Path
        m = backend().load(Path({str(elementwise_model)!r}), LoadOptions())
        print(m.host_pid, flush=True)
        os._exit(0)
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the host outlived the process that started it"


@pytest.mark.slow
def test_the_host_imports_only_what_it_needs(tmp_path: Path) -> None:
    # The host's interpreter is another venv: the host module and the bootstrap must not
    # pull in the daemon's dependencies (onnx, onnxruntime, psutil) or its other parts.
    from inferd.libbackends.hosted import bootstrap_command

    (tmp_path / "list_modules.py").write_text(
        "import json, sys\n"
        "def main():\n"
        "    import inferd.libbackends.host\n"
        "    print(json.dumps(sorted(sys.modules)))\n"
        "    return 0\n")
    proc = subprocess.run(bootstrap_command(sys.executable, (str(tmp_path),),
                                            "list_modules:main"),
                          capture_output=True, text=True, timeout=60, check=True)
    modules = set(json.loads(proc.stdout))
    assert {"zmq", "numpy", "inferd.ipc.protocol", "inferd.libbackends.host"} <= modules
    heavy = {"onnx", "onnxruntime", "psutil", "inferd.ipc.client", "inferd.daemon",
             "inferd.libbackends.contract", "inferd.libbackends.loader"} & modules
    assert not heavy, f"the host imports {sorted(heavy)}"
