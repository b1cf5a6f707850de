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


@pytest.mark.parametrize("name, inputs", [
    ("ocr-rec", {"x": (0, 3, 48, 320)}),  # onnxruntime: FAIL in a Reshape of zero rows
    ("vad", {"input": (1, 0), "state": (2, 1, 128), "sr": ()}),  # FAIL in a reflect Pad
])
def test_a_run_that_fails_on_an_empty_input_is_the_clients_error(models_dir, name, inputs):
    """onnxruntime calls these failures FAIL, as if the engine broke; the client sent an
    input of zero elements on an axis the model leaves free (issue 31 item 12). (vad with
    a zero batch makes onnxruntime abort the process: issue 30, not run here.)"""
    import numpy as np

    from inferd.ipc.errors import ErrorCode, ModelError

    model = OnnxRuntimeCpuBackend().load(models_dir / name / "1" / "model.onnx",
                                         LoadOptions())
    arrays = {k: (np.array(16000, np.int64) if k == "sr" else np.zeros(s, np.float32))
              for k, s in inputs.items()}
    empty = next(k for k, a in arrays.items() if a.size == 0)
    try:
        with pytest.raises(ModelError) as e:
            model.run(arrays)
        assert e.value.code is ErrorCode.INVALID_ARGUMENT, e.value.message
        assert f"an empty input: {empty!r} has shape {list(inputs[empty])}" in e.value.message
        assert "onnxruntime failed to run" in e.value.message  # and onnxruntime's reason
    finally:
        model.unload()


def test_an_engine_failure_on_non_empty_inputs_stays_internal(tmp_path):
    """A FAIL with no empty input is the engine's (docs/protocol.md): a Reshape to 7 of
    6 elements; onnxruntime's own INVALID_ARGUMENT status stays the client's."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from inferd.ipc.errors import ErrorCode, ModelError

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    seven = helper.make_tensor("s", TensorProto.INT64, [1], [7])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "r",
                              [x], [y], initializer=[seven])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "model.onnx")
    model = OnnxRuntimeCpuBackend().load(tmp_path / "model.onnx", LoadOptions())
    try:
        with pytest.raises(ModelError) as e:
            model.run({"x": np.ones(6, np.float32)})
        assert e.value.code is ErrorCode.INTERNAL and "empty" not in e.value.message
    finally:
        model.unload()


def test_run_into_writes_the_outputs_where_asked_and_refuses_another_shape_quietly(
        models_dir, tmp_path, capfd):
    """run_into binds the outputs to the arrays given (IOBinding: the same bits as run,
    in those very arrays, the shrinkage option kept); an output of another shape than
    given is run again plainly, right, and onnxruntime logs no ERROR for the refusal."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    backend = OnnxRuntimeCpuBackend()
    cls = backend.load(models_dir / "ocr-cls" / "1" / "model.onnx",
                       LoadOptions(options={"arena_shrinkage": True}))
    x = {"x": np.random.default_rng(2).random((8, 3, 48, 192), dtype=np.float32)}
    try:
        expected = cls.run(x)
        into = {name: np.full_like(a, np.nan) for name, a in expected.items()}
        got = cls.run_into(x, None, into)
        for name, a in expected.items():
            assert got[name] is into[name] and got[name].tobytes() == a.tobytes()
        assert cls._bound_run_options().get_run_config_entry(
            "memory.enable_memory_arena_shrinkage") == "cpu:0"
    finally:
        cls.unload()
    v = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1, "k"])
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "nz", [v], [y])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "nz.onnx")
    nz = backend.load(tmp_path / "nz.onnx", LoadOptions())
    try:
        capfd.readouterr()
        x = {"x": np.array([0, 1, 2, 0, 5], np.float32)}
        wrong = {"y": np.zeros((1, 2), np.int64)}  # the values give (1, 3)
        got = nz.run_into(x, None, wrong)
        assert got["y"] is not wrong["y"] and got["y"].tolist() == [[1, 2, 4]]
        assert "[E:onnxruntime" not in capfd.readouterr().err
    finally:
        nz.unload()
