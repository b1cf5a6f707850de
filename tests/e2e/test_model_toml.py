"""model.toml through a real daemon: a bad file fails only its own model (the request
names the model, the file and the key), is logged, and never breaks a reload or a SIGHUP
for the others; the reload summary reports model.toml and pin changes; a model added
while the daemon runs is found by its first request."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from inferd.ipc import ErrorCode, RequestError
from tests.links import link_file


def _model(repo: Path, models_dir: Path, name: str, version: int = 1,
           demo: str = "ocr-cls") -> None:
    d = repo / name / str(version)
    d.mkdir(parents=True)
    link_file(models_dir / demo / "1" / "model.onnx", d / "model.onnx")


def _poll(cond: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _inferctl(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_a_bad_model_toml_fails_only_its_model_and_reloads_go_on(
        start_daemon, short_tmp: Path, models_dir: Path, demo_inputs) -> None:
    repo = short_tmp / "repo"
    _model(repo, models_dir, "a")
    _model(repo, models_dir, "b")
    (repo / "a" / "model.toml").write_text('instances = "two"\n')
    d = start_daemon("--models", str(repo))
    x = demo_inputs["ocr-cls"]
    with d.client() as c:
        with pytest.raises(RequestError) as e:
            c.infer("a", x)
        assert e.value.code is ErrorCode.INTERNAL
        assert (f"model a: {repo.resolve() / 'a' / 'model.toml'}: instances = 'two': "
                f"expected a positive integer") in e.value.message
        assert c.infer("b", x)
        # A file that is not UTF-8 (and then one that is not TOML): the next reload and
        # SIGHUP still pick up a new version of the other model.
        (repo / "a" / "model.toml").write_bytes(b'note = "\xff"\n')
        _model(repo, models_dir, "b", 2)
        r = _inferctl(d.endpoint, "reload")
        assert r.returncode == 0, r.stderr
        assert "b: version 1 -> 2" in r.stdout and "a: model.toml changed" in r.stdout
        assert [m["version"] for m in c.models() if m["name"] == "b"] == [2]
        (repo / "a" / "model.toml").write_text("instances = \n")
        _model(repo, models_dir, "b", 3)
        d.proc.send_signal(signal.SIGHUP)
        _poll(lambda: [m["version"] for m in c.models() if m["name"] == "b"] == [3])
        row = next(m for m in c.models() if m["name"] == "a")
        assert row["state"] == "failed" and "Invalid value" in row["error"]
        assert c.infer("b", x)
    log = d.log()
    assert "model a cannot be served: model a: cannot read" in log
    assert "not UTF-8" in log and "Traceback" not in log


@pytest.mark.slow
def test_reload_reports_model_toml_and_pin_changes_and_new_models_are_found(
        start_daemon, short_tmp: Path, models_dir: Path, demo_inputs) -> None:
    repo = short_tmp / "repo"
    _model(repo, models_dir, "a")
    d = start_daemon("--models", str(repo))
    assert _inferctl(d.endpoint, "reload").stdout.strip() == "reloaded: nothing changed"
    (repo / "a" / "model.toml").write_text("pin = true\nmax_batch = 4\n")
    out = _inferctl(d.endpoint, "reload").stdout
    assert "changed: a: model.toml changed, a: now pinned" in out, out
    # A model directory created while the daemon runs: its first request finds it.
    _model(repo, models_dir, "late")
    with d.client() as c:
        assert c.infer("late", demo_inputs["ocr-cls"])
        with pytest.raises(RequestError) as e:
            c.infer("nope", demo_inputs["ocr-cls"])
        assert e.value.code is ErrorCode.NOT_FOUND and "available: a, late" in e.value.message
    assert "model late found in" in d.log()
