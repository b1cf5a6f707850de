"""Fixtures for the backend tests: plugins compiled with gcc into temporary directories,
the example backends, and a small ONNX model every test backend can run."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ROOT / "libbackends" / "include"
EXAMPLES = ROOT / "examples" / "backends"
BROKEN_C = Path(__file__).resolve().parent / "plugins" / "broken_backend.c"

BuildFn = Callable[..., Path]


def compile_plugin(source: Path, out: Path, *defines: str) -> Path:
    """gcc ``source`` into the shared object ``out`` with ``-D`` ``defines``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["gcc", "-std=gnu11", "-O0", "-Wall", "-Werror", "-fPIC", "-shared",
           "-fvisibility=hidden", f"-I{INCLUDE}", *[f"-D{d}" for d in defines],
           "-o", str(out), str(source), "-lm"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return out


@pytest.fixture(scope="session")
def native_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session build directory for compiled plugins (never inside the source tree)."""
    return tmp_path_factory.mktemp("native-build")


@pytest.fixture(scope="session")
def elementwise_so(native_build: Path) -> Path:
    """The C example backend, built by its own Makefile into a temporary directory."""
    build = native_build / "examples"
    proc = subprocess.run(["make", "-s", "-C", str(EXAMPLES), "CC=gcc", f"BUILD={build}"],
                          check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return build / "libelementwise_backend.so"


@pytest.fixture(scope="session")
def broken_so(native_build: Path) -> BuildFn:
    """``broken_so(name, *defines)``: tests/libbackends/plugins/broken_backend.c built
    as ``lib<name>_backend.so`` in a build directory (copy or link it where needed)."""
    def build(name: str, *defines: str) -> Path:
        out = native_build / "broken" / f"lib{name}_backend.so"
        if not out.exists():
            compile_plugin(BROKEN_C, out, *defines)
        return out
    return build


@pytest.fixture(scope="session")
def python_example() -> Path:
    return EXAMPLES / "onnx_reference.py"


@pytest.fixture(scope="session")
def elementwise_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """x[N,4] -> Relu -> Sigmoid -> y: an ONNX model all three test backends run."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                               helper.make_node("Sigmoid", ["h"], ["y"])],
                              "relu_sigmoid", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = tmp_path_factory.mktemp("ew-model") / "model.onnx"
    onnx.save(model, str(path))
    return path
