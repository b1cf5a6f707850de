"""The built-in onnxruntime backend passes the thread settings to its sessions."""

from __future__ import annotations

import pytest

from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend, OrtModel


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


def test_arena_options_reach_the_session_and_its_runs(models_dir):
    """[onnxruntime] memory keys: arena off, the shared arena, shrinkage after each run."""
    import numpy as np

    path = models_dir / "ocr-cls" / "1" / "model.onnx"
    backend = OnnxRuntimeCpuBackend()
    x = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    off = backend.load(path, LoadOptions(options={"memory_arena": False,
                                                  "memory_pattern": False}))
    shared = backend.load(path, LoadOptions(options={
        "arena_extend_strategy": "same_as_requested", "arena_shrinkage": True}))
    try:
        opts = off._session.get_session_options()
        assert not opts.enable_cpu_mem_arena and not opts.enable_mem_pattern
        opts = shared._session.get_session_options()
        assert opts.enable_cpu_mem_arena
        assert opts.get_session_config_entry("session.use_env_allocators") == "1"
        assert shared._run_options.get_run_config_entry(
            "memory.enable_memory_arena_shrinkage") == "cpu:0"
        a, b = off.run(x), shared.run(x)
        assert np.array_equal(next(iter(a.values())), next(iter(b.values())))
        with pytest.raises(Exception, match="arena_max_memory"):  # one cap per process
            backend.load(path, LoadOptions(options={
                "arena_extend_strategy": "same_as_requested", "arena_max_memory": "1GiB"}))
    finally:
        off.unload()
        shared.unload()


def test_small_inputs_are_aligned_in_a_scratch_buffer_the_outputs_never_share(tmp_path):
    """OrtModel.run copies small float inputs into its thread's scratch buffer (64-byte
    aligned, reused by the next run): the outputs must be onnxruntime's own memory, so a
    reply still being sent is not overwritten by the next run. A Reshape whose output
    could alias its input is the case that would show it (a model of Reshape alone
    needs no aligned inputs, contract.ADDRESS_FREE_OPS: its session is run aligned
    here)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from inferd.libbackends.contract import ALIGNMENT, aligned

    shape = helper.make_tensor("s", TensorProto.INT64, [2], [2, 2])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [shape])
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model_proto.ir_version = 8
    path = tmp_path / "reshape.onnx"
    onnx.save(model_proto, path)
    frame = bytes(range(80))
    x = np.frombuffer(frame, np.float32, count=4, offset=40)  # as libzmq places a frame
    assert x.ctypes.data % ALIGNMENT
    copy = aligned({"x": x}, scratch=True)["x"]
    assert copy.ctypes.data % ALIGNMENT == 0 and np.array_equal(copy, x)
    loaded = OnnxRuntimeCpuBackend().load(path, LoadOptions())
    assert loaded._align is False  # type: ignore[attr-defined]
    model = OrtModel(loaded._session, path, align=True)  # type: ignore[attr-defined]
    try:
        first = model.run({"x": x})["y"]
        kept = first.copy()
        second = model.run({"x": np.full(4, 7, np.float32)})["y"]
        assert np.array_equal(first, kept) and np.array_equal(first.reshape(-1), x)
        assert (second == 7).all()
        scratch = aligned({"x": x}, scratch=True)["x"]
        assert not np.shares_memory(first, scratch) and not np.shares_memory(second, scratch)
    finally:
        model.unload()
