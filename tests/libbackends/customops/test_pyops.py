"""Python custom ops: the attribute helper, loading folders, broken files skipped."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from inferd.ipc.errors import ModelError
from inferd.libbackends.customops import get_attr
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.discovery import load_folders, load_model_ops, search_path
from tests.libbackends.customops import kit


def test_get_attr_reads_every_kind_and_defaults():
    node = helper.make_node("cstX", ["x"], ["y"], name="n", alpha=0.5, k=3, mode="fast",
                            sizes=[1, 2], scales=[0.5, 2.0], t=helper.make_tensor(
                                "t", 1, [2], [1.0, 2.0]))
    assert get_attr(node, "alpha") == pytest.approx(0.5)
    assert get_attr(node, "k") == 3
    assert get_attr(node, "mode") == "fast"
    assert get_attr(node, "sizes") == [1, 2]
    assert get_attr(node, "scales") == pytest.approx([0.5, 2.0])
    np.testing.assert_array_equal(get_attr(node, "t"), np.array([1.0, 2.0], np.float32))
    assert get_attr(node, "beta", 1.25) == 1.25
    assert get_attr(node, "beta", None) is None
    with pytest.raises(ModelError, match=r"node n \(cstX\) has no attribute 'beta'.*alpha"):
        get_attr(node, "beta")


BROKEN = {
    "a_syntax.py": "class Op(:\n",
    "b_import.py": "raise RuntimeError('no licence')\n",
    "c_nomethod.py": "class Half:\n    op_type = 'cstHalf'\n    def compute(self, node, inputs):\n"
                     "        return inputs\n",
    "d_dup.py": kit.PY_OPS.replace("class CstSigmoid", "class Again"),
    "e_ctor.py": "class Op:\n    op_type = 'cstCtor'\n    def __init__(self, x):\n        pass\n"
                 "    def shape_infer(self, n, s, d):\n        return s, d\n"
                 "    def compute(self, n, i):\n        return i\n",
    "f_empty.py": "X = 1\n",
}


def test_folder_loads_good_ops_and_skips_broken_ones_with_the_reason(tmp_path, caplog):
    (tmp_path / "0_sigmoid.py").write_text(kit.PY_OPS)
    (tmp_path / "_private.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "libwrong.so").write_bytes(b"")
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    reg = OpRegistry()
    with caplog.at_level(logging.INFO, logger="inferd.libbackends.customops"):
        load_folders([tmp_path], reg)
    assert reg.names() == ["cstSigmoid (any domain)"]
    reasons = {Path(s.path.split(":")[0]).name: s.reason for s in reg.skipped}
    assert "SyntaxError" in reasons["a_syntax.py"]
    assert reasons["b_import.py"] == "import raised RuntimeError: no licence"
    assert "op cstHalf lacks method shape_infer()" in reasons["c_nomethod.py"]
    assert "cstSigmoid (any domain) is already defined by" in reasons["d_dup.py"]
    assert "Op() raised TypeError" in reasons["e_ctor.py"]
    assert reasons["f_empty.py"] == "it defines no class with an op_type attribute"
    assert "libinferdcst_<name>.so" in reasons["libwrong.so"]
    assert "_private.py" not in reasons
    text = caplog.text
    assert f"custom op file {tmp_path / 'b_import.py'} skipped at stage 'opened': import " \
           f"raised RuntimeError: no licence" in text
    assert f"custom op class Half in {tmp_path / 'c_nomethod.py'} skipped: op cstHalf " \
           f"lacks method shape_infer()" in text


def test_domain_narrows_an_op_and_a_model_folder_shadows_the_daemon(tmp_path):
    daemon = tmp_path / "daemon"
    daemon.mkdir()
    (daemon / "ops.py").write_text(kit.PY_OPS + "\n\nclass Narrow(CstSigmoid):\n"
                                   "    op_type = 'cstNarrow'\n    domain = 'only.here'\n")
    glob = OpRegistry()
    load_folders([daemon], glob)
    narrow = helper.make_node("cstNarrow", ["x"], ["y"], domain="only.here")
    assert glob.find(narrow) is not None
    assert glob.find(helper.make_node("cstNarrow", ["x"], ["y"], domain="other")) is None
    model_dir = tmp_path / "repo" / "m"
    (model_dir / "customops").mkdir(parents=True)
    (model_dir / "customops" / "mine.py").write_text(kit.PY_OPS)
    mine = load_model_ops(model_dir, glob)
    sig = helper.make_node("cstSigmoid", ["x"], ["y"], domain=kit.DOMAIN)
    assert "mine.py" in mine.find(sig).source and "ops.py" in glob.find(sig).source
    assert mine.find(narrow) is glob.find(narrow)
    assert load_model_ops(tmp_path / "repo" / "none", glob) is glob


def test_search_path_follows_the_backends_rule():
    assert search_path(["/a"], {"INFERD_CUSTOMOPS_PATH": "/b"}, ["/c"]) == \
        (["/a"], "--customops-dir")
    assert search_path(None, {"INFERD_CUSTOMOPS_PATH": "/b:/d"}, ["/c"]) == \
        (["/b", "/d"], "$INFERD_CUSTOMOPS_PATH")
    assert search_path(None, {}, ["/c"]) == (["/c"], "customops.paths")
    assert search_path(None, {}, []) == (["/usr/lib/inferd/customops"], "default")
