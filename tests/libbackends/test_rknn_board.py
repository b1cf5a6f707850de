"""The rknn backend's board mode and its model.toml checks, in this process.

A stand-in: no RK35xx NPU, no /usr/lib/librknnrt.so and no aarch64 RKNNLite can exist on
this x86 machine, so these tests put a recording fake ``rknnlite.api.RKNNLite`` on
sys.path and pretend to be an aarch64 RK3588 board. What they check is inferd's side:
which core mask reaches ``init_runtime``, which file is loaded, the tensors read from
the sidecar, the row-by-row runs, and every reason. The real RKNNLite runs only on a
board; the simulator mode runs for real in tests/e2e/test_rknn.py.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.ipc.errors import ModelError
from inferd.libbackends import rknn
from inferd.libbackends.contract import LoadOptions


class FakeRKNNLite:
    """Records the calls the backend makes; 'infers' x * 2 per input row."""

    calls: list[tuple[str, Any]] = []

    def __init__(self, verbose: bool = False) -> None:
        pass

    def load_rknn(self, path: str) -> int:
        self.calls.append(("load_rknn", path))
        return 0

    def init_runtime(self, core_mask: int = 0) -> int:
        self.calls.append(("init_runtime", core_mask))
        return 0

    def inference(self, inputs: list[np.ndarray], data_format: list[str]) -> list[Any]:
        self.calls.append(("inference", (inputs[0].shape, tuple(data_format))))
        return [inputs[0].reshape(inputs[0].shape[0], -1)[:, :2] * 2]

    def release(self) -> None:
        self.calls.append(("release", None))


@pytest.fixture
def board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An aarch64 RK3588 'board' with a fake RKNNLite and librknnrt.so."""
    lib = tmp_path / "librknnrt.so"
    lib.write_bytes(b"")
    api = types.ModuleType("rknnlite.api")
    api.RKNNLite = FakeRKNNLite  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rknnlite", types.ModuleType("rknnlite"))
    monkeypatch.setitem(sys.modules, "rknnlite.api", api)
    monkeypatch.setattr(rknn, "LIBRKNNRT", lib)
    monkeypatch.setattr(rknn.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(rknn, "board_soc", lambda: "rk3588")
    FakeRKNNLite.calls = []
    version = tmp_path / "models" / "cls" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"onnx")
    return version


def converted(version: Path) -> None:
    (version / "model.rknn").write_bytes(b"RKNN")
    (version / "model.rknn.json").write_text(json.dumps({
        "rowwise": True,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 3, 48, 192]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [None, 2]}]}))


def test_board_probe_lists_the_npu_cores(board: Path) -> None:
    b = rknn.RknnBackend()
    assert b.mode == "board"
    assert b.probe().devices == ("npu core 0", "npu core 1", "npu core 2")


def test_board_without_librknnrt_says_so(board: Path, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setattr(rknn, "LIBRKNNRT", tmp_path / "absent" / "librknnrt.so")
    probe = rknn.RknnBackend().probe()
    assert not probe.available
    assert probe.reason.startswith(f"{tmp_path}/absent/librknnrt.so not found: the NPU "
                                   f"runtime library comes with the board vendor's image")


def test_board_without_rknnlite_says_what_to_install(board: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # the Debian package does not vendor RKNNLite (Rockchip's licence): the reason
    # names where it comes from; None in sys.modules makes the import fail for real
    monkeypatch.setitem(sys.modules, "rknnlite", None)
    monkeypatch.setitem(sys.modules, "rknnlite.api", None)
    probe = rknn.RknnBackend().probe()
    assert not probe.available
    assert "rknn-toolkit-lite2 does not import" in probe.reason
    assert f"pip install rknn-toolkit-lite2` for {sys.executable}" in probe.reason
    assert "board vendor's image" in probe.reason


def test_board_passes_over_a_model_without_model_rknn(board: Path) -> None:
    ok, why = rknn.RknnBackend().supports(board / "model.onnx")
    assert not ok and "no model.rknn beside model.onnx" in why and "inferd-convert rknn" in why
    with pytest.raises(ModelError, match="model.rknn not found"):
        rknn.RknnBackend().load(board / "model.onnx", LoadOptions())


@pytest.mark.parametrize("mask, value", [("auto", 0), ("0", 1), ("1", 2), ("2", 4),
                                         ("0_1", 3), ("0_1_2", 7), (1, 2)])
def test_core_mask_reaches_init_runtime(board: Path, mask: Any, value: int) -> None:
    converted(board)
    model = rknn.RknnBackend().load(board / "model.onnx",
                                    LoadOptions(options={"core_mask": mask}))
    assert ("load_rknn", str(board / "model.rknn")) in FakeRKNNLite.calls
    assert ("init_runtime", value) in FakeRKNNLite.calls
    assert model.device == f"npu core {mask}"  # type: ignore[attr-defined]
    assert [(s.name, s.shape) for s in model.inputs] == [("x", (None, 3, 48, 192))]
    x = np.arange(3 * 3 * 48 * 192, dtype=np.float32).reshape(3, 3, 48, 192)
    y = model.run({"x": x})["y"]
    # three rows, each its own inference, in NCHW
    runs = [c for c in FakeRKNNLite.calls if c[0] == "inference"]
    assert runs == [("inference", ((1, 3, 48, 192), ("nchw",)))] * 3
    np.testing.assert_array_equal(y, x.reshape(3, -1)[:, :2] * 2)
    model.unload()
    assert FakeRKNNLite.calls[-1] == ("release", None)


def test_a_missing_sidecar_is_a_load_error(board: Path) -> None:
    converted(board)
    (board / "model.rknn.json").unlink()
    with pytest.raises(ModelError, match="model.rknn.json is missing or unreadable"):
        rknn.RknnBackend().load(board / "model.onnx", LoadOptions())


@pytest.mark.parametrize("options, words", [
    ({"core_mask": "3"}, "core_mask = '3': expected one of 'auto', '0', '1', '2', '0_1'"),
    ({"core_mask": "0_1", "target_platform": "rk3568"},
     "core_mask = '0_1': rk3568 has 1 NPU core(s) (0..0)"),
    ({"target_platform": "rk9999"}, "target_platform = 'rk9999': expected one of rk3588"),
    ({"cores": 2}, "has unknown keys ['cores']; known: core_mask, target_platform"),
    ({"input_shapes": {"x": [1, -3]}}, "input_shapes must be a table of input name"),
    ({"core_mask": True}, "core_mask = True: expected one of"),
])
def test_bad_rknn_tables_name_the_model_toml_key(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ModelError) as info:
        rknn.check_options(Path("/m/cls/1/model.onnx"), options)
    assert "model /m/cls/1/model.onnx: model.toml [rknn]" in info.value.message
    assert words in info.value.message
