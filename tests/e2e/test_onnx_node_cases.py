"""ONNX's node conformance cases through one real daemon (issue 19, item 6): every
tensor case that in-process onnxruntime passes gives exactly onnxruntime's bits through
the wire, for every dtype (bfloat16, float8, int4 and strings too), with zero daemon
deaths. Cases are generated from the installed onnx package (tests/e2e/onnx_node_kit.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_node_kit import in_process, same_bits, tensor_cases  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_case_onnxruntime_passes_gives_its_bits_through_the_daemon(
        start_daemon, short_tmp: Path) -> None:
    cases = tensor_cases()
    checked = []
    for case in cases:
        reference = in_process(case)
        if reference is not None:
            checked.append((case, reference))
    repo = short_tmp / "repo"
    for case, _ in checked:
        path = repo / case.name / "1" / "model.onnx"
        path.parent.mkdir(parents=True)
        path.write_bytes(case.model)
    # StringNormalizer's cases need a UTF-8 locale (docs: FIELD-NOTES)
    d = start_daemon("--models", str(repo), env={"LC_ALL": "C.UTF-8"})
    failed: list[str] = []
    with d.client(timeout=120) as c:
        for case, reference in checked:
            try:
                for (inputs, _), want in zip(case.data, reference):
                    got = c.infer(case.name, inputs)
                    bad = [k for k in want if k not in got or not same_bits(got[k], want[k])]
                    if bad:
                        failed.append(f"{case.name}: outputs {bad} differ from in-process "
                                      f"onnxruntime")
                        break
            except Exception as e:  # noqa: BLE001  every failure is listed below
                failed.append(f"{case.name}: {type(e).__name__}: {e}"[:300])
            c.unload(case.name)
            assert d.proc.poll() is None, f"the daemon died at {case.name}:\n{d.log()}"
    print(f"{len(cases)} tensor cases; in-process onnxruntime passes {len(checked)}; "
          f"through the daemon {len(checked) - len(failed)} give its bits")
    assert not failed, f"{len(failed)} of {len(checked)} cases:\n" + "\n".join(failed)
    assert len(checked) > 1500  # the onnx 1.23 / onnxruntime 1.32 pair: 1,5xx
    assert d.proc.poll() is None
