"""End to end: a real inferd process boots over a backends directory holding the two good
example plugins beside one plugin of each broken kind, becomes ready, serves inference
through the good ones, and shows every broken one with its stage and reason in
``inferctl --json backends`` and in its log, all in one unchanged process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.libbackends.plugin_kit import expected_relu_sigmoid, make_plugin_zoo

from inferd.libbackends.loader import BUILTINS

pytestmark = pytest.mark.slow


def inferctl(endpoint: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _repo(root: Path, model: Path, prefs: dict[str, list[str] | None]) -> Path:
    for name, pref in prefs.items():
        (root / name / "1").mkdir(parents=True)
        shutil.copy(model, root / name / "1" / "model.onnx")
        if pref is not None:
            (root / name / "model.toml").write_text(f"backends = {json.dumps(pref)}\n")
    return root


def test_a_daemon_over_good_and_broken_plugins(tmp_path: Path, start_daemon, broken_so,
                                               python_example: Path, elementwise_so: Path,
                                               elementwise_model: Path) -> None:
    plugins = tmp_path / "backends"
    expected = make_plugin_zoo(plugins, broken_so, python_example, elementwise_so)
    repo = _repo(tmp_path / "models", elementwise_model, {
        "ew-c": ["npu", "elementwise-c"],   # the npu plugin is there but unavailable
        "ew-py": ["onnx-reference"],
        "ew-default": None,                 # best available: npu absent -> cpu
    })
    config = tmp_path / "inferd.toml"
    config.write_text("[backends]\nprobe_timeout_s = 3.0\n")
    d = start_daemon("--config", str(config), "--models", str(repo),
                     "--backends-dir", str(plugins))
    with d.client() as c:
        pid = c.status()["pid"]
        assert pid == d.proc.pid

        # The good plugins serve inference through the daemon.
        x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
        for model in ("ew-c", "ew-py", "ew-default"):
            out = c.infer(model, {"x": x})
            np.testing.assert_allclose(out["y"], expected_relu_sigmoid(x), rtol=1e-6)

    # The choice per model shows in `inferctl models`.
    chosen = {m["name"]: m["backend"]
              for m in json.loads(inferctl(d.endpoint, "--json", "models"))}
    assert chosen == {"ew-c": "elementwise-c", "ew-py": "onnx-reference",
                      "ew-default": "onnxruntime"}
    table = inferctl(d.endpoint, "models")
    assert any(line.split()[:4] == ["ew-c", "ready", "1", "elementwise-c"]
               for line in table.splitlines())

    # Every candidate, with its stage and reason, in `inferctl --json backends`.
    view = json.loads(inferctl(d.endpoint, "--json", "backends"))
    assert view["search_path"] == [str(plugins.resolve())]
    assert view["search_path_source"] == "--backends-dir"
    got = {Path(c["path"]).name: c for c in view["candidates"]}
    assert set(got) == set(expected) | {f"built-in:{b.name}" for b in BUILTINS}
    for name, (stage, status, words) in expected.items():
        assert (got[name]["stage"], got[name]["status"]) == (stage, status), got[name]
        assert words in got[name]["reason"], got[name]
    backends = {b["id"]: b["status"] for b in view["backends"]}
    assert backends == {"onnxruntime": "registered", "elementwise-c": "registered",
                        "onnx-reference": "registered", "fake-npu": "unavailable",
                        "openvino": "registered", "onnxruntime-gpu": "unavailable"}
    text = inferctl(d.endpoint, "backends")
    assert "libsegv_backend.so" in text and "contract checked" in text

    # ... and one WARNING line each in the log, plus the skipped choice.
    log = d.log()
    for name, (stage, status, words) in expected.items():
        line = f"backend candidate {plugins / name} {status} at stage '{stage}': "
        if status in ("failed", "unavailable"):
            assert any(line in ln and words in ln and " WARNING " in ln
                       for ln in log.splitlines()), (name, log)
    assert ("model ew-c: passed over backend fake-npu: unavailable "
            "(no device node /dev/fake-npu0)") in log

    # The same process throughout.
    with d.client() as c:
        assert c.status()["pid"] == pid
    assert d.proc.poll() is None
    assert d.stop() == 0


def _empty_config(tmp_path: Path) -> str:
    """A config file of defaults, so that an installed /etc/inferd/inferd.toml does not
    leak into the test."""
    path = tmp_path / "empty.toml"
    path.write_text("")
    return str(path)


def test_the_daemon_starts_without_any_backends_directory(tmp_path: Path,
                                                          start_daemon) -> None:
    default = Path("/usr/lib/inferd/backends")
    if default.exists():
        pytest.skip(f"{default} exists on this machine (the in-process test "
                    f"test_a_missing_default_directory_is_fine still covers this)")
    d = start_daemon("--config", _empty_config(tmp_path), env={"INFERD_BACKENDS_PATH": None})
    with d.client() as c:
        view = c.backends()
    assert (view["search_path"], view["search_path_source"]) == ([], "default")
    assert [(b["id"], b["status"]) for b in view["backends"]] == [
        ("onnxruntime", "registered"), ("onnxruntime-gpu", "unavailable"),
        ("openvino", "registered")]
    assert d.stop() == 0


def test_the_environment_variable_sets_the_search_path(tmp_path: Path, start_daemon,
                                                       python_example: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    shutil.copy(python_example, a)
    d = start_daemon("--config", _empty_config(tmp_path),
                     env={"INFERD_BACKENDS_PATH": f"{a}:{b}:relative"})
    with d.client() as c:
        view = c.backends()
    assert view["search_path"] == [str(a.resolve())]
    assert view["search_path_source"] == "$INFERD_BACKENDS_PATH"
    assert "onnx-reference" in {x["id"] for x in view["backends"]}
    log = d.log()
    assert f"backends directory {b} (from $INFERD_BACKENDS_PATH) does not exist" in log
    assert "backends directory relative (from $INFERD_BACKENDS_PATH) is not an absolute" in log
    assert d.stop() == 0
