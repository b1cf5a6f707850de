"""The built-in onnxruntime backend passes the thread settings to its sessions."""

from __future__ import annotations

import pytest

from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend


@pytest.mark.parametrize("spin, expected", [(True, None), (False, "0")])
def test_threads_and_spinning_reach_the_session(models_dir, spin, expected):
    """Spinning stays onnxruntime's default (no entry) unless turned off."""
    model = OnnxRuntimeCpuBackend().load(models_dir / "ocr-cls" / "1" / "model.onnx",
                                         LoadOptions(2, 1, allow_spinning=spin))
    try:
        opts = model._session.get_session_options()
        assert opts.intra_op_num_threads == 2 and opts.inter_op_num_threads == 1
        try:
            got = opts.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # onnxruntime raises for an entry never set
            got = None
        assert got == expected
    finally:
        model.unload()
