"""docs/protocol.md is enough for C: the example client, compiled with gcc against
libzmq, gets the same answer as the Python client."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SOURCE = Path(__file__).resolve().parents[2] / "examples" / "c-client" / "inferd_client.c"


def test_c_client_matches_python_client(models_dir, start_daemon, short_tmp):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required (apt-get install gcc libzmq3-dev)")
    binary = short_tmp / "inferd_client"
    build = subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(binary), str(SOURCE),
                            "-lzmq"], capture_output=True, text=True)
    assert build.returncode == 0, f"needs libzmq3-dev: {build.stderr}"
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls")
    run = subprocess.run([str(binary), d.endpoint], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    scores = [float(v) for v in run.stdout.split("scores:")[1].split()]
    with d.client() as c:
        ref = next(iter(c.infer("ocr-cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})
                        .values()))
    np.testing.assert_allclose(scores, ref[0], rtol=0, atol=1e-6)
    assert '"id":"c-1"' in run.stdout
