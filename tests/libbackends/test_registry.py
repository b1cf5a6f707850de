"""The registry: duplicate ids, the troubleshooting view, and the choice of a backend per
model with every skipped choice logged. The backends here are small real Backend
classes written for the test (no device is involved in choosing)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inferd.ipc.errors import BackendError, ErrorCode
from inferd.libbackends.contract import Backend, DeviceKind, LoadedModel, LoadOptions, Probe
from inferd.libbackends.registry import Candidate, Form, Registry, Status


class Fixed(Backend):
    """A backend whose probe and supports answers are fixed at construction."""

    version = "1"

    def __init__(self, ident: str, kind: DeviceKind, available: bool = True,
                 supports: bool = True) -> None:
        self.id, self.kind = ident, kind
        self._available, self._supports = available, supports

    def probe(self) -> Probe:
        return Probe(True, devices=(f"{self.kind}0",)) if self._available else \
            Probe(False, f"{self.id}: no device")

    def supports(self, model_path: Path) -> tuple[bool, str]:
        return (True, "") if self._supports else (False, "op Foo not supported")

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        raise NotImplementedError


@pytest.fixture
def registry() -> Registry:
    r = Registry()
    r.register(Fixed("cpu-a", DeviceKind.CPU), "built-in")
    r.register(Fixed("gpu-a", DeviceKind.GPU, supports=False), "/p/gpu.py")
    r.register(Fixed("npu-a", DeviceKind.NPU, available=False), "/p/libnpu_backend.so")
    return r


def test_status_and_devices_are_recorded(registry: Registry) -> None:
    by_id = {b["id"]: b for b in registry.describe()}
    assert by_id["cpu-a"]["status"] == "registered"
    assert by_id["cpu-a"]["devices"] == ["cpu0"]
    assert (by_id["npu-a"]["status"], by_id["npu-a"]["reason"]) == \
        ("unavailable", "npu-a: no device")
    assert [b.id for b in registry.available()] == ["cpu-a", "gpu-a"]


def test_a_taken_id_is_refused_naming_its_owner(registry: Registry) -> None:
    with pytest.raises(BackendError) as info:
        registry.register(Fixed("cpu-a", DeviceKind.CPU), "/p/other.py")
    assert info.value.message == "id 'cpu-a' already registered by built-in"
    assert registry.records["cpu-a"].source == "built-in"


def test_default_choice_passes_over_what_cannot_run_and_logs_why(
        registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="inferd.libbackends.registry"):
        assert registry.choose("m", Path("m.onnx")).id == "cpu-a"
    skipped = [r for r in caplog.records if "passed over" in r.getMessage()]
    assert [(r.BACKEND, r.MODEL) for r in skipped] == [("npu-a", "m"), ("gpu-a", "m")]
    assert "unavailable (npu-a: no device)" in skipped[0].getMessage()
    assert "does not support the model (op Foo not supported)" in skipped[1].getMessage()
    assert "model m: backend cpu-a chosen" in caplog.text


def test_preference_by_id_and_kind(registry: Registry,
                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert registry.choose("m", Path("m.onnx"), ["tpu", "npu", "cpu-a"]).id == "cpu-a"
    assert "passed over backend tpu: no such backend id or kind (backends: cpu-a, " \
           "gpu-a, npu-a)" in caplog.text


def test_no_backend_can_run_it(registry: Registry) -> None:
    with pytest.raises(BackendError) as info:
        registry.choose("m", Path("m.onnx"), ["npu", "gpu"])
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert info.value.message == (
        "model m: no backend can run it (preference ['npu', 'gpu']): npu-a: unavailable "
        "(npu-a: no device); gpu-a: does not support the model (op Foo not supported)")


def test_a_supports_that_raises_is_a_reason_not_a_crash() -> None:
    class Raises(Fixed):
        def supports(self, model_path: Path) -> tuple[bool, str]:
            raise RuntimeError("bug")

    r = Registry()
    r.register(Raises("bad", DeviceKind.CPU))
    r.register(Fixed("good", DeviceKind.CPU))
    assert r.choose("m", Path("m.onnx"), ["cpu"]).id == "good"


def test_view_holds_backends_candidates_and_search_path(registry: Registry) -> None:
    registry.candidates.append(Candidate("/p/x.py", Form.PYTHON, reason="boom"))
    registry.search_path, registry.search_path_source = ["/p"], "default"
    view = registry.view()
    assert set(view) == {"backends", "candidates", "search_path", "search_path_source"}
    assert view["candidates"] == [{"path": "/p/x.py", "form": "python", "stage": "found",
                                   "status": "failed", "reason": "boom", "backend": None}]
    assert registry.records["npu-a"].status is Status.UNAVAILABLE
