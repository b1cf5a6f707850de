"""Fixtures for the custom-op tests: the example ops built by their Makefile, test op
libraries compiled with gcc, and one op folder per implementation (Python, native CPU,
native OpenCL on pocl)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.libbackends.conftest import compile_plugin
from tests.libbackends.customops import kit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "customops"
TEST_OPS_C = Path(__file__).resolve().parent / "test_ops.c"
KINDS = ["python", "native-cpu", "native-gpu"]


def opencl_available() -> str:
    """"" if pyopencl finds an OpenCL device, else why not."""
    try:
        import pyopencl as cl
    except ImportError:
        return "the Python module pyopencl is not installed (pip install pyopencl)"
    try:
        if any(p.get_devices() for p in cl.get_platforms()):
            return ""
    except cl.Error as e:
        return f"no OpenCL platform ({e}); Debian: apt-get install pocl-opencl-icd"
    return "no OpenCL device; Debian: apt-get install pocl-opencl-icd"


def need_opencl() -> None:
    """Skip without OpenCL, but fail where CI promised it ($INFERD_TEST_OPENCL=1)."""
    why = opencl_available()
    if why:
        if os.environ.get("INFERD_TEST_OPENCL") == "1":
            pytest.fail(f"INFERD_TEST_OPENCL=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="session", autouse=True)
def pocl_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep pocl's kernel cache out of the home directory (FIELD-NOTES)."""
    cache = tmp_path_factory.mktemp("pocl")
    old = {k: os.environ.get(k) for k in ("POCL_CACHE_DIR", "XDG_CACHE_HOME")}
    os.environ["POCL_CACHE_DIR"] = str(cache / "pocl")
    os.environ["XDG_CACHE_HOME"] = str(cache / "xdg")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def example_ops(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example ops, built by examples/customops/Makefile into a temporary dir."""
    build = tmp_path_factory.mktemp("customops-build")
    proc = subprocess.run(["make", "-s", "-C", str(EXAMPLES), f"BUILD={build}"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build


def build_test_op(out: Path, *defines: str) -> Path:
    return compile_plugin(TEST_OPS_C, out, *defines)


def op_folder(kind: str, root: Path, example_ops: Path) -> Path:
    """A folder holding the cstSigmoid op of ``kind``."""
    folder = root / f"ops-{kind}"
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "python":
        (folder / "sigmoid.py").write_text(kit.PY_OPS)
    elif kind == "native-cpu":
        shutil.copy(example_ops / "cpu" / "libinferdcst_sigmoid.so", folder)
    else:
        need_opencl()
        shutil.copy(example_ops / "gpu" / "libinferdcst_sigmoid_cl.so", folder)
    return folder
