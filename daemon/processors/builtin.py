"""Generic built-in processors: image decode/resize/normalize/layout, softmax, top-k,
argmax and CTC greedy decoding.

Each step reads one named value (``input``, default ``x``) and writes one (``output``,
default the same name), leaving the other values untouched. Only numpy is required;
``image.decode`` and ``image.resize`` use OpenCV (``cv2``) when it is installed and say
so when it is not (resize falls back to numpy bilinear).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from inferd.daemon.processors import Context, Step, Values, cv2, register_builtin
from inferd.ipc.errors import ErrorCode, ModelError
from numpy.typing import NDArray


def _get(values: Values, name: str) -> Any:
    if name not in values:
        raise ModelError(f"needs value {name!r}, has {sorted(values)}",
                         ErrorCode.INVALID_ARGUMENT)
    return values[name]


def _put(values: Values, name: str, value: Any) -> Values:
    out = dict(values)
    out[name] = value
    return out


@register_builtin("image.decode")
def image_decode(ctx: Context, input: str = "image", output: str | None = None) -> Step:
    """Encoded image bytes (uint8 1-D: PNG, JPEG...) -> uint8 HWC BGR."""
    if not cv2.available:
        raise ModelError("image.decode needs OpenCV (python3-opencv)", ErrorCode.UNSUPPORTED)

    def step(values: Values) -> Values:
        data = np.ascontiguousarray(_get(values, input), dtype=np.uint8).reshape(-1)
        img = cv2.imdecode(data, cv2.IMREAD_COLOR)
        if img is None:
            raise ModelError(f"{input!r} is not a decodable image", ErrorCode.INVALID_ARGUMENT)
        return _put(values, output or input, img)
    return step


def resize_bilinear(img: NDArray[Any], height: int, width: int) -> NDArray[Any]:
    """Resize an HW or HWC image: OpenCV when available, else numpy bilinear (half-pixel
    centres, as OpenCV's INTER_LINEAR)."""
    if cv2.available:
        return cv2.resize(img, (width, height))
    h, w = img.shape[:2]
    ys = np.clip((np.arange(height) + 0.5) * h / height - 0.5, 0, h - 1)
    xs = np.clip((np.arange(width) + 0.5) * w / width - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    if img.ndim == 3:
        fy, fx = fy[..., None], fx[..., None]
    f = img.astype(np.float32)
    top = f[y0][:, x0] * (1 - fx) + f[y0][:, x1] * fx
    bottom = f[y1][:, x0] * (1 - fx) + f[y1][:, x1] * fx
    out = top * (1 - fy) + bottom * fy
    return np.rint(out).astype(img.dtype) if img.dtype == np.uint8 else out.astype(img.dtype)


@register_builtin("image.resize")
def image_resize(ctx: Context, height: int, width: int, input: str = "image",
                 output: str | None = None) -> Step:
    """HWC (or HW) image -> the same resized to height x width (bilinear)."""
    if height <= 0 or width <= 0:
        raise ValueError("height and width must be positive")

    def step(values: Values) -> Values:
        return _put(values, output or input, resize_bilinear(_get(values, input), height,
                                                             width))
    return step


@register_builtin("image.normalize")
def image_normalize(ctx: Context, input: str = "image", output: str | None = None,
                    scale: float = 1 / 255, mean: list[float] | float = 0.0,
                    std: list[float] | float = 1.0) -> Step:
    """(x * scale - mean) / std over the last (channel) axis, as float32."""
    m = np.asarray(mean, np.float32)
    s = np.asarray(std, np.float32)
    if np.any(s == 0):
        raise ValueError("std must not be 0")

    def step(values: Values) -> Values:
        x = np.asarray(_get(values, input), np.float32)
        return _put(values, output or input, ((x * np.float32(scale) - m) / s)
                    .astype(np.float32))
    return step


_LAYOUTS = {"HWC", "CHW", "NHWC", "NCHW"}


@register_builtin("image.layout")
def image_layout(ctx: Context, input: str = "image", output: str | None = None,
                 source: str = "HWC", target: str = "NCHW") -> Step:
    """Change the axis layout (HWC/CHW/NHWC/NCHW), adding or dropping the batch axis."""
    if source not in _LAYOUTS or target not in _LAYOUTS:
        raise ValueError(f"layouts are {sorted(_LAYOUTS)}")
    src = source if source.startswith("N") else "N" + source
    dst = target if target.startswith("N") else "N" + target
    perm = [src.index(a) for a in dst]

    def step(values: Values) -> Values:
        x = np.asarray(_get(values, input))
        if x.ndim != len(source):
            raise ModelError(f"{input!r} has shape {list(x.shape)}, not {source}",
                             ErrorCode.INVALID_ARGUMENT)
        if not source.startswith("N"):
            x = x[None]
        x = x.transpose(perm)
        if not target.startswith("N"):
            if x.shape[0] != 1:
                raise ModelError(f"{input!r}: cannot drop a batch of {x.shape[0]}",
                                 ErrorCode.INVALID_ARGUMENT)
            x = x[0]
        return _put(values, output or input, np.ascontiguousarray(x))
    return step


def softmax(x: NDArray[Any], axis: int = -1) -> NDArray[np.float32]:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32)


@register_builtin("softmax")
def softmax_step(ctx: Context, input: str = "x", output: str | None = None,
                 axis: int = -1) -> Step:
    def step(values: Values) -> Values:
        return _put(values, output or input, softmax(np.asarray(_get(values, input)), axis))
    return step


@register_builtin("argmax")
def argmax_step(ctx: Context, input: str = "x", output: str | None = None,
                axis: int = -1) -> Step:
    """Indices (int64) of the largest value along ``axis``."""
    def step(values: Values) -> Values:
        return _put(values, output or input,
                    np.argmax(np.asarray(_get(values, input)), axis=axis).astype(np.int64))
    return step


@register_builtin("topk")
def topk_step(ctx: Context, k: int, input: str = "x", values_output: str = "topk_values",
              indices_output: str = "topk_indices", labels: list[str] | None = None,
              labels_output: str = "topk_labels") -> Step:
    """The k largest values along the last axis, descending, with their indices (and
    their labels as a string tensor when ``labels`` is given)."""
    if k <= 0:
        raise ValueError("k must be positive")

    def step(values: Values) -> Values:
        x = np.asarray(_get(values, input))
        kk = min(k, x.shape[-1])
        idx = np.argsort(-x, axis=-1, kind="stable")[..., :kk]
        out = dict(values)
        out[values_output] = np.take_along_axis(x, idx, axis=-1)
        out[indices_output] = idx.astype(np.int64)
        if labels is not None:
            if x.shape[-1] > len(labels):
                raise ModelError(f"{len(labels)} labels for {x.shape[-1]} classes",
                                 ErrorCode.INVALID_ARGUMENT)
            out[labels_output] = np.array(labels, dtype=object)[idx]
        return out
    return step


def read_model_characters(path: Path, key: str = "character") -> list[str]:
    """The character list stored in an ONNX model's metadata (``key``, one per line), as
    PaddleOCR recognition models exported by RapidOCR carry it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == key:
            return prop.value.splitlines()
    raise ModelError(f"model file {path} has no {key!r} metadata entry",
                     ErrorCode.INVALID_ARGUMENT)


def ctc_characters(ctx: Context, characters: list[str] | None, dictionary_model: str | None,
                   metadata_key: str) -> list[str]:
    """Index -> character for CTC: blank at 0, the dictionary, then a space (PaddleOCR's
    convention, ``use_space_char``)."""
    if characters is None:
        if dictionary_model is None:
            raise ValueError("give 'characters' or 'dictionary_model'")
        if ctx.model_path is None:
            raise ValueError("no model repository to read 'dictionary_model' from")
        characters = read_model_characters(ctx.model_path(dictionary_model), metadata_key)
    return ["", *characters, " "]


def ctc_greedy(probs: NDArray[Any], chars: list[str]) -> tuple[list[str], list[float]]:
    """Greedy CTC over [N, T, C] probabilities: best class per step, repeats merged,
    blanks (0) dropped; score = mean probability of the kept steps (0 if none)."""
    idx = probs.argmax(axis=2)
    prob = probs.max(axis=2)
    texts, scores = [], []
    for i in range(idx.shape[0]):
        keep = np.ones(idx.shape[1], dtype=bool)
        keep[1:] = idx[i, 1:] != idx[i, :-1]
        keep &= idx[i] != 0
        if np.any(idx[i][keep] >= len(chars)):
            raise ModelError(f"class index {int(idx[i][keep].max())} beyond the "
                             f"{len(chars)}-entry dictionary", ErrorCode.INVALID_ARGUMENT)
        texts.append("".join(chars[j] for j in idx[i][keep]))
        kept = prob[i][keep]
        scores.append(float(np.mean(kept)) if kept.size else 0.0)
    return texts, scores


@register_builtin("ctc_greedy_decode")
def ctc_step(ctx: Context, input: str = "x", texts_output: str = "texts",
             scores_output: str = "scores", characters: list[str] | None = None,
             dictionary_model: str | None = None, metadata_key: str = "character") -> Step:
    """[N, T, C] probabilities -> ``texts`` (N strings) and ``scores`` (float32 N)."""
    chars = ctc_characters(ctx, characters, dictionary_model, metadata_key)

    def step(values: Values) -> Values:
        probs = np.asarray(_get(values, input))
        if probs.ndim != 3:
            raise ModelError(f"{input!r} must be [N, T, C], has {list(probs.shape)}",
                             ErrorCode.INVALID_ARGUMENT)
        texts, scores = ctc_greedy(probs, chars)
        out = dict(values)
        out[texts_output] = np.array(texts, dtype=object)
        out[scores_output] = np.array(scores, dtype=np.float32)
        return out
    return step


@register_builtin("rename")
def rename_step(ctx: Context, mapping: dict[str, str]) -> Step:
    """Rename values (``mapping`` old -> new); the rest pass through."""
    def step(values: Values) -> Values:
        return {mapping.get(k, k): v for k, v in values.items()}
    return step


@register_builtin("sleep")
def sleep_step(ctx: Context, ms: float) -> Step:
    """Busy-free wait of ``ms`` milliseconds (a stand-in cost for tests and benchmarks of
    stage overlap; it releases the GIL as real native work does)."""
    import time

    def step(values: Values) -> Values:
        time.sleep(ms / 1000)
        return values
    return step
