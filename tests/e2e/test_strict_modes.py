"""Strict modes where a model's code is loaded in a worker process (issue 31, finding
11, with issue 30's [workers]): ``[security] strict_modes`` reaches the worker, which
refuses a model's own op file that every user may write before importing it, and runs
it when the setting is off. tests/libbackends/test_trust.py has the rule and each
caller; tests/e2e/test_troubleshooting.py::test_strict_modes the in-process daemon."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import ErrorCode, RequestError
from tests.e2e.test_workers import worker_pids
from tests.libbackends.customops import kit

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strict", [True, False])
def test_strict_modes_hold_in_a_worker(strict: bool, start_daemon, short_tmp: Path) -> None:
    """0666 sigmoid.py in a 0777 customops/: refused in the model's worker (the marker it
    would write is absent); with ``strict_modes = false`` it runs there."""
    repo = short_tmp / "repo"
    marker = short_tmp / "ran"
    ops = repo / "planted" / "customops"
    ops.mkdir(parents=True)
    (ops / "sigmoid.py").write_text(f"from pathlib import Path\n"
                                    f"Path({str(marker)!r}).write_text('ran')\n{kit.PY_OPS}")
    ops.chmod(0o777)
    (ops / "sigmoid.py").chmod(0o666)
    kit.save(kit.conv_sigmoid_add(), repo / "planted" / "1" / "model.onnx")
    conf = short_tmp / "inferd.toml"
    conf.write_text(f'[workers]\nisolation = "backend"\n[security]\nstrict_modes = '
                    f'{str(strict).lower()}\n[metrics]\ntextfile = ""\n')
    d = start_daemon("--config", str(conf), "--models", str(repo))
    x = kit.sample(2)
    with d.client() as c:
        if strict:
            with pytest.raises(RequestError) as e:
                c.infer("planted", {"x": x})
            assert e.value.code is ErrorCode.PERMISSION_DENIED, e.value
            assert f"{ops} is writable by every user (mode 0777" in e.value.message
            assert not marker.exists()
        else:
            np.testing.assert_allclose(c.infer("planted", {"x": x})["y"],
                                       kit.ref_conv_sigmoid_add(x), atol=1e-5)
            assert marker.exists()
    assert worker_pids(d.log(), "planted version 1@onnxruntime"), d.log()
