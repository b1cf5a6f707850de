"""Generated OCR test images: text rendered with PIL in the DejaVu fonts (Debian
fonts-dejavu-core), as uint8 HxWx3 BGR arrays, with the lines that were drawn."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")

# (lines, font file, size in px, rotation in degrees)
CASES = [
    (["Hello world 123", "The quick brown fox"], "DejaVuSans.ttf", 32, 0),
    (["Invoice 4711", "Total 99.50 EUR"], "DejaVuSerif.ttf", 24, 0),
    (["inferd serves models"], "DejaVuSansMono.ttf", 40, 0),
    (["slight tilt here"], "DejaVuSans-Bold.ttf", 36, 5),
    (["Upside down line"], "DejaVuSans.ttf", 36, 180),
    (["small print 2026"], "DejaVuSans.ttf", 18, 0),
]


def render(lines: list[str], font: str, size: int, rotation: float = 0,
           width: int = 900) -> np.ndarray:
    """Black text on white, one line every 2 x size pixels; rotated with expansion."""
    f = ImageFont.truetype(str(FONT_DIR / font), size)
    img = Image.new("RGB", (width, 60 + len(lines) * size * 2), "white")
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(lines):
        draw.text((30, 30 + i * size * 2), line, font=f, fill="black")
    if rotation:
        img = img.rotate(rotation, expand=True, fillcolor="white")
    return np.array(img)[:, :, ::-1].copy()


def fonts_available() -> bool:
    return all((FONT_DIR / c[1]).exists() for c in CASES)


@functools.cache
def rapidocr_reads(case: int) -> tuple[list[str], np.ndarray]:
    """rapidocr-onnxruntime's texts and boxes ([N,4,2] float32) on the image of
    ``CASES[case]``, read once a test session (the OCR tests of several files compare
    with them). Its onnxruntime sessions run on one thread: here its texts and boxes on
    every case are its default's (two threads) to the bit, and its default threads
    spin while the daemon under test measures placements on the same cores."""
    import rapidocr_onnxruntime

    result, _ = _rapidocr(rapidocr_onnxruntime)(render(*CASES[case]))
    if not result:
        return [], np.zeros((0, 4, 2), np.float32)
    return [r[1] for r in result], np.array([r[0] for r in result], np.float32)


@functools.cache
def _rapidocr(module: Any) -> Any:
    return module.RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1)
