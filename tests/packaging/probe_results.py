#!/usr/bin/python3
"""Ask an installed inferd for the results that the packaging checks compare across
architectures (run inside a container, by Debian's python3, as a user in group inferd;
tests/packaging/check_systemd.py and check_arm64.py copy it in).

Reads INPUTS (an .npz: ``cls_x``, a float32 1x3x48x192 tensor, and ``image_<n>``, uint8
BGR images), sends ``cls_x`` to model ocr-cls and each image to the OCR graph ``ocr``
(unless ``--cls-only``) through /run/inferd/inferd.sock, and writes OUTPUT: an .npz with
``cls`` (the classifier's output), ``boxes_<n>`` and ``scores_<n>``, and
``texts_<n>`` (the recognised strings, as a unicode array).

Usage: probe_results.py INPUTS OUTPUT [--cls-only]
"""

from __future__ import annotations

import sys
import time

import numpy as np
from inferd.ipc import Client

SOCKET = "ipc:///run/inferd/inferd.sock"


def main(argv: list[str]) -> int:
    inputs = np.load(argv[1])
    cls_only = "--cls-only" in argv
    out: dict[str, np.ndarray] = {}
    with Client(SOCKET, timeout=600.0) as client:
        started = time.monotonic()
        got = client.infer("ocr-cls", {"x": inputs["cls_x"]})
        (out["cls"],) = got.values()
        print(f"probe: ocr-cls {out['cls'].shape} in {time.monotonic() - started:.2f} s",
              flush=True)
        for name in sorted(n for n in inputs.files if n.startswith("image_")):
            if cls_only:
                break
            n = name.removeprefix("image_")
            started = time.monotonic()
            got = client.infer("ocr", {"image": inputs[name]})
            out[f"boxes_{n}"] = got["boxes"]
            out[f"scores_{n}"] = got["scores"]
            out[f"texts_{n}"] = np.array([str(t) for t in got["texts"].tolist()], dtype=str)
            print(f"probe: ocr image {n}: {got['texts'].tolist()} in "
                  f"{time.monotonic() - started:.2f} s", flush=True)
    np.savez(argv[2], **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
