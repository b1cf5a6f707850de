"""inferctl against a real daemon: tables, --json, infer with .npy files, wait, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def inferctl(endpoint: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def daemon(models_dir, module_daemon, tmp_path_factory):
    """One daemon for the module's tests: each leaves it as it found it (ocr-cls loaded,
    vad unloaded). Placement "first": a measured move of ocr-cls after one test's
    requests would change the backend another test reads."""
    config = tmp_path_factory.mktemp("inferctl") / "inferd.toml"
    config.write_text('[placement]\nmode = "first"\n')
    return module_daemon("--config", str(config), "--models", str(models_dir),
                         "--preload", "ocr-cls")


def test_status_and_models_tables_and_json(daemon):
    r = inferctl(daemon.endpoint, "status")
    assert r.returncode == 0 and "ready:    yes" in r.stdout and "onnxruntime" in r.stdout
    r = inferctl(daemon.endpoint, "models")
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["MODEL", "STATE", "VERSION", "BACKEND"]
    assert any(line.split()[:2] == ["ocr-cls", "ready"] for line in lines)
    r = inferctl(daemon.endpoint, "--json", "models")
    models = {m["name"]: m for m in json.loads(r.stdout)}
    assert models["ocr-cls"]["backend"] == "onnxruntime"
    assert models["ocr-cls"]["inputs"][0]["shape"][1] == 3
    assert models["vad"]["state"] == "unloaded"


def test_load_unload(daemon):
    r = inferctl(daemon.endpoint, "load", "vad")
    assert r.returncode == 0 and "vad: ready" in r.stdout
    r = inferctl(daemon.endpoint, "unload", "vad")
    assert r.returncode == 0 and "vad: unloaded" in r.stdout


def test_infer_with_npy_files(daemon, short_tmp):
    x = np.random.default_rng(3).random((1, 3, 48, 192), dtype=np.float32)
    np.save(short_tmp / "x.npy", x)
    out = short_tmp / "out"
    r = inferctl(daemon.endpoint, "infer", "ocr-cls", "-i", f"x={short_tmp / 'x.npy'}",
                 "-o", str(out))
    assert r.returncode == 0, r.stderr
    files = list(out.glob("*.npy"))
    assert len(files) == 1
    with daemon.client() as c:
        ref = next(iter(c.infer("ocr-cls", {"x": x}).values()))
    np.testing.assert_array_equal(np.load(files[0]), ref)


def test_error_reply_gives_code_on_stderr_and_exit_1(daemon):
    r = inferctl(daemon.endpoint, "load", "no-such-model")
    assert r.returncode == 1
    assert r.stderr.startswith("inferctl: NOT_FOUND: model 'no-such-model' not found")


def test_wait(daemon, short_tmp):
    assert inferctl(daemon.endpoint, "wait", "--timeout", "10").returncode == 0
    r = inferctl(f"ipc://{short_tmp}/nobody.sock", "wait", "--timeout", "0.5")
    assert r.returncode == 1 and "not ready after 0.5 s" in r.stderr


def closed_pipe_run(*args: str) -> subprocess.CompletedProcess:
    """inferctl ARGS with its stdout a pipe whose reader is already gone (what `| head`
    leaves once head has its lines)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", *args],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["top", "--once"], ["models"], ["--json", "status"],
                                  ["metrics"]])
def test_output_into_a_closed_pipe_ends_quietly(daemon, args):
    r = closed_pipe_run("--socket", daemon.endpoint, *args)
    assert r.stderr == "" and r.returncode == 128 + signal.SIGPIPE, r.stderr



def test_a_graphs_row_counts_its_requests(daemon):
    """`inferctl models` showed REQUESTS 0 for the ocr graph after four graph requests,
    which the metrics counted (issue 31 item 14): the row reads the metrics' count."""
    from inferd.ipc import RequestError

    blank = np.full((48, 160, 3), 255, np.uint8)
    try:
        with daemon.client(timeout=120) as c:
            for _ in range(4):
                assert c.infer("ocr", {"image": blank})["texts"].tolist() == []
            with pytest.raises(RequestError):
                c.infer("ocr", {"image": np.zeros((4, 4), np.float32)})
            ok = sum(v for n, lab, v in c.call("metrics")["samples"]
                     if n == "inferd_requests_total" and lab == {"model": "ocr", "code": "OK"})
        assert ok == 4
        r = inferctl(daemon.endpoint, "--json", "models")
        row = next(m for m in json.loads(r.stdout) if m["name"] == "ocr")
        assert (row["kind"], row["requests"], row["failed_requests"]) == ("graph", 4, 1), row
        lines = inferctl(daemon.endpoint, "models").stdout.splitlines()
        column = lines[0].index("REQUESTS")
        line = next(ln for ln in lines if ln.split()[0] == "ocr")
        assert line[column:].split()[0] == "4", lines
    finally:
        with daemon.client(timeout=60) as c:  # as the module's other tests expect it
            for name in ("ocr", "ocr-det", "ocr-rec"):
                c.unload(name)
