"""End to end: a real daemon with an out-of-process backend whose host process crashes
and hangs mid-run (tests/libbackends/plugins/hosted_target.py, in real host processes),
beside one whose interpreter is missing. Each failure is one coded error reply with the
reason; the daemon keeps serving that model (a new host) and the others."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tests.libbackends.plugin_kit import expected_relu_sigmoid

from inferd.ipc import RequestError

pytestmark = pytest.mark.slow

TARGET = Path(__file__).resolve().parent / "plugins" / "hosted_target.py"
PLUGIN = """
from inferd.libbackends.contract import DeviceKind
from inferd.libbackends.hosted import HostedBackend, HostSpec

def create_backend():
    return HostedBackend({id!r}, DeviceKind.CPU, "0",
                         HostSpec({python!r}, {target!r}, run_timeout_s=2.0))
"""


def test_a_daemon_survives_its_hosts(tmp_path: Path, start_daemon,
                                     elementwise_model: Path) -> None:
    plugins = tmp_path / "backends"
    plugins.mkdir()
    for name, ident, python in (("hosted.py", "hosted-test", sys.executable),
                                ("nohost.py", "hosted-missing", "/nonexistent/bin/python")):
        (plugins / name).write_text(textwrap.dedent(PLUGIN.format(
            id=ident, python=python, target=f"{TARGET}:create_backend")))
    repo = tmp_path / "models"
    for model, prefs in (("ew-hosted", ["hosted-test"]), ("ew-cpu", ["onnxruntime"]),
                         ("ew-missing", ["hosted-missing"])):
        (repo / model / "1").mkdir(parents=True)
        shutil.copy(elementwise_model, repo / model / "1" / "model.onnx")
        (repo / model / "model.toml").write_text(f"backends = {json.dumps(prefs)}\n")
    d = start_daemon("--models", str(repo), "--backends-dir", str(plugins))
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    with d.client(timeout=60) as c:
        backends = {b["id"]: b for b in c.backends()["backends"]}
        assert backends["hosted-test"]["status"] == "registered"
        assert backends["hosted-missing"]["status"] == "unavailable"
        assert "host interpreter /nonexistent/bin/python not found" in \
            backends["hosted-missing"]["reason"]

        np.testing.assert_allclose(c.infer("ew-hosted", {"x": x})["y"],
                                   expected_relu_sigmoid(x), rtol=1e-6)
        for value, code, words in ((1001, "UNAVAILABLE", "was killed by SIGSEGV during run"),
                                   (1002, "DEADLINE_EXCEEDED", "hung: no answer within 2 s")):
            with pytest.raises(RequestError) as info:
                c.infer("ew-hosted", {"x": np.full((1, 4), value, np.float32)})
            assert info.value.code == code and words in info.value.message, info.value
            # the daemon serves on: the other model, and this one in a new host
            np.testing.assert_allclose(c.infer("ew-cpu", {"x": x})["y"],
                                       expected_relu_sigmoid(x), rtol=1e-6)
            np.testing.assert_allclose(c.infer("ew-hosted", {"x": x})["y"],
                                       expected_relu_sigmoid(x), rtol=1e-6)
        with pytest.raises(RequestError) as info:
            c.infer("ew-missing", {"x": x})
        assert "host interpreter /nonexistent/bin/python not found" in info.value.message
        assert c.status()["pid"] == d.proc.pid
    log = d.log()
    assert "was killed by SIGSEGV during run" in log and "starting a new host" in log
