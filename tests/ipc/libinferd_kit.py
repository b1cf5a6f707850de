"""What the libinferd tests share: building the library and its C test programs (plain
and under ASan + UBSan) with the project's Makefile, and a model repository with an
identity model for every wire dtype, a slow model (a `sleep` pre step) and the demo
models."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import numpy as np

from inferd.ipc.dtypes import PACKED_BITS, WIRE_DTYPES, numpy_dtype
from tests.links import link_tree

ROOT = Path(__file__).resolve().parents[2]
LIBDIR = ROOT / "ipc" / "c"
BUILDS = {"plain": "build", "sanitize": "build/sanitize"}
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1:exitcode=86",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87",
    "LSAN_OPTIONS": "exitcode=88",
}

# wire dtype -> ONNX TensorProto type, for the identity models
ONNX_TYPES = {"bool": 9, "int8": 3, "uint8": 2, "int16": 5, "uint16": 4, "int32": 6,
              "uint32": 12, "int64": 7, "uint64": 13, "float16": 10, "float32": 1,
              "float64": 11, "string": 8, "bfloat16": 16, "float8_e4m3fn": 17,
              "float8_e4m3fnuz": 18, "float8_e5m2": 19, "float8_e5m2fnuz": 20, "uint4": 21,
              "int4": 22, "float4_e2m1fn": 23, "float8_e8m0fnu": 24, "uint2": 25, "int2": 26}
VAD_TOML = ROOT / "examples" / "models" / "vad" / "model.toml"
"""The demo vad's model.toml as this tree has it (models/ may be older)."""
SLOW_MS = 400
"""How long a request to the `slow` model takes (its `sleep` pre step)."""


def build(kind: str) -> Path:
    """``make tests`` for KIND ("plain" or "sanitize"); the folder of the programs."""
    folder = BUILDS[kind]
    jobs = f"-j{len(os.sched_getaffinity(0))}"  # a C file a core: ~12 s -> ~4 s on 2
    cmd = ["make", "-s", jobs, "-C", str(LIBDIR), f"BUILD={folder}", "tests"]
    if kind == "sanitize":
        cmd.append("SANITIZE=1")
    # pytest-xdist runs test files in parallel (make test): the files that build the
    # same folder take turns, so two makes never write one object at once.
    (LIBDIR / "build").mkdir(exist_ok=True)
    with open(LIBDIR / "build" / ".tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout}{out.stderr}"
    return LIBDIR / folder / "tests"


def program_env(kind: str) -> dict[str, str]:
    env = dict(os.environ)
    if kind == "sanitize":
        env.update(SANITIZER_ENV)
    return env


def identity_model(path: Path, dtype: str) -> None:
    """An ONNX model `x` -> `y` of DTYPE giving its input back, any 2-D shape (N, M):
    Identity (opset 21 for bfloat16 and the float8 types), or for the 2- and 4-bit
    integers and float8e8m0, which onnxruntime's Identity does not take, a Cast to 8 bits
    (float for e8m0) and back. onnxruntime 1.32 has no kernel of any op for float4e2m1:
    its model has no node, its output `x` is its input."""
    import onnx
    from onnx import TensorProto, helper

    t = ONNX_TYPES[dtype]
    out = "y"
    if dtype in ("int4", "uint4", "int2", "uint2", "float8_e8m0fnu"):
        wide = (TensorProto.INT8 if dtype.startswith("int") else
                TensorProto.FLOAT if dtype == "float8_e8m0fnu" else TensorProto.UINT8)
        nodes = [helper.make_node("Cast", ["x"], ["w"], to=wide),
                 helper.make_node("Cast", ["w"], ["y"], to=t)]
    elif dtype == "float4_e2m1fn":
        nodes, out = [], "x"
    else:
        nodes = [helper.make_node("Identity", ["x"], ["y"])]
    graph = helper.make_graph(nodes, f"id_{dtype}",
                              [helper.make_tensor_value_info("x", t, ["N", "M"])],
                              [helper.make_tensor_value_info(out, t, ["N", "M"])])
    new, newest = t >= 16, t >= 23  # the 2-bit, e8m0 and float4 casts: opset 25
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(
        "", 25 if newest else 21 if new else 13)])
    model.ir_version = 11 if newest else 10 if new else 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def make_repository(repo: Path, models_dir: Path) -> Path:
    """REPO with id-<dtype> for every wire dtype (strings too: onnxruntime's Identity
    takes them), `slow` (ocr-cls behind a sleep
    step of SLOW_MS), `labels` (ocr-cls whose post step names its classes as strings,
    some not ASCII) and ocr-cls, vad (with this tree's model.toml: its [stream])."""
    for dtype in WIRE_DTYPES:
        identity_model(repo / f"id-{dtype}" / "1" / "model.onnx", dtype)
    for name in ("ocr-cls", "vad"):
        link_tree(models_dir / name / "1", repo / name / "1")
    (repo / "vad" / "model.toml").write_bytes(VAD_TOML.read_bytes())
    link_tree(models_dir / "ocr-cls" / "1", repo / "slow" / "1")
    (repo / "slow" / "model.toml").write_text(f'[[pre]]\nop = "sleep"\nms = {SLOW_MS}\n')
    link_tree(models_dir / "ocr-cls" / "1", repo / "labels" / "1")
    (repo / "labels" / "model.toml").write_text(
        '[[post]]\nop = "topk"\nk = 2\ninput = "save_infer_model/scale_0.tmp_1"\n'
        'labels = ["Zürich", ""]\n')
    return repo


def sample(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic values of DTYPE covering its range (NaN and infinities for floats)."""
    rng = np.random.default_rng(seed)
    if dtype == "string":
        words = ["", "a", "Zürich", "\u65e5\u672c", "\U0001f600", "x" * 300]
        return np.array([words[i % len(words)] for i in rng.integers(0, 99, int(np.prod(shape)))],
                        dtype=object).reshape(shape)
    dt = numpy_dtype(dtype)
    n = int(np.prod(shape))
    if dtype in PACKED_BITS:  # every value of so few bits, as ml_dtypes holds them
        return rng.integers(0, 2 ** PACKED_BITS[dtype], n, dtype=np.uint8).view(
            dt).reshape(shape)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(dt).reshape(shape)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        values = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        values[:2] = (info.min, info.max)[:n]
        return values.reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    values = raw.view(dt).copy()  # every bit pattern: NaNs, infinities, subnormals
    if dtype in ("float16", "float32", "float64"):
        values[:3] = np.array([np.nan, np.inf, -np.inf], dt)[:n]
    return values.reshape(shape)
