"""Models built with onnx.helper holding custom nodes, the Python op that runs them, and
numpy references of what each model computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

DOMAIN = "inferd.test"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
RNG = np.random.default_rng(7)
W = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)
C = RNG.standard_normal((3, 1, 1)).astype(np.float32)
C2 = RNG.standard_normal((2, 1, 1)).astype(np.float32)

PY_OPS = '''
import numpy as np
from inferd.libbackends.customops import get_attr


class CstSigmoid:
    op_type = "cstSigmoid"

    def shape_infer(self, node, in_shapes, in_dtypes):
        return [in_shapes[0]], [in_dtypes[0]]

    def compute(self, node, inputs):
        alpha = np.float32(get_attr(node, "alpha", 1.0))
        return [(1 / (1 + np.exp(-alpha * inputs[0]))).astype(np.float32)]
'''


def sigmoid(x: NDArray[Any], alpha: float) -> NDArray[Any]:
    return (1.0 / (1.0 + np.exp(-np.float64(alpha) * x.astype(np.float64))))


def cst(inp: str, out: str, alpha: float, name: str) -> onnx.NodeProto:
    return helper.make_node("cstSigmoid", [inp], [out], name=name, domain=DOMAIN,
                            alpha=alpha)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[str], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "cst", inputs,
                              [onnx.ValueInfoProto(name=o) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=OPSETS)
    model.ir_version = 8
    return model


X4 = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8, 8])]


def conv_sigmoid_add() -> onnx.ModelProto:
    """x -> Conv -> cstSigmoid(alpha=0.7) -> Add(c) -> y"""
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["h"], name="conv", pads=[1] * 4),
                   cst("h", "s", 0.7, "sig"),
                   helper.make_node("Add", ["s", "c"], ["y"], name="add")],
                  X4, ["y"], [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b"),
                              numpy_helper.from_array(C, "c")])


def conv(x: NDArray[Any]) -> NDArray[Any]:
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    n, _, h, w = x.shape
    out = np.zeros((n, 3, h, w))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + w], W[:, :, i, j])
    return out + B[None, :, None, None]


def ref_conv_sigmoid_add(x: NDArray[Any]) -> NDArray[Any]:
    return sigmoid(conv(x), 0.7) + C


def two_custom() -> onnx.ModelProto:
    """x -> cstSigmoid(0.5) -> Mul(2) -> cstSigmoid(2.0) -> y"""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    return _model([cst("x", "a", 0.5, "sig1"),
                   helper.make_node("Mul", ["a", "two"], ["m"], name="mul"),
                   cst("m", "y", 2.0, "sig2")], X4, ["y"], [two])


def ref_two_custom(x: NDArray[Any]) -> NDArray[Any]:
    return sigmoid(2 * sigmoid(x, 0.5), 2.0)


def fan_out() -> onnx.ModelProto:
    """x -> Relu -> cstSigmoid(1.5) -> s; s -> Add(c) -> a; s -> Mul(c) -> m; z = a - m;
    outputs a and z"""
    return _model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                   cst("r", "s", 1.5, "sig"),
                   helper.make_node("Add", ["s", "c"], ["a"], name="add"),
                   helper.make_node("Mul", ["s", "c"], ["m"], name="mul"),
                   helper.make_node("Sub", ["a", "m"], ["z"], name="sub")],
                  X4, ["a", "z"], [numpy_helper.from_array(C2, "c")])


def ref_fan_out(x: NDArray[Any]) -> dict[str, NDArray[Any]]:
    s = sigmoid(np.maximum(x, 0), 1.5)
    return {"a": s + C2, "z": (s + C2) - s * C2}


CASES = {
    "conv_sigmoid_add": (conv_sigmoid_add, lambda x: {"y": ref_conv_sigmoid_add(x)}, 2),
    "two_custom": (two_custom, lambda x: {"y": ref_two_custom(x)}, 2),
    "fan_out": (fan_out, ref_fan_out, 2),
}
"""name -> (model builder, reference, number of cuts)"""


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def sample(n: int = 2) -> NDArray[Any]:
    return RNG.standard_normal((n, 2, 8, 8)).astype(np.float32)
