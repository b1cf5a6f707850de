"""``inferd-convert``: convert a model ahead of time for a backend whose board cannot.

``inferd-convert rknn`` writes the ``model.rknn`` an RK35xx board runs, from a model's
``model.onnx``, with rknn-toolkit2 (``load_onnx`` -> ``build(do_quantization=False)``
-> ``export_rknn``), and ``model.rknn.json`` beside it (the tensors' names, dtypes and
shapes, which RKNNLite cannot tell the daemon).

``inferd-convert ncnn`` writes ``model.ncnn.param``, ``model.ncnn.bin`` and
``model.ncnn.json`` beside ``model.onnx`` with pnnx
(:mod:`inferd.libbackends.ncnn_convert`), for boards without pnnx; it runs in this
interpreter.

rknn-toolkit2 lives in its own virtual environment (``make venv-rknn``). When this
interpreter lacks it, the command runs itself again in ``--python`` (default
``$INFERD_RKNN_PYTHON``) on this inferd's own code, like a backend host.

Usage::

    inferd-convert rknn models/ocr-cls                 # the highest version
    inferd-convert rknn models/ocr-cls/1 --target rk3568
    inferd-convert rknn path/to/model.onnx --input-shape x=1,3,48,192 -o /tmp/cls.rknn
    inferd-convert ncnn models/ocr-rec --input-shape x=1,3,48,320 --input-shape x=1,3,48,640

The ``[rknn]`` (``[ncnn]``) table of the model's model.toml gives the defaults
(``target_platform``, ``input_shapes``); options override it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from inferd.ipc.errors import InferdError


def _onnx_file(path: Path, backend: str = "rknn") -> tuple[Path, dict[str, Any]]:
    """(model.onnx, its model.toml table named after ``backend``) for a file, version or
    model folder."""
    if path.is_dir() and not (path / "model.onnx").exists():
        versions = sorted((int(p.name) for p in path.iterdir()
                           if p.name.isdigit() and (p / "model.onnx").exists()))
        if not versions:
            raise SystemExit(f"inferd-convert: no <version>/model.onnx in {path}")
        path = path / str(versions[-1])
    onnx = path / "model.onnx" if path.is_dir() else path
    if not onnx.is_file():
        raise SystemExit(f"inferd-convert: {onnx} not found")
    toml = onnx.parent.parent / "model.toml"
    table: dict[str, Any] = {}
    if toml.is_file():
        table = dict(tomllib.loads(toml.read_text()).get(backend, {}))
    return onnx, table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferd-convert",
                                description="Convert a model for an inferd backend.")
    sub = p.add_subparsers(dest="backend", required=True)
    r = sub.add_parser("rknn", help="write model.rknn for a Rockchip NPU (RKNNLite)")
    r.add_argument("model", type=Path, help="a model folder, version folder or .onnx file")
    r.add_argument("--target", help="rk3588 (default), rk3576, rk3568, rk3566, rk3562")
    r.add_argument("--input-shape", action="append", default=[], metavar="NAME=D,D,...",
                   help="fixed shape of an input (RKNN needs fixed shapes); repeatable")
    r.add_argument("-o", "--output", type=Path,
                   help="the .rknn file (default: model.rknn beside model.onnx)")
    r.add_argument("--python", default=os.environ.get("INFERD_RKNN_PYTHON"),
                   help="an interpreter with rknn-toolkit2 (default $INFERD_RKNN_PYTHON)")
    n = sub.add_parser("ncnn", help="write model.ncnn.param/.bin/.json with pnnx (for "
                                    "boards without pnnx)")
    n.add_argument("model", type=Path, help="a model folder, version folder or .onnx file")
    n.add_argument("--input-shape", action="append", default=[], metavar="NAME=D,D,...",
                   help="a shape pnnx traces an input at (batch 1); give an input twice "
                        "for its free axes (e.g. widths 320 and 640)")
    n.add_argument("-o", "--output", type=Path,
                   help="the folder for the three files (default: beside model.onnx)")
    return p


def _shapes(items: list[str]) -> dict[str, list[list[int]]]:
    """``--input-shape NAME=D,D,...`` options, by input name."""
    out: dict[str, list[list[int]]] = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            out.setdefault(name, []).append([int(d) for d in dims.split(",")])
        except ValueError:
            raise SystemExit(f"inferd-convert: --input-shape {item!r}: expected "
                             f"NAME=D,D,...") from None
    return out


def convert_ncnn(args: argparse.Namespace) -> dict[str, Any]:
    """Convert with pnnx into the version folder; returns what was done."""
    from inferd.libbackends.ncnn_convert import convert_into, trace_shapes
    from inferd.libbackends.onnxfile import onnx_specs

    onnx, table = _onnx_file(args.model, "ncnn")
    given = dict(table.get("input_shapes", {}))
    given.update(_shapes(args.input_shape))
    inputs, outputs = onnx_specs(onnx, "ncnn")
    shapes = trace_shapes(onnx, inputs, given)
    out = args.output or onnx.parent
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = convert_into(out, onnx, shapes, tuple(inputs), tuple(outputs), whole_folder=False)
    return {"param": str(done.param), "bin": str(done.bin),
            "specs": str(done.param.with_name("model.ncnn.json")),
            "input_shapes": [[list(s) for s in one] for one in done.shapes],
            "bytes": done.bin.stat().st_size,
            "convert_s": round(time.perf_counter() - start, 2)}


def convert_rknn(args: argparse.Namespace) -> dict[str, Any]:
    """Convert, export, write the sidecar; returns what was done (printed as JSON)."""
    from inferd.libbackends.rknn import (
        NPU_CORES, SPECS_SUFFIX, check_options, convert, fixed_shapes,
    )
    from inferd.libbackends.onnxfile import onnx_specs

    onnx, table = _onnx_file(args.model)
    if args.target:
        table["target_platform"] = args.target
    shapes_given = dict(table.get("input_shapes", {}))
    shapes_given.update({name: shapes[-1] for name, shapes in _shapes(args.input_shape).items()})
    table["input_shapes"] = shapes_given
    table.pop("core_mask", None)  # a run-time setting
    target, _, given = check_options(onnx, table)
    inputs, outputs = onnx_specs(onnx, "rknn")
    shapes, rowwise = fixed_shapes(onnx, inputs, given)
    out = args.output or onnx.with_name("model.rknn")
    start = time.perf_counter()
    rknn = convert(onnx, target, shapes, [s.name for s in inputs])
    try:
        built = time.perf_counter() - start
        if rknn.export_rknn(str(out)) != 0:
            raise SystemExit(f"inferd-convert: rknn-toolkit2 could not write {out}")
    finally:
        rknn.release()
    specs = {"target_platform": target, "npu_cores": NPU_CORES[target], "rowwise": rowwise,
             "source": str(onnx),
             "inputs": [{"name": s.name, "dtype": s.dtype,
                         "shape": [None, *shape[1:]] if rowwise else shape}
                        for s, shape in zip(inputs, shapes)],
             "outputs": [s.to_json() for s in outputs]}
    sidecar = out.with_name(out.name + SPECS_SUFFIX)
    sidecar.write_text(json.dumps(specs, indent=1) + "\n")
    return {"rknn": str(out), "specs": str(sidecar), "target_platform": target,
            "bytes": out.stat().st_size, "convert_s": round(built, 2)}


def run(*argv: str) -> int:
    """Entry point inside an interpreter that has the converter (rknn-toolkit2, pnnx)."""
    args = _parser().parse_args(list(argv))
    try:
        result = convert_ncnn(args) if args.backend == "ncnn" else convert_rknn(args)
    except InferdError as e:
        print(f"inferd-convert: {e.message}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``inferd-convert``: converts here, or for rknn in ``--python`` when rknn-toolkit2
    is absent."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.backend == "ncnn" or importlib.util.find_spec("rknn") is not None:
        return run(*argv)
    if not args.python:
        print("inferd-convert: rknn-toolkit2 is not installed in this interpreter; give "
              "--python (or $INFERD_RKNN_PYTHON) of its virtual environment, made by "
              "`make venv-rknn`", file=sys.stderr)
        return 2
    if not Path(args.python).is_file():
        print(f"inferd-convert: --python {args.python} not found", file=sys.stderr)
        return 2
    from inferd.libbackends.hosted import bootstrap_command

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.setdefault("TQDM_DISABLE", "1")
    cmd = bootstrap_command(args.python, (), "inferd.libbackends.rknn_convert:run", *argv)
    return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
