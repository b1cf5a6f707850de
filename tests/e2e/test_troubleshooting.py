"""docs/troubleshooting.md stays true: every log line and command output it quotes in a
code block is produced here by provoking it on a real daemon (numbers, pids and paths
are compared as placeholders). A quote with no provoker fails the first test, so a new
recipe must come with its test.

Only the absence of onnxruntime cannot exist on this machine: a stub package that
raises ModuleNotFoundError on import stands in for it (PYTHONPATH, daemon only).
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import Client, RequestError
from inferd.ipc.protocol import Op
from tests.links import link_file

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
DOC_SOCKET = "/run/inferd/inferd.sock"
DOC_REPO = "/var/lib/inferd/models"


def quotes() -> list[str]:
    """Every line of the page's code blocks except shell commands and status boxes."""
    out, block, lang = [], False, ""
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            block, lang = not block, line[3:].strip()
            continue
        if block and lang != "sh" and line.strip():
            out.append(line)
    return out


def norm(text: str) -> str:
    """Numbers (pids, uids, sizes, times, positions) become N, runs of spaces one."""
    return re.sub(r" +", " ", re.sub(r"\d+(\.\d+)?", "N", text)).strip()


def found(quote: str, produced: str, **paths: str) -> bool:
    """Whether ``quote`` is one of ``produced``'s lines (or inside one), once the
    produced paths are written as the page writes them (``paths``: real -> page)."""
    for real, page in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        produced = produced.replace(real, page)
    return any(norm(quote) in norm(line) for line in produced.splitlines())


# quote (its start) -> the test below that provokes it
PROVOKERS = {
    'Status: "ready; backends: 2 loaded (onnxruntime, openvino)': "everyday",
    "inferctl: UNAVAILABLE: permission denied on": "socket_group",
    "inferctl: PERMISSION_DENIED: permission denied: uid": "everyday",
    "inferctl: UNAVAILABLE: no inferd socket at": "everyday",
    "inferd: invalid configuration:": "everyday",
    "cannot start: another inferd": "everyday",
    "built-in:onnxruntime  built-in  opened  failed": "no_backend",
    "backend candidate built-in:onnxruntime failed at stage 'opened'": "no_backend",
    "inferctl: UNAVAILABLE: model ocr-cls version 1 failed to load": "no_backend",
    "ready; backends: 0 loaded, 3 failed": "no_backend",
    "inferctl: NOT_FOUND: model 'ocr-dte' not found": "everyday",
    "model a cannot be served:": "bad_files",
    "graph g failed to load:": "bad_files",
    "ERROR inferd.daemon.runtime: preloaded graph g failed to load:": "bad_files",
    "ERROR inferd.daemon.workers.channel: a worker sent a message": "hostile_worker",
    "RESOURCE_EXHAUSTED: model ocr-det version 1: queue is full": "limits",
    "RESOURCE_EXHAUSTED: message of": "limits",
    "requests of up to": "limits",
    "RESOURCE_EXHAUSTED: this client has": "limits",
    "RESOURCE_EXHAUSTED: model ocr-det version 1 failed to load": "limits",
    "model vad version 1 unloaded: evicted to make room": "limits",
    "watchdog: not pinging systemd: worker threads are gone": "watchdog",
    "model ocr-rec version 1: threads did not finish within": "sigterm",
    "stage stuck: ocr-det inferd-ocr-det-infer-0": "stuck",
    "inferctl: DEADLINE_EXCEEDED: ocr-det: the deadline of": "stuck",
    "model ocr-det version 1: threads did not finish within": "stuck",
    "inferctl: UNAVAILABLE: model ocr-det: unloaded, but a stage did not end": "stuck",
    "stopping: stuck stages left to end with the process": "stuck",
    "inferd exited cleanly; model threads still running": "sigterm",
    "model ocr-cls version 1: off-by-half is never chosen": "placement",
    "model ocr-cls version 1: measuring its placement postponed": "placement",
    "2048 connections are open, the limit (server.max_connections": "hostile_clients",
    "closed 16 new connection(s):": "hostile_clients",
    "RESOURCE_EXHAUSTED: the daemon holds": "hostile_clients",
    "… 213 more like this in the last 10 s:": "hostile_clients",
    "inferctl: INTERNAL: model garbage version 1 failed to load and its files": "hostile_clients",
    "cannot start: refusing to write": "hostile_files",
    "model vad cannot be served: model vad: cannot read": "hostile_files",
    "model ocr-cls version 1: its files changed on disk": "hostile_files",
    "open-files limit raised from": "hostile_files",
    "metrics textfile /run/inferd/metrics.prom off:": "metrics_textfile",
    "cannot write the metrics textfile": "metrics_textfile",
    "metrics textfile /run/inferd/metrics.prom written again": "metrics_textfile",
    "placement decisions in": "decisions_file",
    "RESOURCE_EXHAUSTED: this request's tensors would take": "decode_cost",
    "inferctl: UNAVAILABLE: engine onnxruntime (worker": "worker_crash",
    "ERROR inferd.daemon.workers.pool: engine onnxruntime": "worker_crash",
    "INFO inferd.daemon.workers.pool: worker onnxruntime started": "worker_crash",
    "  worker: onnxruntime, pid": "worker_crash",
    "ERROR inferd.daemon.workers.zygote: the worker zygote (pid": "zygote_death",
    "backend candidate /usr/lib/inferd/backends/planted.py": "strict_modes",
    "processor file /usr/lib/inferd/processors/mine.py": "strict_modes",
    "model conv version 1 failed to load: refusing": "strict_modes",
    "shared-memory regions: at most": "shm_registration",
    "RESOURCE_EXHAUSTED: at most 64 regions per connection;": "shm_registration",
    "RESOURCE_EXHAUSTED: at most 84 regions per user": "shm_registration",
    "RESOURCE_EXHAUSTED: uid 1000 has 12 shared-memory": "shm_registration",
    "INVALID_ARGUMENT: a shared-memory message nests": "shm_registration",
    "closed the shared-memory registration connection": "shm_registration",
    "FAILED_PRECONDITION: stream mic0 of vad": "streams",
    "INFO inferd.daemon.streams:": "streams",
    "RESOURCE_EXHAUSTED: model vad: ": "streams",
    "INVALID_ARGUMENT: stream mic0 of vad": "streams",
}


