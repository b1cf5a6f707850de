"""Metrics against a real daemon: the textfile parses with prometheus_client's parser and
its counts are the requests this test made; the ``metrics`` op; the HTTP endpoint on a
unix socket; ``[metrics] listen`` refuses network addresses; ``inferctl top --once``."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd.daemon.metrics_http import Listen, parse_listen
from inferd.ipc import RequestError

OK_REQUESTS = 7
BAD_REQUESTS = 3


def families(text: str) -> dict[str, list]:
    """{sample name: [(labels, value)]} from a Prometheus text exposition."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x
                                                             for k, x in labels.items()))


def poll(fn, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        result = fn()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def _metrics_daemon(start_daemon, models_dir: Path, tmp: Path):
    """A daemon that has answered OK_REQUESTS + BAD_REQUESTS requests to ocr-cls and one
    to a model that does not exist. Placement "first": the counts of loads and runs are
    the requests' own, whatever measuring would do between the tests."""
    config = tmp / "inferd.toml"
    config.write_text(f'[metrics]\ntextfile = "{tmp}/metrics.prom"\ninterval_s = 0.1\n'
                      f'listen = "unix:{tmp}/metrics.sock"\n[placement]\nmode = "first"\n')
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls",
                     env={"INFERD_CONFIG": str(config)})
    x = np.zeros((1, 3, 48, 192), np.float32)
    with d.client() as c:
        for _ in range(OK_REQUESTS):
            c.infer("ocr-cls", {"x": x})
        for _ in range(BAD_REQUESTS):
            with pytest.raises(RequestError):
                c.infer("ocr-cls", {"x": np.zeros((1, 2), np.float32)})
        with pytest.raises(RequestError):
            c.infer("no-such-model", {"x": x})
    return d, tmp


@pytest.fixture(scope="module")
def metrics_daemon(models_dir, module_daemon):
    """One for the tests that only read its metrics (other ops than infer count
    nowhere)."""
    return _metrics_daemon(module_daemon, models_dir, module_daemon.workdir)


@pytest.fixture
def own_metrics_daemon(models_dir, start_daemon, short_tmp):
    """One for a test that changes what the others read."""
    return _metrics_daemon(start_daemon, models_dir, short_tmp)


def _check_counts(s: dict[str, list]) -> None:
    assert value(s, "inferd_requests_total", model="ocr-cls", code="OK") == OK_REQUESTS
    assert value(s, "inferd_requests_total", model="ocr-cls",
                 code="INVALID_ARGUMENT") == BAD_REQUESTS
    assert value(s, "inferd_requests_total", model="no-such-model", code="NOT_FOUND") == 1
    assert value(s, "inferd_request_seconds_count", model="ocr-cls") == \
        OK_REQUESTS + BAD_REQUESTS
    # only the good requests reach the model's run
    assert value(s, "inferd_run_seconds_count", model="ocr-cls") == OK_REQUESTS
    assert value(s, "inferd_queue_wait_seconds_count", model="ocr-cls") == OK_REQUESTS
    assert value(s, "inferd_batch_size_sum", model="ocr-cls") == OK_REQUESTS
    assert value(s, "inferd_model_loads_total", model="ocr-cls", result="ok") == 1
    assert value(s, "inferd_model_state", model="ocr-cls", version="1", state="ready") == 1
    assert value(s, "inferd_model_batch_limit", model="ocr-cls", version="1") >= 1
    assert value(s, "inferd_model_state", model="vad", state="unloaded") == 1
    assert value(s, "inferd_model_memory_bytes", model="ocr-cls") > 0
    assert value(s, "inferd_backend_up", backend="onnxruntime") == 1
    assert value(s, "inferd_process_resident_memory_bytes") > 20 * 2**20
    assert value(s, "inferd_uptime_seconds") > 0


@pytest.mark.slow
def test_textfile_counts_the_requests_made(metrics_daemon):
    d, tmp = metrics_daemon
    path = tmp / "metrics.prom"

    def current():
        if not path.exists():
            return None
        s = families(path.read_text())
        return s if value(s, "inferd_requests_total") == OK_REQUESTS + BAD_REQUESTS + 1 \
            else None
    samples = poll(current)
    assert samples, f"textfile never showed the requests:\n{path.read_text()}"
    _check_counts(samples)
    assert not list(tmp.glob(".metrics.prom.*")), "temporary file left beside the textfile"


