"""Custom ops through a real daemon: a partitioned model served over the socket, its plan
in ``inferctl models -v`` and in the load log line, a custom op inside a graph, a broken
op file skipped, a model needing a missing op refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from inferd.ipc import ErrorCode, RequestError
from tests.libbackends.customops import kit
from tests.libbackends.customops.conftest import KINDS, op_folder

pytestmark = pytest.mark.slow

GRAPH = """
executor = "task"
inputs = ["x"]

[outputs]
y = "two.y"
z = "fan.z"

[[nodes]]
name = "fan"
model = "fan"
inputs = { x = "input.x" }

[[nodes]]
name = "two"
model = "two"
inputs = { x = "fan.a" }
"""


def make_repo(root: Path) -> Path:
    repo = root / "repo"
    kit.save(kit.conv_sigmoid_add(), repo / "conv" / "1" / "model.onnx")
    kit.save(kit.fan_out(), repo / "fan" / "1" / "model.onnx")
    kit.save(kit.two_custom(), repo / "two" / "1" / "model.onnx")
    (repo / "pipe").mkdir()
    (repo / "pipe" / "graph.toml").write_text(GRAPH)
    orphan = helper.make_graph([helper.make_node("cstMissing", ["x"], ["y"], name="lost",
                                                 domain=kit.DOMAIN)], "g", kit.X4,
                               [helper.make_tensor_value_info("y", 1, None)])
    kit.save(helper.make_model(orphan, opset_imports=kit.OPSETS), repo / "orphan" / "1" /
             "model.onnx")
    return repo


@pytest.mark.parametrize("kind", KINDS)
def test_custom_op_through_a_real_daemon(kind, start_daemon, short_tmp, example_ops):
    ops = op_folder(kind, short_tmp, example_ops)
    if kind == "python":
        (ops / "broken.py").write_text("import no_such_module_here\n")
    executor = f"{kind}:cstSigmoid"
    repo = make_repo(short_tmp)
    env = {"INFERD_CUSTOMOPS_PATH": str(ops), "POCL_CACHE_DIR": str(short_tmp / "pocl"),
           "XDG_CACHE_HOME": str(short_tmp / "xdg")}
    daemon = start_daemon("--models", str(repo), env=env)
    x = kit.sample(2)
    with daemon.client() as c:
        out = c.infer("conv", {"x": x})
        np.testing.assert_allclose(out["y"], kit.ref_conv_sigmoid_add(x), atol=1e-5, rtol=0)
        out = c.infer("pipe", {"x": x})
        a = kit.ref_fan_out(x)
        np.testing.assert_allclose(out["z"], a["z"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(out["y"], kit.ref_two_custom(a["a"].astype(np.float32)),
                                   atol=1e-5, rtol=0)
        with pytest.raises(RequestError) as e:
            c.infer("orphan", {"x": x})
        assert e.value.code is ErrorCode.UNSUPPORTED
        assert "node lost needs op cstMissing (domain 'inferd.test')" in e.value.message
        conv = next(m for m in c.models(verbose=True) if m["name"] == "conv")
        assert [s["executor"] for s in conv["plan"]["steps"]] == \
            ["onnxruntime", executor, "onnxruntime"]
        view = c.backends()["customops"]
        assert [o["op_type"] for o in view["ops"]] == ["cstSigmoid"]
        assert view["search_path"] == [str(ops)]
        # the daemon still serves after the refused model
        np.testing.assert_allclose(c.infer("two", {"x": x})["y"], kit.ref_two_custom(x),
                                   atol=1e-5, rtol=0)
    text = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                           daemon.endpoint, "models", "-v"], capture_output=True, text=True,
                          check=True).stdout
    assert f"plan: 3 steps, 2 cuts\n    step 0: onnxruntime: conv (x -> h)\n    step 1: " \
           f"{executor}" in text
    text = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                           daemon.endpoint, "backends"], capture_output=True, text=True,
                          check=True).stdout
    row = next(line for line in text.splitlines() if line.startswith("cstSigmoid"))
    assert row.split()[:3] == ["cstSigmoid", "(any)", kind], row
    if kind == "native-cpu":
        assert row.split()[3] in ("avx2", "generic"), row
    assert f"custom ops search path: {ops} (from $INFERD_CUSTOMOPS_PATH)" in text
    log = daemon.log()
    assert "model conv version 1 loaded on onnxruntime, device CPU, in" in log
    assert f", partitioned: 3 steps, 2 cuts: onnxruntime 1 node | {executor}" in log
    if kind == "native-cpu":
        lib = ops / "libinferdcst_sigmoid.so"
        assert f"custom op cstSigmoid (any domain) registered from {lib} (native-cpu, " \
               f"kernel " in log
    assert "model orphan version 1 failed to load: model orphan version 1: node lost needs " \
           "op cstMissing" in log
    if kind == "python":
        assert f"custom op file {ops / 'broken.py'} skipped at stage 'opened': import raised " \
               f"ModuleNotFoundError" in log
        assert [s["stage"] for s in view["skipped"]] == ["opened"]
