"""A stuck stage cannot wedge the daemon (issue 20 item 4), against a real daemon: a
graph node that never returns (the built-in ``sleep`` processor with ``ms = 1e9``,
standing for a hung user processor or driver) and a model whose backend's run blocks
(a test backend plugin: the one stand-in, for a driver that hangs).

- requests with a deadline get DEADLINE_EXCEEDED when it passes;
- the stuck stage is reported: one WARNING, ``status``, ``models``, the metric;
- unload answers within ``stuck_after_s`` with an error naming the stuck stage, and other
  models' load and a reload proceed;
- SIGTERM ends the daemon within ``shutdown_grace_s`` plus a few seconds, exit 0, the
  stuck thread named in the log.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from inferd.daemon.metrics import sample_value
from inferd.ipc.errors import ErrorCode
from tests.links import link_tree

pytestmark = pytest.mark.slow

HANG = """executor = "pipeline"
inputs = ["x"]
[outputs]
y = "sleep.x"
[[nodes]]
name = "sleep"
processor = "sleep"
params = { ms = 1e9 }
inputs = { x = "input.x" }
"""

BLOCKING_BACKEND = '''
import threading
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec)

NEVER = threading.Event()


class Blocked(LoadedModel):
    inputs = (TensorSpec("x", "float32", (None, 4)),)
    outputs = (TensorSpec("y", "float32", (None, 4)),)

    def run(self, inputs, outputs=None):
        NEVER.wait()  # a driver that never returns
        return {"y": inputs["x"]}

    def unload(self):
        pass


class Blocking(Backend):
    id = "blocking"
    version = "1.0"
    kind = DeviceKind.CPU

    def probe(self):
        return Probe(True, devices=("cpu",))

    def supports(self, model_path):
        return True, ""

    def load(self, model_path, options):
        return Blocked()


def create_backend():
    return Blocking()
'''

X = {"x": np.ones((1, 4), np.float32)}
STUCK_AFTER_S = 1.0
GRACE_S = 2.0


def _inferctl(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], capture_output=True, text=True, timeout=120)


def _until(condition, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture
def repo(short_tmp: Path, models_dir: Path) -> Path:
    root = short_tmp / "repo"
    link_tree(models_dir / "vad" / "1", root / "vad" / "1")
    (root / "hang").mkdir()
    (root / "hang" / "graph.toml").write_text(HANG)
    link_tree(models_dir / "ocr-cls" / "1", root / "stuckmodel" / "1")
    (root / "stuckmodel" / "model.toml").write_text('backends = ["blocking"]\n')
    (short_tmp / "backends").mkdir()
    (short_tmp / "backends" / "blocking.py").write_text(BLOCKING_BACKEND)
    (short_tmp / "inferd.toml").write_text(
        f"[models]\nrepository = \"{root}\"\nstuck_after_s = {STUCK_AFTER_S}\n"
        f"[server]\nshutdown_grace_s = {GRACE_S}\n")
    return root


def _start(start_daemon, short_tmp: Path):  # type: ignore[no-untyped-def]
    return start_daemon("--config", str(short_tmp / "inferd.toml"), "--backends-dir",
                        str(short_tmp / "backends"))


@pytest.mark.parametrize("target", ["hang", "stuckmodel"])
def test_a_stuck_stage_holds_no_deadline_no_control_operation_and_no_shutdown(
        start_daemon, short_tmp: Path, repo: Path, target: str) -> None:
    d = _start(start_daemon, short_tmp)
    with d.client(timeout=60) as c:
        # Loaded first: at load 5 a first request's load took longer than its 1 s, all six
        # expired in the queue, nothing ever ran, and no stage was stuck to report.
        c.load(target)
        # 1. deadlines: five requests queued behind the stuck one, 1 s each
        t0 = time.monotonic()
        first = c.submit("infer", target, X, timeout=1.0)
        pending = [c.submit("infer", target, X, timeout=1.0) for _ in range(5)]
        for p in [first, *pending]:
            reply = p.reply()
            assert reply.error is not None and reply.error.code is ErrorCode.DEADLINE_EXCEEDED, \
                reply.error
        assert time.monotonic() - t0 < 30  # 1 s + the watch's grain, on a busy machine
        # 2. reported: status, models, metric, one WARNING
        _until(lambda: target in c.status()["stuck"])
        stuck = c.status()["stuck"][target]
        row = next(m for m in c.models() if m["name"] == target)
        stage = "inferd-hang-sleep" if target == "hang" else "inferd-stuckmodel-infer-0"
        assert stage in stuck[0] and row["stuck"] and stage in row["stuck"][0], row
        shown = _inferctl(d.endpoint, "status").stdout
        assert f"stuck:    {target}: {stage} (" in shown, shown
        assert f"  stuck: {stage} (" in _inferctl(d.endpoint, "models", "-v").stdout
        samples = c.call("metrics")["samples"]
        assert sample_value(samples, "inferd_stuck_stages", model=target) == 1
        warnings = [line for line in d.log().splitlines() if "stage stuck:" in line]
        assert len(warnings) == 1 and stage in warnings[0], warnings
        # 3. control operations: unload answers with the stuck stage; others proceed
        t0 = time.monotonic()
        r = _inferctl(d.endpoint, "unload", target)
        assert r.returncode == 1 and stage in r.stderr, (r.stdout, r.stderr)
        assert time.monotonic() - t0 < STUCK_AFTER_S + 20
        r = _inferctl(d.endpoint, "load", "vad")
        assert r.returncode == 0, r.stderr
        r = _inferctl(d.endpoint, "reload")
        assert r.returncode == 0, r.stderr
        d.proc.send_signal(signal.SIGHUP)
        _until(lambda: d.log().count("configuration reloaded") >= 2)
        # stuck again, for the stop
        again = c.submit("infer", target, X, timeout=30.0)
        _until(lambda: target in c.status()["stuck"])
    # 4. shutdown: within the grace period and a few seconds, exit 0, the thread named
    t0 = time.monotonic()
    code = d.stop(timeout=GRACE_S + 20)
    took = time.monotonic() - t0
    log = d.log_path.read_text(errors="replace")
    assert code == 0, log
    assert took < GRACE_S + 10, (took, log)
    assert "stuck stages left to end with the process" in log and stage in log.split(
        "stuck stages left to end with the process")[1], log
    del again


def test_the_watchdog_health_check_fails_while_every_inference_thread_is_stuck(
        short_tmp: Path, repo: Path) -> None:
    """[systemd] watchdog_stuck: the health probe (what decides the WATCHDOG=1 pings)
    names the model whose every inference thread is stuck; off, it stays healthy."""
    import threading

    from inferd.daemon.config import load_config
    from inferd.daemon.runtime import Runtime
    from inferd.ipc import Client

    config = load_config(None, {"server.socket": f"ipc://{short_tmp}/wd.sock",
                                "models.repository": str(repo),
                                "models.stuck_after_s": STUCK_AFTER_S,
                                "backends.paths": [str(short_tmp / "backends")],
                                "metrics.textfile": "", "systemd.watchdog_stuck": True})
    rt = Runtime(config)
    rt.start()
    io = threading.Thread(target=rt.serve, name="test-io")
    io.start()
    try:
        assert rt.ready.wait(60)
        assert rt._health(5.0) is None
        with Client(rt.config.server.socket, timeout=60) as c:
            c.submit("infer", "stuckmodel", X, timeout=30.0)
            _until(lambda: list(rt.watch.all_stuck()) == ["stuckmodel"])
            reason = rt._health(5.0)
            assert reason is not None and "every inference thread of model stuckmodel" \
                in reason and "inferd-stuckmodel-infer-0" in reason, reason
            rt.config.systemd.watchdog_stuck = False  # the operator's choice: report only
            assert rt._health(5.0) is None
    finally:
        rt.stop()
        io.join(60)
