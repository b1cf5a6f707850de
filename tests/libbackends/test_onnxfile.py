"""onnxfile.op_types reads an ONNX file's op types from its protobuf encoding: the same
set as the onnx package's walk of the parsed model, sub-graphs and domains included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from inferd.ipc.errors import ModelError
from inferd.libbackends.onnxfile import op_types


def _walk(model: Any) -> set[str]:
    found: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            found.add(node.op_type if node.domain in ("", "ai.onnx")
                      else f"{node.domain}.{node.op_type}")
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)
    return found


@pytest.mark.parametrize("name", ["ocr-det", "ocr-rec", "ocr-cls", "vad"])
def test_the_demo_models_op_types_are_the_onnx_packages(models_dir: Path, name: str) -> None:
    path = models_dir / name / "1" / "model.onnx"
    got = op_types(path)
    assert got == _walk(onnx.load(str(path), load_external_data=False))
    assert len(got) > 10  # vad: If's branches hold most of its ops


def test_sub_graphs_and_other_domains(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    branch = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "b", [], [y])
    other = helper.make_graph([helper.make_node("Gather", ["x"], ["y"], domain="my.ops")],
                              "o", [], [y])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)],
        "g", [x, c], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("my.ops", 1)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert op_types(path) == {"If", "Neg", "my.ops.Gather"} == _walk(model)


def test_a_broken_file_is_a_model_error(tmp_path: Path, models_dir: Path) -> None:
    data = (models_dir / "ocr-cls" / "1" / "model.onnx").read_bytes()
    for name, content in (("empty", b""), ("cut", data[:len(data) // 2]),
                          ("text", b"not a model at all\n")):
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(content)
        with pytest.raises(ModelError, match="not a readable ONNX model"):
            op_types(path)
