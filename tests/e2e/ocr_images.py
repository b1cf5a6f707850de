"""Generated OCR test images: text rendered with PIL in the DejaVu fonts (Debian
fonts-dejavu-core), as uint8 HxWx3 BGR arrays, with the lines that were drawn."""

from __future__ import annotations

from pathlib import Path

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
