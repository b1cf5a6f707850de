"""examples/c-client, the libinferd example, built with its Makefile (pkg-config
--cflags --libs inferd, here pointed at this tree's build) and run against a daemon:
the same scores as the Python client, bit for bit."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "c-client"


def test_c_client_matches_python_client(models_dir, start_daemon, short_tmp):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required (apt-get install gcc libzmq3-dev libjansson-dev)")
    lib = subprocess.run(["make", "-s", "-C", str(ROOT / "ipc" / "c")], capture_output=True,
                         text=True)
    assert lib.returncode == 0, lib.stdout + lib.stderr
    env = {**os.environ, "PKG_CONFIG_PATH": str(ROOT / "ipc" / "c" / "build" / "pkgconfig")}
    build = subprocess.run(["make", "-s", "-B", "-C", str(EXAMPLE), "CFLAGS=-O2 -Wall -Werror"],
                           capture_output=True, text=True, env=env)
    assert build.returncode == 0, build.stdout + build.stderr
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls")
    run = subprocess.run([str(EXAMPLE / "build" / "inferd_client"), d.endpoint],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "input x: float32 [-1, 3, -1, -1]" in run.stdout
    scores = [np.float32(v) for v in run.stdout.split("scores:")[1].split()[:2]]
    with d.client() as c:
        ref = next(iter(c.infer("ocr-cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})
                        .values()))
    np.testing.assert_allclose(scores, ref[0], rtol=0, atol=1e-6)  # printed with %.6f
    assert run.stdout.count("reply ") == 4
