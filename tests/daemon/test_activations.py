"""daemon/activations.py: the peak of live activations of an ONNX model for concrete
input shapes, on small graphs built here (whose peaks are counted by hand) and on the
demo models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from inferd.daemon.activations import Activations

F = TensorProto.FLOAT


def _save(tmp_path: Path, nodes, inputs, outputs, name="m.onnx", opset=13) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _x(name="x", dims=("n", 1000)):
    return helper.make_tensor_value_info(name, F, list(dims))


def test_a_tensor_lives_from_the_node_that_makes_it_to_the_last_that_reads_it(tmp_path):
    # a = relu(x); b = relu(a); c = a + b; d = relu(c): at the Add, a, b and c are alive
    path = _save(tmp_path, [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["d"]),
    ], [_x()], [helper.make_tensor_value_info("d", F, ["n", 1000])])
    peak = Activations(path).peak({"x": (2, 1000)})
    row = 2 * 1000 * 4
    assert peak.bytes == 3 * row  # a, b, c at the Add; then a and b go, d comes
    assert peak.complete and peak.tensors == 4
    assert Activations(path).peak({"x": (8, 1000)}).bytes == 4 * 3 * row  # linear in n


def test_weights_and_what_is_computed_from_them_alone_are_not_activations(tmp_path):
    w = numpy_helper.from_array(np.ones((1000, 1000), np.float32), "w_value")
    path = _save(tmp_path, [
        helper.make_node("Constant", [], ["w"], value=w),
        helper.make_node("Transpose", ["w"], ["wt"]),  # an engine folds this at load
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ], [_x()], [helper.make_tensor_value_info("y", F, ["n", 1000])])
    model = Activations(path)
    assert model.peak({"x": (1, 1000)}).bytes == 1000 * 4
    assert model._model.ByteSize() < 10_000  # the 4 MB weight is stripped to its shape


def test_a_reshape_to_a_computed_shape_is_sized_by_folding(tmp_path):
    # y = reshape(x, [shape(x)[0] * 2, -1]): shape inference alone leaves y unsized
    i64 = TensorProto.INT64
    path = _save(tmp_path, [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", i64, [1], [0])),
        helper.make_node("Gather", ["s", "zero"], ["n"]),
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", i64, [1], [2])),
        helper.make_node("Mul", ["n", "two"], ["n2"]),
        helper.make_node("Constant", [], ["rest"], value=helper.make_tensor("r", i64, [1], [-1])),
        helper.make_node("Concat", ["n2", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Relu", ["y"], ["z"]),
    ], [_x()], [helper.make_tensor_value_info("z", F, ["rows", "columns"])])
    peak = Activations(path).peak({"x": (3, 1000)})
    assert peak.unsized == 0, peak
    assert peak.bytes == 2 * 3 * 1000 * 4  # y and z


def test_an_if_on_a_known_value_takes_its_branch_else_the_larger_one(tmp_path):
    def branch(name: str, ops: int):
        nodes, last = [], "x"
        for i in range(ops):
            nodes.append(helper.make_node("Relu", [last], [f"{name}{i}"]))
            last = f"{name}{i}"
        out = helper.make_tensor_value_info(last, F, ["n", 1000])
        return helper.make_graph(nodes, name, [], [out])
    i64 = TensorProto.INT64
    path = _save(tmp_path, [
        helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", i64, [], [16000])),
        helper.make_node("Equal", ["sr", "k"], ["is16k"]),
        # then: x -> relu -> relu (2 tensors alive at most); else: a chain of 1
        helper.make_node("If", ["is16k"], ["y"], then_branch=branch("t", 2),
                         else_branch=branch("e", 1)),
    ], [_x(), helper.make_tensor_value_info("sr", i64, [])],
        [helper.make_tensor_value_info("y", F, ["n", 1000])])
    model = Activations(path)
    row = 1000 * 4
    flag = 1  # the bool that Equal makes
    assert model.peak({"x": (1, 1000), "sr": ()}, {"sr": np.array(8000)}).bytes == row
    assert model.peak({"x": (1, 1000), "sr": ()}, {"sr": np.array(16000)}).bytes == 2 * row
    # sr not known: the Equal is computed at run time, and either branch may run
    assert model.peak({"x": (1, 1000), "sr": ()}).bytes == 2 * row + flag


@pytest.mark.parametrize("name, shapes", [
    ("ocr-det", [{"x": (1, 3, 640, 640)}, {"x": (1, 3, 1280, 1280)}]),
    ("ocr-rec", [{"x": (1, 3, 48, 320)}, {"x": (4, 3, 48, 320)}]),
    ("ocr-cls", [{"x": (6, 3, 48, 192)}, {"x": (24, 3, 48, 192)}]),
    ("vad", [{"input": (64, 512), "state": (2, 64, 128), "sr": ()},
             {"input": (256, 512), "state": (2, 256, 128), "sr": ()}]),
])
def test_the_demo_models_are_sized_and_grow_with_their_inputs(models_dir, name, shapes):
    model = Activations(models_dir / name / "1" / "model.onnx")
    values = {"sr": np.array(16000, np.int64)} if name == "vad" else None
    small, large = (model.peak(s, values) for s in shapes)
    assert small.complete and large.complete, (small, large)
    # four times the input elements: four times the activations (within a few %)
    assert 3.8 * small.bytes <= large.bytes <= 4.2 * small.bytes, (small, large)
