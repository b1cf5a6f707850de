"""Partitioned execution: models with custom nodes, and standard nodes a backend lacks,
run as one plan with outputs equal to a numpy reference / onnxruntime alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
from onnx import helper

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.discovery import load_folders
from inferd.libbackends.customops.partition import node_support
from inferd.libbackends.customops.contract import plan_note
from inferd.libbackends.customops.plan import PartitionedModel, load_model
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend, OrtModel
from tests.libbackends.customops import kit
from tests.libbackends.customops.conftest import KINDS, op_folder


class PickyBackend(OnnxRuntimeCpuBackend):
    """onnxruntime that declares every node of ``refused`` op types unsupported (a test
    stand-in for an engine that lacks an op, e.g. an NPU without Add)."""

    id = "picky"

    def __init__(self, refused: set[str]) -> None:
        super().__init__()
        self.refused = refused
        self.tables: list[dict[str, Any]] = []

    def load(self, model_path: Path, options: LoadOptions) -> Any:
        self.tables.append(options.options)
        # its table is its own: onnxruntime underneath gets none (it refuses unknown keys)
        return super().load(model_path, dataclasses.replace(options, options={}))

    def supported_nodes(self, model: Any) -> list[str]:
        base = super().supported_nodes(model)
        return [f"picky refuses {n.op_type}" if n.op_type in self.refused else b
                for n, b in zip(model.graph.node, base)]


@pytest.fixture
def python_ops(tmp_path: Path) -> OpRegistry:
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "sigmoid.py").write_text(kit.PY_OPS)
    reg = OpRegistry()
    load_folders([tmp_path / "ops"], reg)
    return reg


ORT = OnnxRuntimeCpuBackend()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(kit.CASES))
def test_custom_node_models_match_numpy(case, kind, tmp_path, example_ops):
    ops = OpRegistry()
    load_folders([op_folder(kind, tmp_path, example_ops)], ops)
    assert [o.kind for o in ops.all_ops()] == [kind]
    build, reference, cuts = kit.CASES[case]
    path = kit.save(build(), tmp_path / "model.onnx")
    model = load_model(ORT, path, LoadOptions(intra_op_threads=2), model=case, ops=ops,
                       fallbacks=[ORT])
    try:
        assert isinstance(model, PartitionedModel)
        assert model.plan["cuts"] == cuts
        assert {s["executor"] for s in model.plan["steps"]} == {"onnxruntime",
                                                              f"{kind}:cstSigmoid"}
        assert [s.name for s in model.inputs] == ["x"]
        for n in (1, 3):
            x = kit.sample(n)
            out = model.run({"x": x})
            ref = reference(x)
            assert sorted(out) == sorted(ref)
            for k in ref:
                assert out[k].dtype == np.float32 and out[k].shape == ref[k].shape
                np.testing.assert_allclose(out[k], ref[k], atol=1e-5, rtol=0)
        one = model.run({"x": kit.sample()}, [model.outputs[-1].name])
        assert list(one) == [model.outputs[-1].name]
    finally:
        model.unload()


def test_plan_lists_nodes_executors_and_cut_tensors(python_ops, tmp_path):
    path = kit.save(kit.conv_sigmoid_add(), tmp_path / "model.onnx")
    model = load_model(ORT, path, LoadOptions(), model="m", ops=python_ops, fallbacks=[ORT])
    steps = model.describe()["plan"]["steps"]
    assert [(s["executor"], s["nodes"], s["inputs"], s["outputs"]) for s in steps] == [
        ("onnxruntime", ["conv"], ["x"], ["h"]),
        ("python:cstSigmoid", ["sig"], ["h"], ["s"]),
        ("onnxruntime", ["add"], ["s"], ["y"])]
    assert plan_note(model) == (", partitioned: 3 steps, 2 cuts: onnxruntime 1 node | "
                                "python:cstSigmoid | onnxruntime 1 node")
    tmp = model._tmp
    assert tmp.is_dir()
    model.unload()
    assert not tmp.exists()


def test_missing_op_fails_the_load_naming_it(tmp_path):
    (tmp_path / "other.py").write_text(kit.PY_OPS.replace('"cstSigmoid"', '"cstOther"'))
    ops = OpRegistry()
    load_folders([tmp_path], ops)
    path = kit.save(kit.two_custom(), tmp_path / "model.onnx")
    with pytest.raises(ModelError) as e:
        load_model(ORT, path, LoadOptions(), model="m", ops=ops, fallbacks=[ORT])
    assert e.value.code is ErrorCode.UNSUPPORTED
    assert "node sig1 needs op cstSigmoid (domain 'inferd.test')" in e.value.message
    assert "custom ops loaded: cstOther (any domain)" in e.value.message
    # without any custom op the graph is not read: onnxruntime names the op itself
    with pytest.raises(ModelError, match="cstSigmoid"):
        load_model(ORT, path, LoadOptions(), model="m", ops=OpRegistry(), fallbacks=[ORT])


def test_a_model_its_backend_runs_whole_is_not_partitioned(python_ops, tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", kit.X4,
                              [helper.make_tensor_value_info("y", 1, None)])
    path = kit.save(helper.make_model(graph, opset_imports=kit.OPSETS[:1]), tmp_path / "m.onnx")
    model = load_model(ORT, path, LoadOptions(), model="m", ops=python_ops, fallbacks=[ORT])
    assert isinstance(model, OrtModel) and plan_note(model) == ""
    model.unload()


def test_standard_node_the_backend_lacks_runs_on_onnxruntime(tmp_path, models_dir):
    """The OCR classifier on a backend refusing every Add: the Adds run on onnxruntime
    CPU, the rest on the picky backend, and the outputs equal onnxruntime alone."""
    path = models_dir / "ocr-cls" / "1" / "model.onnx"
    picky = PickyBackend({"Add"})
    fallback = PickyBackend(set())
    fallback.id = "onnxruntime"
    assert any(node_support(picky, __import__("onnx").load(str(path))))
    model = load_model(picky, path, LoadOptions(options={"mine": 1}), model="ocr-cls",
                       fallbacks=[picky, fallback],
                       tables={"picky": {"mine": 1}, "onnxruntime": {"theirs": 2}})
    try:
        plan = model.describe()["plan"]
        executors = {s["executor"] for s in plan["steps"]}
        assert executors == {"picky", "onnxruntime"} and plan["cuts"] >= 2
        adds = [n for s in plan["steps"] if s["executor"] == "onnxruntime" for n in s["nodes"]]
        assert adds and all("add" in n.lower() for n in adds)
        # each backend's sub-graphs get that backend's own model.toml table
        assert picky.tables and all(t == {"mine": 1} for t in picky.tables)
        assert fallback.tables and all(t == {"theirs": 2} for t in fallback.tables)
        x = np.random.default_rng(1).standard_normal((2, 3, 48, 192)).astype(np.float32)
        whole = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        expected = whole.run(None, {"x": x})[0]
        got = model.run({"x": x})[model.outputs[0].name]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    finally:
        model.unload()


def test_a_standard_node_nobody_claims_stays_on_the_chosen_backend(python_ops, tmp_path,
                                                                  caplog):
    path = kit.save(kit.fan_out(), tmp_path / "model.onnx")
    picky = PickyBackend({"Sub"})
    model = load_model(picky, path, LoadOptions(), model="m", ops=python_ops, fallbacks=[])
    try:
        assert model.describe()["plan"]["steps"][-1]["executor"] == "picky"
        assert "sub" in model.describe()["plan"]["steps"][-1]["nodes"]
    finally:
        model.unload()
    assert "model m: node sub (Sub) is claimed by no backend (picky: picky refuses Sub); " \
           "it stays on picky" in caplog.text


def test_onnxruntime_claims_function_ops_and_model_local_functions():
    from onnx import TensorProto

    fn = helper.make_function("my.fns", "Twice", ["a"], ["b"],
                              [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("Twice", ["x"], ["t"], domain="my.fns"),
                               helper.make_node("MeanVarianceNormalization", ["t"], ["y"]),
                               helper.make_node("Nope", ["y"], ["z"], domain="my.fns")],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                  [1, 2, 3, 4])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, functions=[fn], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("my.fns", 1)])
    answer = ORT.supported_nodes(model)
    assert answer[:2] == ["", ""] and "no CPU kernel for Nope" in answer[2]
