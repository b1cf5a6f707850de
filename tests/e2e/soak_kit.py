"""Client processes of the soak and fairness tests.

``python -m tests.e2e.soak_kit ENDPOINT MODELS COUNT SEED``: computes reference outputs
for a few inputs of ocr-cls and vad with its own onnxruntime session, then sends COUNT
requests (a window of 8 in flight), checks every reply against the reference and prints
one JSON line: sent, ok, wrong, lost and error codes.

``python -m tests.e2e.soak_kit greedy ENDPOINT MODEL``: see :func:`greedy`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inferd.ipc import Client, RequestError

WINDOW = 8
SHARE_CLS = 0.25  # of the requests; the rest go to vad


def _inputs(rng: np.random.Generator) -> dict[str, list[dict[str, np.ndarray]]]:
    cls = [{"x": rng.standard_normal((1, 3, 48, 192), np.float32)} for _ in range(4)]
    vad = [{"input": rng.standard_normal((1, 512), np.float32) * 0.1,
            "state": rng.standard_normal((2, 1, 128), np.float32) * 0.1,
            "sr": np.array(16000, np.int64)} for _ in range(4)]
    return {"ocr-cls": cls, "vad": vad}


def _references(models: Path, inputs: dict[str, list[dict[str, np.ndarray]]]
                ) -> dict[str, list[dict[str, np.ndarray]]]:
    refs: dict[str, list[dict[str, np.ndarray]]] = {}
    for name, cases in inputs.items():
        sess = ort.InferenceSession(str(models / name / "1" / "model.onnx"),
                                    providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        refs[name] = [dict(zip(names, sess.run(None, case))) for case in cases]
    return refs


def run(endpoint: str, models: Path, count: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    inputs = _inputs(rng)
    refs = _references(models, inputs)
    ok = wrong = lost = 0
    errors: Counter[str] = Counter()
    examples: list[str] = []
    with Client(endpoint, timeout=120, max_in_flight=WINDOW) as c:
        window: list[tuple[Any, str, int]] = []

        def collect() -> None:
            nonlocal ok, wrong, lost
            pending, name, case = window.pop(0)
            try:
                got = pending.result()
            except RequestError as e:
                if e.code == "DEADLINE_EXCEEDED" and "client timeout" in e.message:
                    lost += 1
                else:
                    errors[str(e.code)] += 1
                    if len(examples) < 5:
                        examples.append(f"{name}: {e.code}: {e.message}")
                return
            ref = refs[name][case]
            if set(got) == set(ref) and all(
                    np.allclose(got[k], ref[k], rtol=1e-4, atol=1e-5) for k in ref):
                ok += 1
            else:
                wrong += 1
                if len(examples) < 5:
                    examples.append(f"{name}: wrong result for case {case}")

        for _ in range(count):
            name = "ocr-cls" if rng.random() < SHARE_CLS else "vad"
            case = int(rng.integers(len(inputs[name])))
            window.append((c.submit("infer", name, inputs[name][case]), name, case))
            if len(window) >= WINDOW:
                collect()
        while window:
            collect()
    return {"sent": count, "ok": ok, "wrong": wrong, "lost": lost, "errors": dict(errors),
            "examples": examples}


def greedy(endpoint: str, model: str) -> None:
    """The greedy client of the fairness test: 500 requests in flight, a new one after
    each reply; writes "S" once they are sent, then one "." per request served."""
    x = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    out = sys.stdout
    with Client(endpoint, timeout=300, max_in_flight=500) as g:
        window = [g.submit("infer", model, x) for _ in range(500)]
        out.write("S")
        out.flush()
        while True:
            r = window.pop(0).reply()
            if r.error is None:
                out.write(".")
                out.flush()
            window.append(g.submit("infer", model, x))


if __name__ == "__main__":
    if sys.argv[1] == "greedy":
        greedy(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]),
                             int(sys.argv[4]))), flush=True)