@pytest.mark.slow
@pytest.mark.parametrize("systemd", [False, True], ids=["by-hand", "under-systemd"])
def test_a_textfile_whose_directory_is_absent(start_daemon, models_dir, short_tmp: Path,
                                              systemd: bool) -> None:
    """Started from the source tree with the shipped config (textfile
    /run/inferd/metrics.prom, a directory only the package's unit makes), the daemon
    warned that it could not write the file (issue 31 item 14). Outside systemd the
    textfile is now off, said once at INFO; under systemd ($NOTIFY_SOCKET) a directory
    missing is the unit's fault, and the warning stays."""
    path = short_tmp / "absent" / "metrics.prom"
    config = short_tmp / "inferd.toml"
    config.write_text(f'[metrics]\ntextfile = "{path}"\ninterval_s = 0.1\n')
    env = {"INFERD_CONFIG": str(config)}
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # what systemd listens on
    notify.bind(str(short_tmp / "notify"))
    if systemd:
        env["NOTIFY_SOCKET"] = str(short_tmp / "notify")
    try:
        d = start_daemon("--models", str(models_dir), env=env)
        with d.client() as c:  # the metrics are still served
            assert "inferd_uptime_seconds" in c.call("metrics")["text"]
        warning = f"cannot write the metrics textfile {path} (metrics.textfile)"
        if systemd:
            assert poll(lambda: warning in d.log()), d.log()
        assert d.stop() == 0  # a writer writes once more at stop
    finally:
        notify.close()
    log = d.log_path.read_text()
    off = (f"INFO inferd.daemon.metrics: metrics textfile {path} off: its directory "
           f"{path.parent} does not exist and inferd was not started by systemd")
    if systemd:
        assert off not in log and log.count(warning) == 1, log
    else:
        assert log.count(off) == 1 and warning not in log, log
    assert not path.parent.exists()


@pytest.mark.slow
def test_metrics_op_and_http_endpoint(metrics_daemon):
    d, tmp = metrics_daemon
    with d.client() as c:
        result = c.call("metrics")
        assert value(families(result["text"]), "inferd_open_peers") >= 1  # this client
    _check_counts(families(result["text"]))
    by_name: dict[str, list] = {}
    for name, labels, v in result["samples"]:
        by_name.setdefault(name, []).append((labels, v))
    _check_counts(by_name)

    class UnixHTTP(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(tmp / "metrics.sock"))
    conn = UnixHTTP("localhost")
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/plain")
    _check_counts(families(response.read().decode()))
    conn.close()


@pytest.mark.slow
def test_inferctl_top_once(metrics_daemon):
    d, _ = metrics_daemon
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", d.endpoint,
                        "top", "--once"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("inferd  up") and "rss" in lines[0]
    header = lines[2].split()
    assert header[:5] == ["MODEL", "STATE", "REQ/S", "REQUESTS", "ERRORS"]
    row = next(line.split() for line in lines[3:] if line.startswith("ocr-cls "))
    assert row[1] == "ready"
    assert int(row[3]) == OK_REQUESTS + BAD_REQUESTS and int(row[4]) == BAD_REQUESTS


@pytest.mark.parametrize("text, expected", [
    ("", None),
    ("unix:/run/inferd/metrics.sock", Listen(unix="/run/inferd/metrics.sock")),
    ("localhost:9464", Listen(host="127.0.0.1", port=9464)),
    ("127.0.0.1:9464", Listen(host="127.0.0.1", port=9464)),
    ("127.0.0.53:80", Listen(host="127.0.0.53", port=80)),
    ("[::1]:9464", Listen(host="::1", port=9464)),
])
def test_listen_accepts_local_addresses(text, expected):
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["0.0.0.0:9464", "192.168.1.5:9464", "[::]:9464",
                                  "example.org:9464", "localhost", "localhost:0",
                                  "unix:relative.sock", ":9464", 9464])
def test_listen_refuses_anything_else(text):
    with pytest.raises(ValueError):
        parse_listen(text)


@pytest.mark.slow
def test_daemon_refuses_a_network_listen_address(start_daemon, short_tmp: Path):
    config = short_tmp / "inferd.toml"
    config.write_text('[metrics]\nlisten = "0.0.0.0:9464"\n')
    d = start_daemon(env={"INFERD_CONFIG": str(config)}, ready=False)
    assert d.proc.wait(30) == 2
    assert "[metrics] listen = '0.0.0.0:9464'" in d.log() and "never a network" in d.log()


@pytest.mark.slow
def test_one_unload_counts_once(own_metrics_daemon):
    d, _ = own_metrics_daemon
    with d.client() as c:
        c.unload("ocr-cls")
        s = families(c.call("metrics")["text"])
    assert value(s, "inferd_model_unloads_total", model="ocr-cls") == 1
    assert value(s, "inferd_model_evictions_total", model="ocr-cls") == 0


@pytest.mark.slow
def test_graph_requests_are_counted(start_daemon, models_dir):
    """Requests to a graph count under the graph's name (they were not counted at all
    before the ticket became the request's record), its model nodes' calls under each
    model, and ``inferctl top`` shows both."""
    d = start_daemon("--models", str(models_dir))
    blank = np.full((64, 96, 3), 255, np.uint8)  # no text: only the detector runs
    with d.client(timeout=120) as c:
        for _ in range(5):
            assert c.infer("ocr", {"image": blank})["texts"].shape == (0,)
        with pytest.raises(RequestError):
            c.infer("ocr", {"image": np.zeros((4, 4), np.float32)})
        s = families(c.call("metrics")["text"])
    assert value(s, "inferd_requests_total", model="ocr", code="OK") == 5
    assert value(s, "inferd_requests_total", model="ocr", code="INVALID_ARGUMENT") == 1
    assert value(s, "inferd_request_seconds_count", model="ocr") == 6
    assert value(s, "inferd_requests_total", model="ocr-det", code="OK") == 5
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", d.endpoint,
                        "top", "--once"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    row = next(line.split() for line in r.stdout.splitlines() if line.startswith("ocr "))
    assert (int(row[3]), int(row[4])) == (6, 1), r.stdout
