"""Built-in processors (daemon/processors/): the generic steps against plain numpy, the
CTC dictionary read from the real recognizer model, and the numpy DB unclip against
pyclipper's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from inferd.daemon.processors import Context, LazyModule, ProcessorRegistry
from inferd.daemon.processors import builtin as B
from inferd.daemon.processors import ocr as O
from inferd.ipc.errors import ModelError


@pytest.fixture(scope="module")
def registry() -> ProcessorRegistry:
    return ProcessorRegistry()


def build(registry: ProcessorRegistry, op: str, ctx: Context | None = None, **params):
    return registry.build({"op": op, **params}, ctx or Context(), "test")


def test_image_steps_make_a_normalized_nchw_batch(registry: ProcessorRegistry) -> None:
    img = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    v = build(registry, "image.resize", height=8, width=12)({"image": img})
    assert v["image"].shape == (8, 12, 3) and v["image"].dtype == np.uint8
    v = build(registry, "image.normalize", scale=1 / 255, mean=[0.5] * 3, std=[0.5] * 3)(
        {"image": img})
    np.testing.assert_allclose(v["image"], (img / 255 - 0.5) / 0.5, atol=1e-6)
    v = build(registry, "image.layout", source="HWC", target="NCHW")(v)
    assert v["image"].shape == (1, 3, 4, 6)
    np.testing.assert_allclose(v["image"][0, 2, 1, 3], (img[1, 3, 2] / 255 - 0.5) / 0.5,
                               atol=1e-6)
    with pytest.raises(ModelError, match="not HWC"):
        build(registry, "image.layout")({"image": np.zeros((2, 2))})


def test_numpy_resize_matches_opencv_bilinear() -> None:
    cv2 = pytest.importorskip("cv2")
    img = np.random.default_rng(0).integers(0, 255, (17, 23, 3), dtype=np.uint8)
    saved, B.cv2 = B.cv2, LazyModule("no_such_module_here", "none")
    try:
        mine = B.resize_bilinear(img, 40, 31)
    finally:
        B.cv2 = saved
    assert np.abs(mine.astype(int) - cv2.resize(img, (31, 40)).astype(int)).max() <= 1


def test_softmax_argmax_topk(registry: ProcessorRegistry) -> None:
    x = np.array([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]], np.float32)
    p = build(registry, "softmax", output="p")({"x": x})["p"]
    np.testing.assert_allclose(p.sum(axis=1), 1, atol=1e-6)
    assert build(registry, "argmax")({"x": x})["x"].tolist() == [1, 2]
    v = build(registry, "topk", k=2, labels=["a", "b", "c"])({"x": x})
    assert v["topk_indices"].tolist() == [[1, 2], [2, 0]]
    assert v["topk_values"].tolist() == [[3, 2], [5, 0]]
    assert v["topk_labels"].tolist() == [["b", "c"], ["c", "a"]]


def test_ctc_greedy_merges_repeats_and_drops_blanks(registry: ProcessorRegistry) -> None:
    # classes: 0 blank, 1 'a', 2 'b', 3 ' '
    steps = [1, 1, 0, 1, 2, 2, 3, 0]
    probs = np.full((1, len(steps), 4), 0.1, np.float32)
    for t, c in enumerate(steps):
        probs[0, t, c] = 0.7
    v = build(registry, "ctc_greedy_decode", characters=["a", "b"])({"x": probs})
    assert v["texts"].tolist() == ["aab "] and v["texts"].dtype == object
    np.testing.assert_allclose(v["scores"], [0.7])


def test_ctc_dictionary_comes_from_the_recognizer_model(models_dir: Path) -> None:
    chars = B.read_model_characters(models_dir / "ocr-rec" / "1" / "model.onnx")
    assert len(chars) == 6623  # 6625 classes = blank + 6623 + space
    ctx = Context(model_path=lambda m: models_dir / m / "1" / "model.onnx")
    table = B.ctc_characters(ctx, None, "ocr-rec", "character")
    assert table[0] == "" and table[-1] == " " and len(table) == 6625
    with pytest.raises(ModelError, match="no 'character' metadata"):
        B.read_model_characters(models_dir / "ocr-cls" / "1" / "model.onnx")


def test_numpy_unclip_is_within_a_pixel_of_pyclipper() -> None:
    cv2 = pytest.importorskip("cv2")
    pytest.importorskip("pyclipper")
    rng = np.random.default_rng(3)
    for _ in range(20):
        rect = ((float(rng.uniform(50, 200)), float(rng.uniform(50, 200))),
                (float(rng.uniform(20, 300)), float(rng.uniform(8, 40))),
                float(rng.uniform(-10, 10)))
        box, _ = O._mini_box(cv2.boxPoints(rect).reshape(-1, 1, 2))
        exact, _ = O._mini_box(O._unclip(box, 1.6).reshape(-1, 1, 2).astype(np.float32))
        saved, O.pyclipper = O.pyclipper, LazyModule("no_such_module_here", "none")
        try:
            approx, _ = O._mini_box(O._unclip(box, 1.6).reshape(-1, 1, 2))
        finally:
            O.pyclipper = saved
        assert np.abs(exact - approx).max() <= 1.5, (exact, approx)


@pytest.mark.parametrize("shape", [(0, 0, 3), (0, 5, 3), (5, 0, 3), (0, 0), (0, 7)])
def test_an_empty_image_to_ocr_is_a_client_error(registry: ProcessorRegistry,
                                                 shape: tuple[int, ...]) -> None:
    """Issue 18, defect 6: a 0x0x3 image was INTERNAL ZeroDivisionError with a traceback."""
    if not O.cv2.available:
        pytest.skip("needs OpenCV")
    with pytest.raises(ModelError, match="'image' is empty") as e:
        build(registry, "ocr.det_pre")({"image": np.zeros(shape, np.uint8)})
    assert e.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("mean, std", [(0.5, 0.5), (0.4, 0.25)])
def test_det_pre_normalizes_as_the_numpy_formula(registry: ProcessorRegistry, mean: float,
                                                 std: float) -> None:
    """ocr.det_pre's one-pass OpenCV normalization is (pixel / 255 - mean) / std, NCHW,
    channels in the image's order (BGR stays BGR), as RapidOCR computes it in numpy."""
    cv2 = pytest.importorskip("cv2")
    img = np.random.default_rng(1).integers(0, 256, (736, 1000, 3), dtype=np.uint8)
    img[0, 0] = (0, 128, 255)
    v = build(registry, "ocr.det_pre", mean=mean, std=std)({"image": img})
    resized = cv2.resize(img, (v["x"].shape[3], v["x"].shape[2]))
    expected = ((resized.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)[None]
    assert v["x"].dtype == np.float32 and v["x"].flags.c_contiguous
    assert v["x"].shape == (1, 3, 736, 992)
    np.testing.assert_allclose(v["x"], expected, rtol=0, atol=1e-6)