def _provoker(quote: str) -> str | None:
    return next((t for start, t in PROVOKERS.items() if quote.startswith(start)), None)


def _quotes_of(name: str) -> list[str]:
    return [q for q in quotes() if _provoker(q) == name]


def test_every_quote_on_the_page_has_a_provoker() -> None:
    unguarded = [q for q in quotes() if _provoker(q) is None]
    assert unguarded == [], "quote without a test in tests/e2e/test_troubleshooting.py"
    assert set(PROVOKERS.values()) <= {n.removeprefix("test_") for n in globals()
                                       if n.startswith("test_")}


def _inferctl(endpoint: str, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], capture_output=True, text=True, timeout=120, **kw)


def _model(repo: Path, models_dir: Path, name: str, demo: str) -> None:
    link_file(models_dir / demo / "1" / "model.onnx", repo / name / "1" / "model.onnx")


def _check(name: str, produced: str, **paths: str) -> None:
    for q in _quotes_of(name):
        assert found(q, produced, **paths), f"not produced: {q}\n--- produced:\n{produced}"


@pytest.mark.slow
def test_everyday(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """Status line, refused client, no socket, bad drop-in, second daemon, NOT_FOUND."""
    config = short_tmp / "inferd.toml"
    config.write_text(f"[access]\nuids = [{os.getuid() + 4242}]\n")
    refused = start_daemon("--config", str(config), "--models", str(models_dir),
                           "--preload", "ocr-det", "--preload", "ocr-rec", ready=False)
    deadline = time.monotonic() + 120
    while "ready;" not in refused.log():
        assert time.monotonic() < deadline, refused.log()
        time.sleep(0.1)
    sock = str(refused.socket_path)
    out = [f'Status: "{line.split("inferd.daemon.runtime: ", 1)[1]}"'
           for line in refused.log().splitlines() if "runtime: ready;" in line]
    out.append(_inferctl(refused.endpoint, "ping").stderr)
    out.append(_inferctl(f"ipc://{short_tmp}/nothing.sock", "ping").stderr)
    # a second daemon on the same socket
    again = subprocess.run([sys.executable, "-m", "inferd.daemon.main", "--socket",
                            refused.endpoint, "--models", str(models_dir)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "INFERD_CONFIG": str(config)})
    assert again.returncode == 1
    out.append(again.stderr)
    # a drop-in with a misspelt key
    (short_tmp / "conf.d").mkdir()
    dropin = short_tmp / "conf.d" / "50-ocr.toml"
    dropin.write_text("[models]\npreloads = [\"ocr-det\"]\n")
    bad = subprocess.run([sys.executable, "-m", "inferd.daemon.main", "--config",
                          str(config), "--socket", f"ipc://{short_tmp}/x.sock"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    out.append(bad.stderr)
    dropin.unlink()
    served = start_daemon("--models", str(models_dir), workdir=short_tmp / "conf.d")
    out.append(_inferctl(served.endpoint, "infer", "ocr-dte").stderr)
    _check("everyday", "\n".join(out), **{sock: DOC_SOCKET, str(short_tmp / "nothing.sock"):
                                          DOC_SOCKET, str(models_dir): DOC_REPO,
                                          str(dropin): "/etc/inferd/conf.d/50-ocr.toml"})


@pytest.mark.slow
def test_socket_group(start_daemon, short_tmp: Path) -> None:
    """A user outside the socket's group: the client says so before sending."""
    python = Path("/usr/bin/python3")
    check = subprocess.run([str(python), "-c", "import zmq, numpy"], capture_output=True)
    if os.getuid() != 0 or check.returncode != 0:
        if os.environ.get("INFERD_CI"):
            pytest.fail("CI runs as root with python3-zmq and python3-numpy")
        pytest.skip("needs root and the system python3 with zmq and numpy (another user "
                    "cannot run this venv's python)")
    d = start_daemon()
    d.workdir.chmod(0o755)  # the directory is open, the socket (0660, root) is not
    # The source tree as the package `inferd`, for the system python of the other user.
    pkg = short_tmp / "pkg" / "inferd"
    pkg.mkdir(parents=True)
    root = Path(__file__).resolve().parents[2]
    for sub in ("ipc", "libbackends"):
        (pkg / sub).symlink_to(root / sub)
    (short_tmp / "pkg").chmod(0o755)
    pkg.chmod(0o755)
    r = subprocess.run([str(python), "-m", "inferd.ipc.inferctl", "--socket", d.endpoint,
                        "ping"], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(short_tmp / "pkg"), "PATH": "/usr/bin:/bin"},
                       preexec_fn=lambda: (os.setgroups([]), os.setgid(65534),
                                           os.setuid(65534)))
    assert r.returncode == 1, r.stderr
    _check("socket_group", r.stderr, **{str(d.socket_path): DOC_SOCKET})


@pytest.mark.slow
def test_no_backend(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    for engine in ("onnxruntime", "openvino"):  # no engine importable: no built-in
        stub = short_tmp / "stub" / engine
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{engine}'\", name='{engine}')\n")
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls",
                     env={"PYTHONPATH": str(short_tmp / "stub")})
    x = short_tmp / "x.npy"
    np.save(x, np.zeros((1, 3, 48, 192), np.float32))
    out = [_inferctl(d.endpoint, "backends").stdout,
           _inferctl(d.endpoint, "infer", "ocr-cls", "-i", f"x={x}").stderr, d.log()]
    _check("no_backend", "\n".join(out))


@pytest.mark.slow
def test_bad_files(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    repo = short_tmp / "repo"
    _model(repo, models_dir, "a", "ocr-cls")
    (repo / "a" / "model.toml").write_text('instances = "two"\n')
    (repo / "g").mkdir()
    (repo / "g" / "graph.toml").write_text(
        'inputs = ["x"]\n[outputs]\ny = "a.y"\n[[nodes]]\nname = "a"\nprocessor = "softmax"\n'
        'params = { input = "x" }\ninputs = { x = "ghost.x" }\n')
    d = start_daemon("--models", str(repo), "--preload", "g")
    with d.client() as c:
        with pytest.raises(RequestError):
            c.call(Op.LOAD, "g")
        rows = {m["name"]: m for m in c.models()}
    assert rows["a"]["state"] == rows["g"]["state"] == "failed"
    _check("bad_files", d.log(), **{str(repo.resolve()): DOC_REPO})


@pytest.mark.slow
def test_limits(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """Queue full, message too large, a load over the budget, an eviction."""
    repo = short_tmp / "repo"
    for name in ("ocr-det", "ocr-cls", "vad"):
        _model(repo, models_dir, name, name)
    (repo / "ocr-det" / "model.toml").write_text("queue_size = 1\n")
    out = []
    # 1. No budget: measure two small models, then flood a model whose queue holds one.
    d0 = start_daemon("--models", str(repo), workdir=_dir(short_tmp / "d0"))
    with d0.client(timeout=120) as c:
        x = np.zeros((1, 3, 640, 640), np.float32)
        for p in [c.submit(Op.INFER, "ocr-det", inputs={"x": x}) for _ in range(8)]:
            r = p.reply()
            if r.error is not None:
                out.append(f"{r.error.code}: {r.error.message}")
    # 1b. A client may have one request in flight: its second is refused at once.
    config = short_tmp / "one.toml"
    config.write_text("[server]\nmax_requests_per_client = 1\n")
    d3 = start_daemon("--config", str(config), "--models", str(repo), "--preload", "ocr-det",
                      workdir=_dir(short_tmp / "d3"))
    with d3.client(timeout=120) as c:
        x = np.zeros((1, 3, 640, 640), np.float32)
        for p in [c.submit(Op.INFER, "ocr-det", inputs={"x": x}) for _ in range(3)]:
            r = p.reply()
            if r.error is not None:
                out.append(f"{r.error.code}: {r.error.message}")
    d3.stop()
    # 2. A budget of 1 MiB and messages of at most 1 MiB.
    config = short_tmp / "small.toml"
    config.write_text('[server]\nmax_message_bytes = "1MiB"\n[cache]\nmax_memory = "1MiB"\n')
    d1 = start_daemon("--config", str(config), "--models", str(repo),
                      workdir=_dir(short_tmp / "d1"))
    # in frames whatever the size (the Python client would move the 1.8 MB into shared
    # memory), so that the message limit answers
    with Client(d1.endpoint, timeout=60, max_inline_bytes=None) as c:
        for model, x in (("ocr-det", np.zeros((1, 3, 64, 64), np.float32)),
                         ("ocr-cls", np.zeros((4, 3, 48, 768), np.float32))):
            with pytest.raises(RequestError) as e:
                c.infer(model, {"x": x})
            out.append(f"{e.value.code}: {e.value.message}")
    out.append(d1.log())
    # 3. Room for either small model, not both: the second evicts the first. The figures
    # are this daemon's own, the budget put in force by a reload: what an engine's
    # import counts (its worker's PSS) differed by up to 8.5 MiB between two daemons,
    # more than the half of ocr-cls's 2.8 MiB this budget leaves over
    config = short_tmp / "budget.toml"
    # placement "first": no rival on trial holds a share of this tight budget
    config.write_text('[placement]\nmode = "first"\n')
    d2 = start_daemon("--config", str(config), "--models", str(repo),
                      workdir=_dir(short_tmp / "d2"))
    with d2.client(timeout=60) as c:
        vad, cls = c.load("vad")["memory_bytes"], c.load("ocr-cls")["memory_bytes"]
        engines = sum(c.status()["cache"]["engines_bytes"].values())
        assert vad and cls
        c.unload("ocr-cls")
        config.write_text(f"[cache]\nmax_memory = {engines + max(vad, cls) + min(vad, cls) // 2}"
                          '\n[placement]\nmode = "first"\n')
        assert _inferctl(d2.endpoint, "reload").returncode == 0
        c.load("ocr-cls")
    _check("limits", "\n".join(out) + "\n" + d2.log())


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


def _watchdog_on(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    """systemd's watchdog as a Runtime in this process sees it: its notify socket."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(short_tmp / "notify"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_tmp / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    return notify


@pytest.mark.slow
def test_watchdog(short_tmp: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch,
                  caplog: pytest.LogCaptureFixture) -> None:
    """A worker thread that died: the watchdog stops pinging systemd and says why."""
    from inferd.daemon.config import load_config
    from inferd.daemon.runtime import Runtime
    from inferd.daemon.model_threads import STOP

    notify = _watchdog_on(short_tmp, monkeypatch)
    caplog.set_level(logging.ERROR, "inferd.daemon.systemd")
    rt = Runtime(load_config(None, {"server.socket": f"ipc://{short_tmp}/w.sock",
                                    "models.repository": str(models_dir),
                                    "models.preload": ["ocr-det"]}))
    rt.start()
    serve = threading.Thread(target=rt.serve, name="test-serve")
    serve.start()
    try:
        assert rt.ready.wait(60)
        rt.models.entry("ocr-det").queue.put(STOP)  # the worker ends behind the model's back
        deadline = time.monotonic() + 30
        while "worker threads are gone" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        rt.stop()
        serve.join(30)
        notify.close()
    _check("watchdog", caplog.text)


def test_zygote_death(short_tmp: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch,
                      caplog: pytest.LogCaptureFixture) -> None:
    """The worker zygote killed from outside: said once with how, every start that fails
    names it, and the watchdog stops pinging systemd, which restarts the daemon."""
    from inferd.daemon.config import load_config
    from inferd.daemon.runtime import Runtime
    from tests.e2e.test_cache_reload import poll

    notify = _watchdog_on(short_tmp, monkeypatch)
    caplog.set_level(logging.INFO, "inferd.daemon")
    rt = Runtime(load_config(None, {"server.socket": f"ipc://{short_tmp}/z.sock",
                                    "models.repository": str(models_dir),
                                    "workers.isolation": "backend",
                                    "placement.mode": "first"}))
    rt.start()
    serve = threading.Thread(target=rt.serve, name="test-serve")
    serve.start()
    try:
        assert rt.ready.wait(60)
        assert rt.workers is not None and rt.workers.zygote is not None
        pid = rt.workers.zygote.pid
        os.kill(pid, signal.SIGKILL)  # not waited for by the daemon yet: still its pid
        poll(lambda: "watchdog: not pinging systemd: the worker zygote" in caplog.text, 30)
        with Client(rt.config.server.socket, timeout=60) as c:
            with pytest.raises(RequestError) as e:
                c.infer("vad", {"input": np.zeros((1, 512), np.float32),
                                "state": np.zeros((2, 1, 128), np.float32),
                                "sr": np.array(16000, np.int64)})
        assert e.value.message.endswith(
            "the worker zygote has ended (died of SIGKILL)"), e.value.message
        assert (f"the worker zygote (pid {pid}) died of SIGKILL; no worker process can "
                "start until inferd is restarted") in caplog.text
        assert (f"watchdog: not pinging systemd: the worker zygote (pid {pid}) died of "
                "SIGKILL") in caplog.text
    finally:
        rt.stop()
        serve.join(30)
        notify.close()
    _check("zygote_death", "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}"
                                       for r in caplog.records))


@pytest.mark.slow
def test_sigterm(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """SIGTERM with more work queued than the grace period lets finish."""
    config = short_tmp / "inferd.toml"
    # placement "first": ocr-rec moved onto a faster measured backend finishes the queue
    # inside the grace period, and the line this test provokes never comes. In-process:
    # with the engine in a worker, the stop's unload ends the worker, the thread waiting
    # on its run returns at once, and the daemon rightly exits with no thread left (the
    # plain "inferd exited cleanly", 1 of 3 full runs); a run in the daemon's own process
    # cannot be cut short, which is what the line is about
    config.write_text("[server]\nshutdown_grace_s = 2\n[models]\nqueue_size = 512\n"
                      '[placement]\nmode = "first"\n[workers]\nisolation = "in-process"\n')
    d = start_daemon("--config", str(config), "--models", str(models_dir),
                     "--preload", "ocr-rec")
    with Client(d.endpoint, timeout=120, max_in_flight=200) as c:  # all sent at once
        # very wide lines: 60 runs of ~150 ms here, far more than the 2 s grace on any
        # machine, and a run in progress when the grace ends outlasts the stop's last look
        # at the model threads (at 48x1280, ~40 ms runs, the one in progress finished in
        # between in 1 of 3 full runs; at 48x320, 166 queued runs finished inside it)
        x = np.zeros((1, 3, 48, 5120), np.float32)
        pending = [c.submit(Op.INFER, "ocr-rec", inputs={"x": x}) for _ in range(60)]
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        for p in pending:
            p.reply()
    # it ends by itself (the SIGTERM above): a second one, stop()'s, could reach it after
    # its handlers are gone and end it by the signal (-15, 1 of 2 full runs at load 5)
    assert d.proc.wait(60) == 0, d.log()
    assert d.stop() == 0
    _check("sigterm", d.log_path.read_text())


@pytest.mark.slow
def test_stuck(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """A model whose driver hangs inside a run (tests/e2e/test_stuck.py's blocking
    backend plugin): the stuck stage's report, a deadline, an unload, the stop."""
    from tests.e2e.test_stuck import BLOCKING_BACKEND

    repo = _dir(short_tmp / "repo")
    _model(repo, models_dir, "ocr-det", "ocr-cls")
    (repo / "ocr-det" / "model.toml").write_text('backends = ["blocking"]\n')
    _dir(short_tmp / "backends")
    (short_tmp / "backends" / "blocking.py").write_text(BLOCKING_BACKEND)
    config = short_tmp / "inferd.toml"
    config.write_text("[models]\nstuck_after_s = 0.5\n[server]\nshutdown_grace_s = 2\n")
    d = start_daemon("--config", str(config), "--models", str(repo), "--backends-dir",
                     str(short_tmp / "backends"))
    x = "x=" + str(short_tmp / "x.npy")
    np.save(short_tmp / "x.npy", np.ones((1, 4), np.float32))
    out = []
    with Client(d.endpoint, timeout=60) as c:
        c.submit("infer", "ocr-det", {"x": np.ones((1, 4), np.float32)}, timeout=30)
        deadline = time.monotonic() + 60
        while "ocr-det" not in c.status()["stuck"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out.append(_inferctl(d.endpoint, "--timeout", "1", "infer", "ocr-det", "-i",
                             x).stderr)
        out.append(_inferctl(d.endpoint, "unload", "ocr-det").stderr)
        c.submit("infer", "ocr-det", {"x": np.ones((1, 4), np.float32)}, timeout=30)
        ids = c._prefix  # the stuck requests' ids, written as the page writes them
    assert d.stop() == 0
    _check("stuck", "\n".join(out) + d.log_path.read_text(), **{ids: "6f0c9d2e"})


@pytest.mark.slow
def test_placement(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """Measured placement: a candidate with wrong results (a plugin off by 0.5), and a
    cache too small to measure in."""
    from tests.e2e.test_placement import WRONG_PLUGIN, short_budget

    plugins = short_tmp / "plugins"
    plugins.mkdir()
    (plugins / "offbyhalf.py").write_text(WRONG_PLUGIN)
    repo = short_tmp / "repo"
    _model(repo, models_dir, "ocr-cls", "ocr-cls")
    out = []
    short = short_budget(start_daemon, short_tmp, repo, "--backends-dir", str(plugins))
    for budget in ("unlimited", short):
        config = short_tmp / f"inferd-{budget}.toml"
        config.write_text(f'[cache]\nmax_memory = {budget!r}\n[placement]\nmode = "measured"\n')
        workdir = short_tmp / str(budget)
        workdir.mkdir()
        d = start_daemon("--config", str(config), "--backends-dir", str(plugins),
                         "--models", str(repo), "--preload", "ocr-cls", workdir=workdir)
        with Client(d.endpoint, timeout=120) as c:
            for b in (1, 6, 3):
                c.infer("ocr-cls", {"x": np.zeros((b, 3, 48, 192), np.float32)})
        want = "never chosen" if budget == "unlimited" else "postponed"
        deadline = time.monotonic() + 300
        while want not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.1)
        out.append(d.log())
        d.stop()
    _check("placement", "\n".join(out))


@pytest.mark.slow
def test_hostile_clients(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """Connections past the bound, bytes past the bound, a summed-up repeated line, an
    explicit load that failed remembered (issue 18)."""
    from tests.e2e.connections_kit import main as connect

    repo = short_tmp / "repo"
    _model(repo, models_dir, "ocr-cls", "ocr-cls")
    (repo / "garbage" / "1").mkdir(parents=True)
    (repo / "garbage" / "1" / "model.onnx").write_bytes(b"not a model" * 100)
    config = short_tmp / "inferd.toml"
    # requests in frames (max_message_bytes above them, the client's shared memory off):
    # their bytes are what max_bytes_in_flight counts
    config.write_text('[server]\nmax_connections = 4\nmax_bytes_in_flight = "2MiB"\n'
                      'max_message_bytes = "4MiB"\n')
    d = start_daemon("--config", str(config), "--models", str(repo), "--preload", "ocr-cls")
    out = []
    with Client(d.endpoint, timeout=120, max_in_flight=2, max_inline_bytes=None) as c:
        x = np.zeros((4, 3, 48, 768), np.float32)  # 1.8 MB: one fits, not two
        for r in [p.reply() for p in [c.submit(Op.INFER, "ocr-cls", inputs={"x": x})
                                      for _ in range(2)]]:
            if r.error is not None:
                out.append(f"{r.error.code}: {r.error.message}")
        assert out, "the second request was not refused"
    for _ in range(2):
        out.append(_inferctl(d.endpoint, "load", "garbage").stderr)
    assert connect(d.endpoint, 12, 1.0, None, False)["opened"] == 12  # 8 too many
    deadline = time.monotonic() + 60  # the summary comes when its 10 s are over
    while "more like this in the last" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.1)
    _check("hostile_clients", "\n".join(out) + "\n" + d.log())


@pytest.mark.slow
def test_hostile_files(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """A socket directory writable by all, an unreadable version folder, a version file
    replaced in place, the open-files limit (issue 18)."""
    from tests.daemon.test_repository import unprivileged

    out = []
    shared = short_tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (short_tmp / "none.toml").touch()
    refused = subprocess.run([sys.executable, "-m", "inferd.daemon.main", "--socket",
                              f"ipc://{shared}/inferd.sock"], capture_output=True, text=True,
                             timeout=60, env={**os.environ,
                                              "INFERD_CONFIG": str(short_tmp / "none.toml")})
    assert refused.returncode == 1, refused.stderr
    out.append(refused.stderr.replace(str(shared), "/run/inferd"))
    repo = short_tmp / "repo"
    _model(repo, models_dir, "vad", "vad")
    (repo / "ocr-cls" / "1").mkdir(parents=True)
    cls = repo / "ocr-cls" / "1" / "model.onnx"
    cls.write_bytes((models_dir / "ocr-cls" / "1" / "model.onnx").read_bytes())  # a copy
    (repo / "vad" / "1").chmod(0)
    try:
        d = start_daemon("--models", str(repo), "--preload", "ocr-cls",
                         wrap=["prlimit", "--nofile=1024:4096", "--", *unprivileged()])
        tmp = cls.with_name("model.onnx.new")
        tmp.write_bytes((models_dir / "vad" / "1" / "model.onnx").read_bytes())
        os.replace(tmp, cls)  # another model's file renamed over it
        assert _inferctl(d.endpoint, "reload").returncode == 0
    finally:
        (repo / "vad" / "1").chmod(0o755)
    _check("hostile_files", "\n".join(out) + "\n" + d.log(),
           **{str(repo.resolve()): DOC_REPO})


def test_decisions_file(start_daemon, short_tmp: Path) -> None:
    """A placement decisions file that is not one (JSON nested too deep) is set aside
    and logged once, and the daemon starts (issue 31, finding 10; before: it exited 1
    at start with RecursionError). tests/daemon/test_decisions.py has each bad kind."""
    state = short_tmp / "state"
    state.mkdir()
    (state / "decisions.json").write_text("[" * 100_000)
    (short_tmp / "repo").mkdir()
    config = short_tmp / "inferd.toml"
    config.write_text(f'[placement]\ndirectory = "{state}"\n')
    d = start_daemon("--config", str(config), "--models", str(short_tmp / "repo"))
    with Client(d.endpoint, timeout=30) as c:
        assert c.ping()["ready"]
    assert d.log().count("are not a decisions file") == 1, d.log()
    assert (state / "decisions.json.bad").read_text() == "[" * 100_000
    _check("decisions_file", d.log(), **{str(state): "/var/lib/inferd/state/placement"})


@pytest.mark.slow
def test_metrics_textfile(start_daemon, short_tmp: Path) -> None:
    """The shipped config's textfile in a directory that is not there: by hand one INFO
    line and no textfile; under systemd ($NOTIFY_SOCKET) the warning, and the file
    written again once the directory is there (issue 31 item 14)."""
    run = short_tmp / "run-inferd"
    (short_tmp / "repo").mkdir()
    config = short_tmp / "inferd.toml"
    config.write_text(f'[metrics]\ntextfile = "{run}/metrics.prom"\ninterval_s = 0.1\n')
    args = ("--config", str(config), "--models", str(short_tmp / "repo"))
    for name in ("by-hand", "unit"):
        (short_tmp / name).mkdir()
    by_hand = start_daemon(*args, workdir=short_tmp / "by-hand")
    assert by_hand.stop() == 0
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(short_tmp / "notify"))
    try:
        unit = start_daemon(*args, workdir=short_tmp / "unit",
                            env={"NOTIFY_SOCKET": str(short_tmp / "notify")})
        deadline = time.monotonic() + 30
        while "cannot write the metrics textfile" not in unit.log():
            assert time.monotonic() < deadline, unit.log()
            time.sleep(0.05)
        run.mkdir()  # what RuntimeDirectory= does
        while not (run / "metrics.prom").exists():
            assert time.monotonic() < deadline, unit.log()
            time.sleep(0.05)
        assert unit.stop() == 0
    finally:
        notify.close()
    produced = (short_tmp / "by-hand" / "inferd.log").read_text() + \
        (short_tmp / "unit" / "inferd.log").read_text()
    _check("metrics_textfile", produced, **{str(run): "/run/inferd"})


@pytest.mark.slow
def test_worker_crash(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """An engine that aborts in a worker process: inferctl's reply, the ERROR line and
    the worker started again (issue 30; tests/e2e/test_workers.py has the rest)."""
    repo = short_tmp / "repo"
    _model(repo, models_dir, "vad", "vad")
    config = short_tmp / "inferd.toml"
    config.write_text('[workers]\nisolation = "backend"\n')
    d = start_daemon("--config", str(config), "--models", str(repo))
    files = {"input": np.zeros((0, 512), np.float32),
             "state": np.zeros((2, 0, 128), np.float32), "sr": np.array(16000, np.int64)}
    args = []
    for name, value in files.items():
        np.save(short_tmp / f"{name}.npy", value)
        args += ["-i", f"{name}={short_tmp / name}.npy"]
    with Client(d.endpoint, timeout=60) as c:  # loaded first: the abort is in a run
        c.infer("vad", {**files, "input": np.zeros((1, 512), np.float32),
                        "state": np.zeros((2, 1, 128), np.float32)})
    r = _inferctl(d.endpoint, "infer", "vad", *args)
    assert r.returncode != 0
    with Client(d.endpoint, timeout=60) as c:  # served again: a new worker
        c.infer("vad", {**files, "input": np.zeros((1, 512), np.float32),
                        "state": np.zeros((2, 1, 128), np.float32)})
    _check("worker_crash", d.log() + r.stderr + _inferctl(d.endpoint, "models", "-v").stdout)


def test_strict_modes(start_daemon, short_tmp: Path) -> None:
    """Code another user may write is refused and never runs: a backend plugin, a
    processor file, a model's own custom op (0666 in a 0777 folder; the model fails with
    the reason, in inferctl models too), while a model file that an application group
    may write still loads (issue 31, finding 11). Each refused file would create
    ``ran-<name>`` if it ran."""
    from onnx import helper

    from tests.libbackends.customops import kit

    def planted(path: Path, body: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"from pathlib import Path\n"
                        f"Path({str(short_tmp / ('ran-' + path.stem))!r}).write_text('ran')\n"
                        f"{body}")
        path.chmod(0o666)

    backends, processors, repo = (short_tmp / n for n in ("backends", "processors", "repo"))
    planted(backends / "planted.py", "")
    planted(processors / "mine.py", "PROCESSORS = {}\n")
    planted(repo / "conv" / "customops" / "sigmoid.py", kit.PY_OPS)
    (repo / "conv" / "customops").chmod(0o777)
    kit.save(kit.conv_sigmoid_add(), repo / "conv" / "1" / "model.onnx")
    relu = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", kit.X4,
                             [helper.make_tensor_value_info("y", 1, None)])
    plain = kit.save(helper.make_model(relu, opset_imports=kit.OPSETS),
                     repo / "plain" / "1" / "model.onnx")
    # a model folder an application group may write: its model file still loads
    for node in (repo / "plain", plain.parent, plain):
        node.chmod(0o664 if node == plain else 0o2775)
        if os.geteuid() == 0:
            os.chown(node, -1, 65534)  # nogroup: a group with another user in it
    config = short_tmp / "inferd.toml"
    config.write_text(f'[processors]\ndirectory = "{processors}"\n'
                      f'[placement]\nmode = "first"\n')
    d = start_daemon("--config", str(config), "--models", str(repo), "--backends-dir",
                     str(backends))
    x = kit.sample(2)
    with Client(d.endpoint, timeout=60) as c:
        np.testing.assert_array_equal(c.infer("plain", {"x": x})["y"], np.maximum(x, 0))
        with pytest.raises(RequestError) as e:
            c.infer("conv", {"x": x})
        row = next(m for m in c.models() if m["name"] == "conv")
    assert e.value.code.name == "PERMISSION_DENIED", e.value
    assert f"{repo / 'conv' / 'customops'} is writable by every user" in e.value.message
    assert row["state"] == "failed" and row["error"].startswith(
        f"refusing to load code from {repo / 'conv' / 'customops' / 'sigmoid.py'}: ")
    shown = _inferctl(d.endpoint, "models").stdout
    assert "conv" in shown and "refusing to load code from" in shown, shown
    assert sorted(p.name for p in short_tmp.glob("ran-*")) == []  # none of it ran
    me = pwd.getpwuid(os.geteuid()).pw_name
    daemon = "no user but root can write" if os.geteuid() == 0 else \
        f"no user but root and {me} (uid {os.geteuid()}) can write"
    _check("strict_modes", d.log(), **{
        daemon: "no user but root and inferd (uid 998) can write",
        str(backends): "/usr/lib/inferd/backends", str(processors): "/usr/lib/inferd/processors",
        str(repo): DOC_REPO})


@pytest.mark.slow
def test_shm_registration(start_daemon) -> None:
    """The shared-memory registration socket's bounds under an open-files limit of
    1024, a malformed message and a client that does not read its replies (issue 31)."""
    import fcntl
    import json

    d = start_daemon(wrap=["prlimit", "--nofile=1024:1024", "--"])
    path = d.socket_path.with_name(d.socket_path.name + ".shm")
    out: list[str] = []

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(str(path))
        conns.append(s)
        return s

    def register(s: socket.socket) -> bool:
        fd = os.memfd_create("inferd-test", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        socket.send_fds(s, [b'{"op":"register"}'], [fd])
        os.close(fd)
        reply = json.loads(s.recv(4096))
        if "error" in reply:
            out.append(f"{reply['error']['code']}: {reply['error']['message']}")
        return "region" in reply

    conns: list[socket.socket] = []
    try:
        s = connect()
        s.send(b"[" * 3000)
        reply = json.loads(s.recv(4096))["error"]
        out.append(f"{reply['code']}: {reply['message']}")
        while register(s):  # 64, then the connection's bound
            pass
        for _ in range(12):  # the user's bound (84), then their connections' (12)
            c = connect()
            while register(c):
                pass
        hog = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conns.append(hog)
        for s in conns[:-1]:  # make room for it
            s.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                hog.connect(str(path))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        hog.settimeout(2)
        try:
            for _ in range(5000):
                hog.send(b'{"op":"unregister","region":"none"}')
        except OSError:
            pass  # closed by the daemon (or it stopped taking them: the check says)
    finally:
        for s in conns:
            s.close()
    _check("shm_registration", "\n".join(out) + "\n" + d.log())


@pytest.mark.slow
def test_decode_cost(start_daemon, short_tmp: Path) -> None:
    """A request priced by what its tensors take once decoded, before decoding (issue 31
    item 7): int4 tensors in shared memory over the daemon's and over the client's
    bound (tests/e2e/test_decode_cost.py has the rest)."""
    from inferd.ipc import Region
    from tests.e2e.test_decode_cost import _int4_in_region, _raw
    from tests.ipc.libinferd_kit import identity_model

    repo = short_tmp / "repo"
    identity_model(repo / "id-int4" / "1" / "model.onnx", "int4")
    produced = []
    for bound, elements in (('max_bytes_in_flight = "32MiB"', 64 * 2**20),
                            ("", 200 * 2**20)):  # the client's: 128 MiB by default
        workdir = short_tmp / f"d{len(produced)}"
        workdir.mkdir()
        config = workdir / "inferd.toml"
        config.write_text(f"[server]\n{bound}\n")
        d = start_daemon("--config", str(config), "--models", str(repo), workdir=workdir)
        with Client(d.endpoint, timeout=60) as c:
            region = c.register(Region(elements // 2))
            reply = _raw(d.endpoint, _int4_in_region(region.token, elements, "id-int4"))
        assert reply["status"] == "error", reply
        produced.append(f"{reply['error']['code']}: {reply['error']['message']}")
    _check("decode_cost", "\n".join(produced))


@pytest.mark.slow
def test_streams(start_daemon, short_tmp: Path, models_dir: Path) -> None:
    """A stream not started, lost (a worker killed mid-chunk, idleness, a reload), past
    its limits, and a chunk of the wrong length (issue 32; tests/e2e/test_streams.py has
    the rest)."""
    from inferd.ipc.protocol import StreamRef
    from tests.e2e.test_cache_reload import poll
    from tests.e2e.test_streams import VAD_TOML, toy_model, worker_pid

    out: list[str] = []

    def note(call) -> None:
        with pytest.raises(RequestError) as e:
            call()
        out.append(f"{e.value.code}: {e.value.message}")

    # 1. The real vad: small limits, a short idle timeout.
    repo = short_tmp / "repo"
    (repo / "vad" / "1").mkdir(parents=True)
    _model(repo, models_dir, "vad", "vad")
    (repo / "vad" / "model.toml").write_text(
        VAD_TOML.read_text().replace("max_streams = 64", "max_streams = 3")
        .replace("idle_timeout_s = 60", "idle_timeout_s = 0.5"))
    config = short_tmp / "inferd.toml"
    config.write_text("[streams]\nmax_per_client = 2\n[cache]\nidle_check_s = 0.1\n")
    d = start_daemon("--config", str(config), "--models", str(repo),
                     workdir=_dir(short_tmp / "d1"))
    chunk = np.zeros((1, 512), np.float32)
    with d.client() as c, d.client() as other:
        note(lambda: c.infer("vad", {"input": chunk}, stream=StreamRef("mic0")))
        s = c.stream("vad", id="mic0", sr=16000)
        s.infer({"input": chunk})
        note(lambda: s.infer({"input": chunk[:, :500]}))
        c.stream("vad", id="mic1", sr=16000).infer({"input": chunk})
        note(lambda: c.stream("vad", id="mic2", sr=16000).infer({"input": chunk}))
        other.stream("vad", id="mic0", sr=16000).infer({"input": chunk})
        note(lambda: other.stream("vad", id="mic3", sr=16000).infer({"input": chunk}))
        poll(lambda: "freed: idle for" in d.log(), 10)
        note(lambda: s.infer({"input": chunk}))
    out.append(d.log())
    # 2. A model of the same name whose chunk runs until its worker is killed; a reload
    # that replaces its file.
    repo2 = short_tmp / "repo2"
    repo2.mkdir()
    toy_model(repo2, "vad")
    mark = short_tmp / "running"
    config.write_text('[workers]\nisolation = "backend"\n[placement]\nmode = "first"\n')
    d2 = start_daemon("--config", str(config), "--models", str(repo2),
                      workdir=_dir(short_tmp / "d2"), env={"SLOW_MARK": str(mark)})
    with d2.client(timeout=60) as c:
        s = c.stream("vad", id="mic0")
        for _ in range(2):
            s.infer({"x": np.ones((1, 4), np.float32)})
        pid = worker_pid(d2.log(), "vad")
        killer = threading.Thread(target=lambda: (poll(mark.exists, 30),
                                                  os.kill(pid, signal.SIGKILL)))
        killer.start()
        with pytest.raises(RequestError):
            s.infer({"x": np.full((1, 4), 9, np.float32)})
        killer.join()
        note(lambda: s.infer({"x": np.ones((1, 4), np.float32)}))
        streams = [c.stream("vad", id=f"mic{i}") for i in range(2)]
        for st in streams:
            st.infer({"x": np.ones((1, 4), np.float32)})
        import onnx

        toy = repo2 / "vad" / "1" / "model.onnx"
        m = onnx.load(toy)
        m.doc_string = "changed"
        onnx.save(m, toy)
        c.call(Op.RELOAD)
        note(lambda: streams[0].infer({"x": np.ones((1, 4), np.float32)}))
        # a client that goes with its streams open; a budget with no room for one more
        with Client(d2.endpoint) as gone:
            gone.stream("vad", id="mic5").infer({"x": np.ones((1, 4), np.float32)})
        poll(lambda: "of a client that disconnected freed" in d2.log(), 10)
        used = c.status()["cache"]["used_bytes"]
        config.write_text(config.read_text() + f"[cache]\nmax_memory = {used + 8}\n")
        c.call(Op.RELOAD)
        note(lambda: c.stream("vad", id="mic6").infer({"x": np.ones((1, 4), np.float32)}))
    out.append(d2.log())
    _check("streams", "\n".join(out))


@pytest.mark.slow
def test_hostile_worker(start_daemon, short_tmp: Path) -> None:
    """A processors worker that answers with a pickle naming a forbidden global (a
    worker taken over): killed, and logged by the channel."""
    from tests.e2e.test_worker_pickles import GRAPH
    from tests.daemon.test_worker_pickles import HOSTILE
    from tests.daemon.test_workers import unary_model

    repo, processors = short_tmp / "repo", short_tmp / "processors"
    unary_model(repo, "other", "Identity")
    (repo / "h").mkdir()
    (repo / "h" / "graph.toml").write_text(GRAPH.format(marker=short_tmp / "ran",
                                                        how="header"))
    processors.mkdir()
    (processors / "hostile.py").write_text(HOSTILE)
    conf = short_tmp / "inferd.toml"
    conf.write_text(f'[processors]\ndirectory = "{processors}"\n'
                    f'[models]\nrepository = "{repo}"\n[metrics]\ntextfile = ""\n')
    d = start_daemon("--config", str(conf))
    with d.client() as c:
        with pytest.raises(RequestError):
            c.infer("h", {"x": np.ones((1, 4), np.float32)})
    assert not (short_tmp / "ran").exists()
    _check("hostile_worker", d.log())
