"""Lay out the demo model repository from the package registry (used by `make setup`).

Downloads (once, cached in .cache/wheels) the wheels that ship the real models and
copies them to ``<dest>/<name>/1/model.onnx``, with ``examples/models/<name>/model.toml``
beside them when there is one, and every graph ``examples/models/<graph>/graph.toml`` to
``<dest>/<graph>/graph.toml``. A second run downloads nothing. Models are never
committed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (wheel requirement, wheel file prefix, member path inside the wheel)
DEMO_MODELS = {
    "ocr-det": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-",
                "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
    "ocr-rec": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-",
                "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
    "ocr-cls": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-",
                "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
    "vad": ("silero-vad==6.2.3", "silero_vad-6.2.3-", "silero_vad/data/silero_vad.onnx"),
}


def wheel(requirement: str, prefix: str, cache: Path) -> Path:
    found = sorted(cache.glob(prefix + "*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary", ":all:", "-d", str(cache), requirement], check=True)
    found = sorted(cache.glob(prefix + "*.whl"))
    if not found:
        sys.exit(f"demo_models: pip did not produce a wheel for {requirement}")
    return found[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dest", default="models", help="model repository to fill")
    p.add_argument("--cache", default=".cache/wheels", help="where wheels are kept")
    args = p.parse_args()
    dest, cache = Path(args.dest), Path(args.cache)
    for name, (requirement, prefix, member) in DEMO_MODELS.items():
        target = dest / name / "1" / "model.onnx"
        if not target.exists():
            with zipfile.ZipFile(wheel(requirement, prefix, cache)) as zf:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".part")
                with zf.open(member) as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out)
                tmp.rename(target)
            print(f"demo_models: {target} from {requirement}")
        settings = HERE / "models" / name / "model.toml"
        if settings.exists():
            shutil.copyfile(settings, dest / name / "model.toml")
    # graphs: examples/models/<graph>/graph.toml -> <dest>/<graph>/graph.toml
    for graph in sorted((HERE / "models").glob("*/graph.toml")):
        target = dest / graph.parent.name / "graph.toml"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(graph, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
