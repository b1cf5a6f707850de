"""ONNX -> ncnn (``.param`` + ``.bin``) with pnnx, for the ncnn backend's first load and for
``inferd-convert ncnn`` ahead of time (for boards without pnnx).

pnnx (PyPI ``pnnx``, a standalone 85 MB binary inside the wheel: install it with
``--no-deps``, its dependencies pull a CUDA torch) traces the model at the input shapes it
is given; a second set of shapes (``inputshape2``) tells it which axes are free, so the
``.param`` it writes computes its reshapes from the input instead of baking them in.
ncnn has no batch axis: the shapes are given with a batch of 1, and the backend runs a
batch one row at a time.

Every conversion leaves three files: ``model.ncnn.param``, ``model.ncnn.bin`` and
``model.ncnn.json`` (the ONNX model's tensors, the shapes it was converted at, the ONNX
file's hash), so that a board can load the model without the ``.onnx`` or the onnx
package. At first load they go to the cache folder ``<cache_dir>/<sha256 of the
.onnx, 16 hex>-<hash of the shapes, 8 hex>/``; ``inferd-convert ncnn`` writes them into
the version folder, beside ``model.onnx``, where the backend looks first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.contract import TensorSpec

log = logging.getLogger(__name__)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""The colour codes pnnx's onnxruntime writes into its messages."""

PARAM, BIN, SIDECAR = "model.ncnn.param", "model.ncnn.bin", "model.ncnn.json"
PNNX_ENV = "INFERD_PNNX"
"""Environment variable naming the pnnx binary (else the pnnx wheel's, else PATH's)."""
CONVERT_TIMEOUT_S = 600.0
"""How long one pnnx run may take (the PP-OCR detector: 3 s on this machine kind)."""
FREE_SIZES = (320, 640)
"""The sizes a free axis other than the batch is traced at (first and second shape),
when model.toml ``[ncnn] input_shapes`` does not say: multiples of 32, which the
detectors' strides need."""


@dataclass(frozen=True)
class Converted:
    """An ncnn model on disk and the ONNX tensors it stands for."""

    param: Path
    bin: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    """The input shapes it was converted at (one or two sets, batch axis 1)."""


def pnnx_binary() -> Path | None:
    """The pnnx executable: ``$INFERD_PNNX``, the binary inside the pnnx wheel (found
    without importing the package, which imports torch), or ``pnnx`` on PATH."""
    named = os.environ.get(PNNX_ENV)
    if named:
        return Path(named)
    spec = importlib.util.find_spec("pnnx")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "pnnx"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    found = shutil.which("pnnx")
    return Path(found) if found else None


