"""OCR processors for the PP-OCR detection -> classification -> recognition graph.

They follow RapidOCR 1.4.4's default pipeline step for step (so that the daemon and the
library give the same texts and boxes): resize to a multiple of 32 with the shorter side
at least 736, normalize, DB post-processing into boxes, perspective crop of each box,
180-degree rotation when the direction classifier is sure, recognition batches of
height 48 padded to the widest crop of the batch, and greedy CTC decoding with the
recognizer's own dictionary (read from the model's ``character`` metadata).

Runtime dependencies: numpy and OpenCV (``cv2``; Debian ``python3-opencv``) for contour
finding, minimum-area rectangles, polygon filling and warps. The DB "unclip" is done
with numpy (a rectangle grown by the offset distance, which is what the polygon offset
of a rectangle reduces to after the minimum-area rectangle), so neither pyclipper nor
shapely is needed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
# OpenCV (cv2) is required by the OCR steps (they refuse to build without it); pyclipper
# is optional (without it unclip is done with numpy). Both are imported on first use.
from inferd.daemon.processors import Context, Step, Values, cv2, pyclipper, register_builtin
from inferd.daemon.processors.builtin import ctc_characters, ctc_greedy
from inferd.ipc.errors import ErrorCode, ModelError
from numpy.typing import NDArray


def _need_cv2(name: str) -> None:
    if not cv2.available:
        raise ModelError(f"{name} needs OpenCV (install python3-opencv)", ErrorCode.UNSUPPORTED)


def _resize32(img: NDArray[Any], ratio: float) -> NDArray[Any]:
    h, w = img.shape[:2]
    rh = int(round(int(h * ratio) / 32) * 32)
    rw = int(round(int(w * ratio) / 32) * 32)
    if rh <= 0 or rw <= 0:
        raise ModelError(f"image of {w}x{h} is too small to resize", ErrorCode.INVALID_ARGUMENT)
    return cv2.resize(img, (rw, rh))


# ----------------------------------------------------------------- detection


@register_builtin("ocr.det_pre")
def det_pre(ctx: Context, limit_side_len: int = 736, max_side_len: int = 2000,
            min_side_len: int = 30, min_height: int = 30, width_height_ratio: float = 8,
            mean: float = 0.5, std: float = 0.5) -> Step:
    """``image`` (uint8 HWC BGR, or HW grey) -> ``x`` [1,3,H,W] float32, ``image`` (the
    resized, letterboxed image the boxes refer to) and ``meta`` (how to map back)."""
    _need_cv2("ocr.det_pre")

    def step(values: Values) -> Values:
        img = np.asarray(values["image"])
        if img.dtype != np.uint8 or img.ndim not in (2, 3) or (img.ndim == 3
                                                                and img.shape[2] not in (3, 4)):
            raise ModelError(f"'image' must be uint8 HxWx3 BGR, got {img.dtype} "
                             f"{list(img.shape)}", ErrorCode.INVALID_ARGUMENT)
        if min(img.shape[:2]) < 1:
            raise ModelError(f"'image' is empty ({img.shape[1]}x{img.shape[0]} pixels)",
                             ErrorCode.INVALID_ARGUMENT)
        if img.ndim == 2:
            img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
        elif img.shape[2] == 4:
            img = cv2.cvtColor(img, cv2.COLOR_BGRA2BGR)
        raw_h, raw_w = img.shape[:2]
        ratio_h = ratio_w = 1.0
        if max(raw_h, raw_w) > max_side_len:
            img = _resize32(img, max_side_len / max(raw_h, raw_w))
            ratio_h, ratio_w = raw_h / img.shape[0], raw_w / img.shape[1]
        if min(img.shape[:2]) < min_side_len:
            h0, w0 = img.shape[:2]
            img = _resize32(img, min_side_len / min(h0, w0))
            ratio_h, ratio_w = h0 / img.shape[0], w0 / img.shape[1]
        h, w = img.shape[:2]
        top = 0
        if h <= min_height or (width_height_ratio != -1 and w / h > width_height_ratio):
            new_h = max(int(w / width_height_ratio), min_height) * 2
            top = int(abs(new_h - h) / 2)
            img = cv2.copyMakeBorder(img, top, top, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0))
        h, w = img.shape[:2]
        ratio = limit_side_len / min(h, w) if min(h, w) < limit_side_len else 1.0
        resized = _resize32(img, ratio)
        # (pixel / 255 - mean) / std straight into [1,3,H,W] float32: one multiply into
        # the transposed output and one subtraction in place (within 2e-7 of the four
        # passes and two temporaries of the plain formula; 3-5 instead of 8 ms CPU on a
        # 2048x736 image)
        x = np.empty((1, 3, *resized.shape[:2]), np.float32)
        np.multiply(resized.transpose(2, 0, 1), np.float32(1 / (255.0 * std)), out=x[0],
                    dtype=np.float32)
        x -= np.float32(mean / std)
        meta = {"raw_h": raw_h, "raw_w": raw_w, "ratio_h": ratio_h, "ratio_w": ratio_w,
                "top": top}
        return {"x": x, "image": img, "meta": meta}
    return step


def _mini_box(contour: NDArray[Any]) -> tuple[NDArray[np.float32], float]:
    rect = cv2.minAreaRect(contour)
    pts = sorted(list(cv2.boxPoints(rect)), key=lambda p: p[0])
    i1, i4 = (0, 1) if pts[1][1] > pts[0][1] else (1, 0)
    i2, i3 = (2, 3) if pts[3][1] > pts[2][1] else (3, 2)
    return np.array([pts[i1], pts[i2], pts[i3], pts[i4]], dtype=np.float32), min(rect[1])


def _box_score(pred: NDArray[Any], box: NDArray[Any]) -> float:
    h, w = pred.shape
    xmin = int(np.clip(np.floor(box[:, 0].min()), 0, w - 1))
    xmax = int(np.clip(np.ceil(box[:, 0].max()), 0, w - 1))
    ymin = int(np.clip(np.floor(box[:, 1].min()), 0, h - 1))
    ymax = int(np.clip(np.ceil(box[:, 1].max()), 0, h - 1))
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    shifted = box - np.array([xmin, ymin], dtype=np.float32)
    cv2.fillPoly(mask, [shifted.reshape(-1, 2).astype(np.int32)], 1)
    return float(cv2.mean(pred[ymin:ymax + 1, xmin:xmax + 1], mask)[0])


def _unclip(box: NDArray[np.float32], ratio: float) -> NDArray[Any]:
    """Grow a box by DB's offset distance (area * ratio / perimeter) on every side.

    With pyclipper this is PaddleOCR's round-joined polygon offset on whole pixels
    (bit-for-bit what RapidOCR does). Without it, the rectangle is grown directly: the
    minimum-area rectangle of a rectangle's offset is the rectangle grown by the
    distance, so only pyclipper's pixel rounding differs (boxes within a pixel, which
    can flip a borderline space in the recognised text)."""
    area = 0.5 * abs(float(np.dot(box[:, 0], np.roll(box[:, 1], 1))
                           - np.dot(box[:, 1], np.roll(box[:, 0], 1))))
    length = float(np.sum(np.linalg.norm(box - np.roll(box, 1, axis=0), axis=1)))
    if length == 0:
        return box
    d = area * ratio / length
    if pyclipper.available:
        offset = pyclipper.PyclipperOffset()
        offset.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
        return np.array(offset.Execute(d)).reshape((-1, 1, 2))
    centre = box.mean(axis=0)
    u = box[1] - box[0]
    v = box[3] - box[0]
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    if nu == 0 or nv == 0:
        return box
    u, v = u / nu, v / nv
    grown = []
    for p in box:
        rel = p - centre
        grown.append(p + np.sign(np.dot(rel, u)) * d * u + np.sign(np.dot(rel, v)) * d * v)
    return np.array(grown, dtype=np.float32)


def _order_clockwise(pts: NDArray[Any]) -> NDArray[np.float32]:
    xs = pts[np.argsort(pts[:, 0]), :]
    left, right = xs[:2], xs[2:]
    tl, bl = left[np.argsort(left[:, 1]), :]
    tr, br = right[np.argsort(right[:, 1]), :]
    return np.array([tl, tr, br, bl], dtype=np.float32)


def sort_boxes(boxes: list[NDArray[Any]]) -> list[NDArray[Any]]:
    """Top to bottom, then left to right within a line (10 px tolerance), as RapidOCR."""
    out = sorted(boxes, key=lambda b: (b[0][1], b[0][0]))
    for i in range(len(out) - 1):
        for j in range(i, -1, -1):
            if abs(out[j + 1][0][1] - out[j][0][1]) < 10 and out[j + 1][0][0] < out[j][0][0]:
                out[j], out[j + 1] = out[j + 1], out[j]
            else:
                break
    return out


@register_builtin("ocr.det_post")
def det_post(ctx: Context, thresh: float = 0.3, box_thresh: float = 0.5,
             max_candidates: int = 1000, unclip_ratio: float = 1.6,
             use_dilation: bool = True) -> Step:
    """DB post-processing: ``pred`` [1,1,H,W] probabilities and ``image`` -> ``boxes``
    (list of 4x2 float32, clockwise from top-left, in ``image`` pixels, reading order)."""
    _need_cv2("ocr.det_post")
    kernel = np.ones((2, 2), np.uint8) if use_dilation else None

    def step(values: Values) -> Values:
        pred = np.asarray(values["pred"])
        if pred.ndim != 4 or pred.shape[:2] != (1, 1):
            raise ModelError(f"'pred' must be [1,1,H,W], got {list(pred.shape)}",
                             ErrorCode.INVALID_ARGUMENT)
        prob = pred[0, 0]
        src_h, src_w = np.asarray(values["image"]).shape[:2]
        height, width = prob.shape
        mask = (prob > thresh).astype(np.uint8)
        if kernel is not None:
            mask = cv2.dilate(mask, kernel)
        contours, _ = cv2.findContours(mask * 255, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        boxes = []
        for contour in contours[:max_candidates]:
            points, side = _mini_box(contour)
            if side < 3 or _box_score(prob, points) < box_thresh:
                continue
            grown = _unclip(points, unclip_ratio)
            box, side = _mini_box(grown.reshape(-1, 1, 2))
            if side < 5:
                continue
            box[:, 0] = np.clip(np.round(box[:, 0] / width * src_w), 0, src_w)
            box[:, 1] = np.clip(np.round(box[:, 1] / height * src_h), 0, src_h)
            box = _order_clockwise(box.astype(np.int32).astype(np.float32))
            box[:, 0] = np.clip(box[:, 0], 0, src_w - 1).astype(np.int32)
            box[:, 1] = np.clip(box[:, 1], 0, src_h - 1).astype(np.int32)
            if (int(np.linalg.norm(box[0] - box[1])) <= 3
                    or int(np.linalg.norm(box[0] - box[3])) <= 3):
                continue
            boxes.append(box)
        return {"boxes": sort_boxes(boxes)}
    return step


# ----------------------------------------------------------------- crops and classifier


def crop_box(img: NDArray[Any], points: NDArray[np.float32]) -> NDArray[Any]:
    """Perspective-crop a 4-point box to an upright rectangle; tall crops are turned."""
    w = int(max(np.linalg.norm(points[0] - points[1]), np.linalg.norm(points[2] - points[3])))
    h = int(max(np.linalg.norm(points[0] - points[3]), np.linalg.norm(points[1] - points[2])))
    dst = np.array([[0, 0], [w, 0], [w, h], [0, h]], dtype=np.float32)
    m = cv2.getPerspectiveTransform(points.astype(np.float32), dst)
    crop = cv2.warpPerspective(img, m, (w, h), borderMode=cv2.BORDER_REPLICATE,
                               flags=cv2.INTER_CUBIC)
    if crop.shape[0] / max(crop.shape[1], 1) >= 1.5:
        crop = np.rot90(crop)
    return crop


@register_builtin("ocr.crop")
def crop(ctx: Context) -> Step:
    """``image`` and ``boxes`` -> ``crops`` (one straightened image per box)."""
    _need_cv2("ocr.crop")

    def step(values: Values) -> Values:
        img = values["image"]
        return {"crops": [crop_box(img, b) for b in values["boxes"]]}
    return step


def _norm_pad(img: NDArray[Any], height: int, width: int) -> NDArray[np.float32]:
    ratio = img.shape[1] / float(img.shape[0])
    rw = width if math.ceil(height * ratio) > width else int(math.ceil(height * ratio))
    resized = cv2.resize(img, (rw, height)).astype(np.float32).transpose(2, 0, 1) / 255
    out = np.zeros((3, height, width), dtype=np.float32)
    out[:, :, :rw] = (resized - 0.5) / 0.5
    return out


def _batches(n: int, order: list[int], size: int) -> list[list[int]]:
    return [order[i:i + size] for i in range(0, n, size)]


@register_builtin("ocr.cls_pre")
def cls_pre(ctx: Context, height: int = 48, width: int = 192, batch: int = 6) -> Step:
    """``crops`` -> ``batches`` (list of [n,3,48,192] float32, n <= batch) and
    ``order`` (the crop indices of each batch row, narrowest crops first)."""
    _need_cv2("ocr.cls_pre")

    def step(values: Values) -> Values:
        crops = values["crops"]
        order = [int(i) for i in np.argsort([c.shape[1] / float(c.shape[0]) for c in crops])]
        groups = _batches(len(crops), order, batch)
        return {"batches": [np.stack([_norm_pad(crops[i], height, width) for i in g])
                            for g in groups],
                "order": groups}
    return step


@register_builtin("ocr.cls_post")
def cls_post(ctx: Context, thresh: float = 0.9, labels: list[str] | None = None) -> Step:
    """``crops``, ``probs`` (per batch [n,2]) and ``order`` -> ``crops`` with those the
    classifier calls upside down (label "180", score > thresh) rotated by 180 degrees."""
    names = labels or ["0", "180"]

    def step(values: Values) -> Values:
        crops = list(values["crops"])
        for probs, group in zip(values["probs"], values["order"]):
            probs = np.asarray(probs)
            for row, i in enumerate(group):
                k = int(probs[row].argmax())
                if "180" in names[k] and probs[row, k] > thresh:
                    crops[i] = np.ascontiguousarray(crops[i][::-1, ::-1])
        return {"crops": crops}
    return step


# ----------------------------------------------------------------- recognition


@register_builtin("ocr.rec_pre")
def rec_pre(ctx: Context, height: int = 48, width: int = 320, batch: int = 6) -> Step:
    """``crops`` -> ``batches`` ([n,3,48,W] float32, W from the widest crop of the batch
    but at least 320) and ``order``."""
    _need_cv2("ocr.rec_pre")

    def step(values: Values) -> Values:
        crops = values["crops"]
        ratios = [c.shape[1] / float(c.shape[0]) for c in crops]
        groups = _batches(len(crops), [int(i) for i in np.argsort(ratios)], batch)
        batches = []
        for g in groups:
            max_ratio = max([width / height] + [ratios[i] for i in g])
            w = int(height * max_ratio)
            batches.append(np.stack([_norm_pad(crops[i], height, w) for i in g]))
        return {"batches": batches, "order": groups}
    return step


@register_builtin("ocr.rec_post")
def rec_post(ctx: Context, characters: list[str] | None = None,
             dictionary_model: str | None = None, metadata_key: str = "character") -> Step:
    """``probs`` (per batch [n,T,C]) and ``order`` -> ``texts`` and ``scores`` in crop
    order, by greedy CTC with the recognizer's dictionary."""
    chars = ctc_characters(ctx, characters, dictionary_model, metadata_key)

    def step(values: Values) -> Values:
        n = sum(len(g) for g in values["order"])
        texts, scores = [""] * n, [0.0] * n
        for probs, group in zip(values["probs"], values["order"]):
            t, s = ctc_greedy(np.asarray(probs), chars)
            for row, i in enumerate(group):
                texts[i], scores[i] = t[row], s[row]
        return {"texts": texts, "scores": scores}
    return step


@register_builtin("ocr.result")
def result(ctx: Context, text_score: float = 0.5) -> Step:
    """``boxes``, ``texts``, ``scores``, ``meta`` -> the graph's outputs: ``boxes``
    float32 [N,4,2] in the caller's image pixels, ``texts`` string [N], ``scores``
    float32 [N]; results scoring under ``text_score`` are dropped."""
    def step(values: Values) -> Values:
        meta = values["meta"]
        keep = [i for i, s in enumerate(values["scores"]) if s >= text_score]
        boxes = np.array([values["boxes"][i] for i in keep], np.float32).reshape(-1, 4, 2)
        boxes[:, :, 1] -= meta["top"]
        boxes[:, :, 0] *= meta["ratio_w"]
        boxes[:, :, 1] *= meta["ratio_h"]
        boxes = np.maximum(boxes, 0)
        boxes[..., 0] = np.minimum(boxes[..., 0], meta["raw_w"])
        boxes[..., 1] = np.minimum(boxes[..., 1], meta["raw_h"])
        return {"boxes": boxes,
                "texts": np.array([values["texts"][i] for i in keep], dtype=object),
                "scores": np.array([values["scores"][i] for i in keep], np.float32)}
    return step
