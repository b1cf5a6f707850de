"""Native custom ops: the broken-library zoo skipped with stage and reason (probed in a
child process first), kernel variants chosen by CPU feature, windows on threads."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.customops import cpufeatures
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.discovery import load_folders
from inferd.libbackends.customops.plan import load_model
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from tests.libbackends.customops import kit
from tests.libbackends.customops.conftest import build_test_op

pytestmark = pytest.mark.slow  # each test runs a daemon or a child process: seconds

ZOO = {  # library name -> (-D flag, stage, reason fragment)
    "segv": ("SEGV_IN_GET", "contract checked",
             "crashed with SIGSEGV while calling inferd_customop_get()"),
    "hang": ("HANG_IN_GET", "contract checked",
             "hung: no answer within 8 s while calling inferd_customop_get()"),
    "nosym": ("NO_SYMBOL", "contract checked", "symbol inferd_customop_get is not exported"),
    "version": ("WRONG_VERSION", "contract checked",
                "API version 2.0 is incompatible with the daemon's 1.0: the major version "
                "must be equal"),
    "initsegv": ("SEGV_IN_INIT", "probed",
                 "crashed with SIGSEGV while calling init() without attributes, destroy()"),
    "nullcompute": ("NULL_COMPUTE", "contract checked", "kernel 0 (first) has a NULL compute"),
}


def test_broken_libraries_are_skipped_with_stage_and_reason(tmp_path, caplog):
    for name, (flag, _, _) in ZOO.items():
        build_test_op(tmp_path / f"libinferdcst_{name}.so", flag)
    build_test_op(tmp_path / "libinferdcst_good.so", 'KERNEL1_FEATURES=""')
    (tmp_path / "libinferdcst_empty.so").write_bytes(b"")
    reg = OpRegistry()
    with caplog.at_level(logging.INFO, logger="inferd.libbackends.customops"):
        load_folders([tmp_path], reg, probe_timeout_s=8.0)  # the good ones in time at load 6
    assert [o.op_type for o in reg.all_ops()] == ["cstKernel"]
    skipped = {Path(s.path).name: s for s in reg.skipped}
    for name, (_, stage, reason) in ZOO.items():
        s = skipped[f"libinferdcst_{name}.so"]
        assert (s.stage, reason in s.reason) == (stage, True), s
    assert skipped["libinferdcst_empty.so"].stage == "opened"
    assert "dlopen failed" in skipped["libinferdcst_empty.so"].reason
    assert f"custom op library {tmp_path / 'libinferdcst_segv.so'} skipped at stage " \
           f"'contract checked': crashed with SIGSEGV" in caplog.text


def kernel_model(tmp_path: Path) -> Path:
    graph = helper.make_graph([helper.make_node("cstKernel", ["x"], ["y"], name="k")], "g",
                              [helper.make_tensor_value_info("x", 1, [4, 3])],
                              [helper.make_tensor_value_info("y", 1, [4, 3])])
    return kit.save(helper.make_model(graph, opset_imports=kit.OPSETS), tmp_path / "k.onnx")


def run_kernel_op(folder: Path, tmp_path: Path) -> tuple[float, str]:
    reg = OpRegistry()
    load_folders([folder], reg)
    ort = OnnxRuntimeCpuBackend()
    model = load_model(ort, kernel_model(tmp_path), LoadOptions(), model="k", ops=reg,
                       fallbacks=[ort])
    try:
        y = model.run({"x": np.zeros((4, 3), np.float32)})["y"]
        assert len(set(y.ravel().tolist())) == 1
        return float(y[0, 0]), model.describe()["plan"]["steps"][0]["detail"]
    finally:
        model.unload()


def test_first_kernel_whose_features_the_cpu_has_is_chosen(tmp_path):
    have = sorted(cpufeatures.detect())
    assert have, "no CPU feature detected from /proc/cpuinfo"
    # first needs a feature no CPU has; second one this CPU has; third any CPU
    build_test_op(tmp_path / "a" / "libinferdcst_k.so", 'KERNEL1_FEATURES="no_such_feature"',
                  f'KERNEL2_FEATURES="{have[0]},{have[-1]}"')
    assert run_kernel_op(tmp_path / "a", tmp_path) == (2.0, "kernel second")
    build_test_op(tmp_path / "b" / "libinferdcst_k.so", f'KERNEL1_FEATURES="{have[0]}"')
    assert run_kernel_op(tmp_path / "b", tmp_path) == (1.0, "kernel first")


def test_every_kernel_unsupported_fails_the_load_with_the_reason(tmp_path, caplog):
    build_test_op(tmp_path / "libinferdcst_k.so", 'KERNEL1_FEATURES="sve2,no_such_a"',
                  'KERNEL2_FEATURES="no_such_b"', 'KERNEL3_FEATURES="no_such_c"')
    with caplog.at_level(logging.INFO, logger="inferd.libbackends.customops"):
        with pytest.raises(ModelError) as e:
            run_kernel_op(tmp_path, tmp_path)
    assert e.value.code is ErrorCode.UNSUPPORTED
    lacking = "first needs " + ("no_such_a" if "sve2" in cpufeatures.detect() else
                                "sve2, no_such_a")
    assert f"no kernel fits this CPU: {lacking}; second needs no_such_b; third needs " \
           f"no_such_c" in e.value.message
    assert "custom op cstKernel (any domain) registered from" in caplog.text
    assert "no kernel fits this CPU" in caplog.text


@pytest.mark.parametrize("threads, rows, step", [(2, 8, 1), (3, 7, 2), (8, 3, 1), (4, 1, 1)])
def test_compute_runs_on_the_split_windows_of_the_models_threads(tmp_path, threads, rows,
                                                                 step):
    from inferd.libbackends.customops.window import split

    build_test_op(tmp_path / "libinferdcst_rec.so", "RECORD", f"SPLIT_STEP={step}")
    reg = OpRegistry()
    load_folders([tmp_path], reg)
    graph = helper.make_graph([helper.make_node("cstRecord", ["x"], ["y"], name="r")], "g",
                              [helper.make_tensor_value_info("x", 1, [rows, 2])],
                              [helper.make_tensor_value_info("y", 1, [rows, 2])])
    path = kit.save(helper.make_model(graph, opset_imports=kit.OPSETS), tmp_path / "r.onnx")
    ort = OnnxRuntimeCpuBackend()
    model = load_model(ort, path, LoadOptions(intra_op_threads=threads), model="r", ops=reg,
                       fallbacks=[ort])
    try:
        y = model.run({"x": np.zeros((rows, 2), np.float32)})["y"]
    finally:
        model.unload()
    windows = sorted({(int(a), int(b)) for a, b in y})
    assert windows == split(0, rows, step, threads)
