"""The ctypes side of the C ABI: version rule, the child's report, and the C example
driven directly through NativeBackend/NativeModel."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc.errors import BackendError, ErrorCode, InferdError
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.childprobe import _REPORT, _interpret, probe_in_children
from inferd.libbackends.native import open_native, version_problem
from inferd.libbackends.registry import CandidateError, Stage
from tests.libbackends.plugin_kit import expected_relu_sigmoid


@pytest.mark.parametrize("major, minor, ok", [(1, 0, True), (0, 9, False), (2, 0, False),
                                              (1, 1, False)])
def test_version_rule(major: int, minor: int, ok: bool) -> None:
    assert (version_problem(major, minor) is None) is ok


def _steps(*steps: tuple[str, str]) -> bytes:
    return b"".join(f'{_REPORT}{{"doing": "{d}", "stage": "{s}"}}\n'.encode()
                    for d, s in steps)


def test_a_crash_is_reported_at_the_stage_it_happened() -> None:
    out = _steps(("dlopen()", "opened"), ("probe()", "probed"))
    report = _interpret(out, b"free(): invalid pointer\n", -signal.SIGABRT, False, 5)
    assert (report.ok, report.stage) == (False, Stage.PROBED)
    assert report.reason == ("crashed with SIGABRT while calling probe() "
                             "(free(): invalid pointer)")


def test_a_hang_and_an_exit_are_reported() -> None:
    out = _steps(("dlopen()", "opened"))
    assert _interpret(out, b"", -9, True, 2.5).reason == \
        "hung: no answer within 2.5 s while calling dlopen()"
    assert _interpret(out, b"", 3, False, 5).reason == \
        "probe process exited with status 3 while calling dlopen()"
    # A plugin printing to stdout does not confuse the report.
    assert _interpret(b"hello from the plugin\n" + out, b"", 3, False, 5).stage is Stage.OPENED


def test_a_missing_file_fails_at_opened(tmp_path: Path) -> None:
    with pytest.raises(CandidateError) as info:
        open_native(tmp_path / "libnone_backend.so")
    assert info.value.stage is Stage.OPENED
    assert "dlopen failed" in info.value.reason


def test_a_child_reports_the_example(elementwise_so: Path) -> None:
    [report] = probe_in_children([elementwise_so], 30).values()
    assert report.ok
    assert {k: report.info[k] for k in ("id", "kind", "available", "devices")} == \
        {"id": "elementwise-c", "kind": "cpu", "available": True, "devices": ["cpu"]}


@pytest.fixture
def model(elementwise_so: Path, elementwise_model: Path):  # type: ignore[no-untyped-def]
    backend = open_native(elementwise_so)
    m = backend.load(elementwise_model, LoadOptions())
    yield m
    m.unload()


def test_empty_and_large_batches(model) -> None:  # type: ignore[no-untyped-def]
    empty = np.zeros((0, 4), np.float32)
    assert model.run({"x": empty})["y"].shape == (0, 4)
    x = np.random.default_rng(1).standard_normal((4096, 4)).astype(np.float32)
    np.testing.assert_allclose(model.run({"x": x})["y"], expected_relu_sigmoid(x), rtol=1e-6)


def test_a_non_contiguous_input_is_copied(model) -> None:  # type: ignore[no-untyped-def]
    x = np.arange(32, dtype=np.float32).reshape(8, 4)[::2] - 10
    np.testing.assert_allclose(model.run({"x": x})["y"], expected_relu_sigmoid(x), rtol=1e-6)


def test_unknown_output_and_run_after_unload(model) -> None:  # type: ignore[no-untyped-def]
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(InferdError):
        model.run({"x": x}, ["nope"])
    model.unload()
    with pytest.raises(BackendError) as info:
        model.run({"x": x})
    assert info.value.code is ErrorCode.UNAVAILABLE


def test_load_failure_carries_the_plugins_code_and_message(elementwise_so: Path) -> None:
    backend = open_native(elementwise_so)
    with pytest.raises(InferdError) as info:
        backend.load(Path("/nonexistent/model.onnx"), LoadOptions())
    assert info.value.code is ErrorCode.NOT_FOUND
    assert "cannot open /nonexistent/model.onnx: No such file or directory" in \
        info.value.message