def trace_shapes(model: Path, inputs: list[TensorSpec] | tuple[TensorSpec, ...],
                 given: dict[str, Any]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The input shapes pnnx traces at: one set, or two where an axis is free.

    Args:
        model: the model file, for messages.
        inputs: the ONNX model's inputs.
        given: model.toml ``[ncnn] input_shapes``: input name -> one shape or two
            (``{x = [[1, 3, 48, 320], [1, 3, 48, 640]]}``); the batch axis must be 1.

    Raises:
        ModelError: a given shape names no input, does not fit the model's, or has a
            batch other than 1.
    """
    where = f"model {model}: model.toml [ncnn] input_shapes"
    unknown = sorted(set(given) - {s.name for s in inputs})
    if unknown:
        raise ModelError(f"{where} names inputs {unknown}; the model's inputs are "
                         f"{[s.name for s in inputs]}", ErrorCode.INTERNAL)
    first: list[tuple[int, ...]] = []
    second: list[tuple[int, ...]] = []
    for s in inputs:
        raw = given.get(s.name)
        if raw is None:
            pair = [tuple(1 if i == 0 else FREE_SIZES[n] if d is None else int(d)
                          for i, d in enumerate(s.shape)) for n in (0, 1)]
        else:
            pair = [tuple(x) for x in (raw if raw and isinstance(raw[0], list) else [raw])]
            if len(pair) == 1:
                pair.append(pair[0])
            for shape in pair:
                if len(pair) > 2 or len(shape) != len(s.shape) or any(
                        not isinstance(g, int) or isinstance(g, bool) or g < 1
                        or (d is not None and i > 0 and g != d)
                        for i, (d, g) in enumerate(zip(s.shape, shape))):
                    raise ModelError(f"{where} {s.name} = {raw}: expected one or two "
                                     f"shapes that fit the model's {list(s.shape)}",
                                     ErrorCode.INTERNAL)
                if shape[0] != 1:
                    raise ModelError(f"{where} {s.name} = {raw}: the batch axis must "
                                     f"be 1 (ncnn runs a batch one row at a time)",
                                     ErrorCode.INTERNAL)
        first.append(pair[0])
        second.append(pair[1])
    return (tuple(first),) if first == second else (tuple(first), tuple(second))


def file_digest(path: Path) -> str:
    """The sha256 of a file, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(digest: str, shapes: tuple[tuple[tuple[int, ...], ...], ...]) -> str:
    """``<sha256 of the .onnx, 16 hex>-<hash of the shapes, 8 hex>``."""
    shape_text = json.dumps([[list(s) for s in one] for one in shapes])
    return f"{digest[:16]}-{hashlib.sha256(shape_text.encode()).hexdigest()[:8]}"


def _shape_arg(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ",".join("[" + ",".join(map(str, s)) + "]" for s in shapes)


def convert_into(dest: Path, onnx: Path, shapes: tuple[tuple[tuple[int, ...], ...], ...],
                 inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                 whole_folder: bool, timeout_s: float = CONVERT_TIMEOUT_S) -> Converted:
    """Convert ``onnx`` with pnnx; the three files appear in ``dest`` together (written
    in a temporary folder beside it, then renamed), so that a reader never sees half a
    conversion.

    Args:
        dest: with ``whole_folder``, the folder to make (a cache entry; its parent must
            exist; when another process made it first, its result is kept); else an
            existing folder that receives the three files (a version folder).

    Raises:
        ModelError: no pnnx (NOT_FOUND), pnnx failed or ran out of time; the message
            has the end of its output.
    """
    binary = pnnx_binary()
    if binary is None:
        raise ModelError(f"ncnn cannot convert {onnx}: pnnx is not installed (pip install "
                         f"--no-deps pnnx, or set ${PNNX_ENV}); or convert it ahead of time "
                         f"with `inferd-convert ncnn {onnx.parent}`", ErrorCode.NOT_FOUND)
    work = Path(tempfile.mkdtemp(prefix=".pnnx-", dir=dest.parent if whole_folder else dest))
    try:
        # pnnx writes a simplified copy beside the file it reads: it reads a link here
        source = work / "model.onnx"
        source.symlink_to(onnx.resolve())
        args = [str(binary), str(source), f"inputshape={_shape_arg(shapes[0])}",
                "fp16=0", f"ncnnparam={work / PARAM}", f"ncnnbin={work / BIN}",
                f"ncnnpy={work / 'model_ncnn.py'}", f"pnnxparam={work / 'model.pnnx.param'}",
                f"pnnxbin={work / 'model.pnnx.bin'}", f"pnnxpy={work / 'model_pnnx.py'}",
                f"pnnxonnx={work / 'model.pnnx.onnx'}"]
        if len(shapes) > 1:
            args.insert(3, f"inputshape2={_shape_arg(shapes[1])}")
        started = time.monotonic()
        try:
            proc = subprocess.run(args, cwd=work, capture_output=True, text=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise ModelError(f"pnnx did not convert {onnx} within {timeout_s:.0f} s",
                             ErrorCode.INTERNAL) from e
        except OSError as e:
            raise ModelError(f"ncnn cannot convert {onnx}: cannot run {binary}: "
                             f"{e.strerror}", ErrorCode.NOT_FOUND) from e
        if proc.returncode != 0 or not (work / PARAM).is_file():
            lines = ANSI.sub("", proc.stdout + proc.stderr).strip().splitlines()
            tail = " | ".join(line.strip() for line in lines[-3:] if line.strip())
            raise ModelError(f"pnnx cannot convert {onnx} (exit status {proc.returncode}) "
                             f"traced at input shapes {' and '.join(map(_shape_arg, shapes))}"
                             f": {tail or 'no message'}; a model whose reshapes need its "
                             f"real input sizes converts with them in model.toml [ncnn] "
                             f"input_shapes (docs/backends.md)", ErrorCode.INTERNAL)
        write_sidecar(work / SIDECAR, inputs, outputs, shapes, onnx)
        if whole_folder:
            for extra in work.iterdir():
                if extra.name not in (PARAM, BIN, SIDECAR):
                    extra.unlink()
            try:
                work.rename(dest)
            except OSError:
                if not (dest / SIDECAR).is_file():  # not another process's finished result
                    raise
        else:
            for name in (PARAM, BIN, SIDECAR):  # the sidecar last: it marks them complete
                os.replace(work / name, dest / name)
        log.info("ncnn: converted %s with pnnx in %.1f s (input shapes %s) into %s", onnx,
                 time.monotonic() - started, " and ".join(_shape_arg(s) for s in shapes),
                 dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return read_sidecar(dest / SIDECAR)


def write_sidecar(path: Path, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                  shapes: tuple[tuple[tuple[int, ...], ...], ...], onnx: Path) -> None:
    """Write ``model.ncnn.json``: the ONNX tensors ``in0``... and ``out0``... stand for."""
    path.write_text(json.dumps({
        "source": onnx.name, "sha256": file_digest(onnx),
        "input_shapes": [[list(s) for s in one] for one in shapes],
        "inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs],
    }, indent=1) + "\n")


def read_sidecar(path: Path) -> Converted:
    """The converted model whose ``model.ncnn.json`` is ``path``.

    Raises:
        ModelError: the file is missing or unreadable (NOT_FOUND), or not a sidecar.
    """
    try:
        raw = json.loads(path.read_text())
        specs = {key: tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"]))
                            for s in raw[key]) for key in ("inputs", "outputs")}
        shapes = tuple(tuple(tuple(int(d) for d in s) for s in one)
                       for one in raw["input_shapes"])
    except OSError as e:
        raise ModelError(f"ncnn cannot read {path}: {e.strerror} (it is written by "
                         f"`inferd-convert ncnn` beside {PARAM})", ErrorCode.NOT_FOUND) from e
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"ncnn cannot read {path}: not a model.ncnn.json written by "
                         f"inferd-convert ({type(e).__name__}: {e})", ErrorCode.INTERNAL) from e
    return Converted(path.with_name(PARAM), path.with_name(BIN), specs["inputs"],
                     specs["outputs"], shapes)


def convert_cached(onnx: Path, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                   shapes: tuple[tuple[tuple[int, ...], ...], ...],
                   cache: Path | None) -> tuple[Converted, Path | None]:
    """The conversion of ``onnx`` at ``shapes`` from the cache, converted now if absent.

    Args:
        cache: the backend's cache folder; None, or one that cannot be made or written,
            converts into a temporary folder (returned, for the caller to remove once
            the model is read) and logs why.

    Returns:
        The converted model, and the temporary folder to remove (None when cached).
    """
    key = cache_key(file_digest(onnx), shapes)
    if cache is not None:
        folder = cache / key
        if (folder / SIDECAR).is_file():
            log.info("ncnn: %s from the conversion cache %s", onnx, folder)
            return read_sidecar(folder / SIDECAR), None
        try:
            cache.mkdir(parents=True, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=cache))
        except OSError as e:
            log.warning("ncnn: the conversion cache %s cannot be written (%s): %s is "
                        "converted for this load only; set [ncnn] cache_dir to a writable "
                        "folder, or convert it ahead of time with `inferd-convert ncnn`",
                        cache, e.strerror, onnx)
        else:
            return convert_into(folder, onnx, shapes, inputs, outputs, True), None
    scratch = Path(tempfile.mkdtemp(prefix="inferd-ncnn-"))
    try:
        return convert_into(scratch / key, onnx, shapes, inputs, outputs, True), scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
