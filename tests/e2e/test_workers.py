"""Engines in worker processes, through a real daemon: an engine that aborts (onnxruntime
on a zero-size batch of the Silero VAD model), a custom op that aborts, dereferences NULL
or calls ``_exit()``, a run that never returns, and a worker killed from outside each cost
the request that was running, never the daemon; the model is served again on the next
request, and a client of a model in another worker sees nothing the whole time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from inferd.ipc import ErrorCode, RequestError
from tests.e2e.test_cache_reload import poll
from tests.libbackends.customops import kit

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

BOMB = '''
import ctypes
import os
import time

import numpy as np

HOARD = []


class CstBomb:
    """Identity, unless x's first element asks for a crash."""

    op_type = "cstBomb"

    def shape_infer(self, node, in_shapes, in_dtypes):
        return [in_shapes[0]], [in_dtypes[0]]

    def compute(self, node, inputs):
        x = inputs[0]
        how = int(x.reshape(-1)[0]) if x.size else 0
        if how == 1:
            os.abort()
        if how == 2:
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if how == 3:
            os._exit(3)
        if how == 4:
            time.sleep(3600)
        if how == 5:
            HOARD.append(np.ones(400 * 2**20, np.uint8))  # kept: resident
        return [x.copy()]
'''

HOW = {"abort": (1, "died of SIGABRT"), "null": (2, "died of SIGSEGV"),
       "exit": (3, "exited with status 3")}

VAD_OK = {"input": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32),
          "sr": np.array(16000, np.int64)}
VAD_ZERO = {"input": np.zeros((0, 512), np.float32),
            "state": np.zeros((2, 0, 128), np.float32), "sr": np.array(16000, np.int64)}


def bomb_model(repo: Path) -> None:
    node = helper.make_node("cstBomb", ["x"], ["y"], name="bomb", domain=kit.DOMAIN)
    graph = helper.make_graph(
        [node], "bomb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    model = helper.make_model(graph, opset_imports=kit.OPSETS)
    model.ir_version = 8
    (repo / "bomb" / "1").mkdir(parents=True)
    onnx.save(model, repo / "bomb" / "1" / "model.onnx")
    (repo / "bomb" / "customops").mkdir()
    (repo / "bomb" / "customops" / "bomb.py").write_text(BOMB)


@pytest.fixture
def repo(short_tmp: Path, models_dir: Path) -> Path:
    repo = short_tmp / "repo"
    repo.mkdir()
    for name in ("vad", "ocr-cls"):
        os.symlink(models_dir / name, repo / name)
    bomb_model(repo)
    return repo


def daemon_with_workers(start_daemon, repo: Path, short_tmp: Path,
                        wrap: list[str] | None = None, **workers: object):
    conf = short_tmp / "inferd.toml"
    extra = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in workers.items())
    conf.write_text(f'[workers]\nisolation = "backend"\n{extra}\n'
                    '[models]\nallow_external_links = true\n[metrics]\ntextfile = ""\n')
    return start_daemon("--config", str(conf), "--models", str(repo), wrap=wrap)


# Runs the daemon with SIGCHLD, SIGTERM and SIGHUP blocked, as a parent that leaves them
# so would (a blocked mask is inherited across fork and exec).
BLOCKED = [sys.executable, "-c",
           "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
           "{signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP}); "
           "os.execv(sys.argv[1], sys.argv[1:])"]


def worker_pids(log: str, name: str) -> list[int]:
    return [int(p) for p in re.findall(rf"worker {re.escape(name)} started: pid (\d+)", log)]


def test_a_zero_batch_that_aborts_onnxruntime_costs_one_request(start_daemon, repo,
                                                               short_tmp):
    d = daemon_with_workers(start_daemon, repo, short_tmp)
    with d.client() as c:
        first = c.infer("vad", VAD_OK)
        with pytest.raises(RequestError) as e:
            c.infer("vad", VAD_ZERO)
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert re.fullmatch(r"engine onnxruntime \(worker \d+\) died of SIGABRT while "
                            r"running vad version 1", e.value.message), e.value.message
        assert c.ping()["pong"]
        again = c.infer("vad", VAD_OK)
        text = c.call("metrics")["text"]
    assert 'inferd_worker_restarts_total{backend="onnxruntime",reason="signal"} 1.0' in text
    assert d.proc.poll() is None
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    log = d.log()
    assert re.search(r"ERROR inferd\.daemon\.workers\.pool: engine onnxruntime \(worker \d+\) "
                     r"died of SIGABRT while running vad version 1; its models load again",
                     log), log
    assert len(worker_pids(log, "onnxruntime")) == 2  # the first, and the one started again
    # no engine, and not onnx's shape inference either, in the daemon itself
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert "onnxruntime" not in maps and "onnx_cpp2py_export" not in maps


class Neighbour:
    """A client of ``model`` (ocr-cls: another worker) that runs until stopped, keeping
    any error."""

    def __init__(self, d, model: str = "ocr-cls", x: np.ndarray | None = None) -> None:
        self.d = d
        self.model = model
        self.errors: list[str] = []
        self.runs = 0
        self.stop = threading.Event()
        self.x = np.random.default_rng(1).random((1, 3, 48, 192), dtype=np.float32) \
            if x is None else x
        with d.client() as c:
            self.expected = c.infer(model, {"x": self.x})
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        with self.d.client() as c:
            while not self.stop.is_set():
                try:
                    out = c.infer(self.model, {"x": self.x})
                    for k, v in self.expected.items():
                        if not np.array_equal(out[k], v):
                            self.errors.append(f"{k} differs")
                    self.runs += 1
                except RequestError as e:
                    self.errors.append(f"{e.code}: {e.message}")

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


@pytest.mark.parametrize("how", sorted(HOW))
def test_a_custom_op_that_crashes_costs_one_request(how, start_daemon, repo, short_tmp):
    d = daemon_with_workers(start_daemon, repo, short_tmp)
    trigger, ended = HOW[how]
    ok = np.arange(8, dtype=np.float32).reshape(2, 4) + 10
    bad = np.full((1, 4), trigger, np.float32)
    neighbour = Neighbour(d)
    try:
        with d.client() as c:
            np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)
            with pytest.raises(RequestError) as e:
                c.infer("bomb", {"x": bad})
            assert e.value.code is ErrorCode.UNAVAILABLE
            assert re.fullmatch(rf"engine onnxruntime \(worker \d+\) {ended} while running "
                                r"bomb version 1", e.value.message), e.value.message
            np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)
        poll(lambda: neighbour.runs >= 3, 30)
    finally:
        neighbour.finish()
    assert neighbour.errors == []
    assert d.proc.poll() is None
    log = d.log()
    # the model with its own custom ops has a worker of its own
    assert worker_pids(log, "bomb version 1@onnxruntime")
    assert len(worker_pids(log, "onnxruntime")) == 1, log


def test_a_run_that_never_returns_is_killed(start_daemon, repo, short_tmp):
    d = daemon_with_workers(start_daemon, repo, short_tmp, kill_after_s=2.0,
                            restart_backoff_s=0.1)
    ok = np.full((1, 4), 7, np.float32)
    with d.client(timeout=60) as c:
        np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)
        with pytest.raises(RequestError) as e:
            c.infer("bomb", {"x": np.full((1, 4), 4, np.float32)})
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert re.fullmatch(r"engine onnxruntime \(worker \d+\) was killed after 2 s in one "
                            r"call \(workers\.kill_after_s\) while running bomb version 1",
                            e.value.message), e.value.message
        np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)


@pytest.mark.parametrize("mask", ["empty", "blocked"])
def test_a_worker_killed_from_outside_is_started_again(mask, start_daemon, repo, short_tmp):
    """Also when the daemon's parent left SIGCHLD, SIGTERM and SIGHUP blocked: the
    daemon starts from an empty mask, so its zygote still reaps (the death is named)
    and SIGTERM still stops it."""
    d = daemon_with_workers(start_daemon, repo, short_tmp,
                            wrap=BLOCKED if mask == "blocked" else None)
    x = np.random.default_rng(2).random((2, 3, 48, 192), dtype=np.float32)
    with d.client() as c:
        before = c.infer("ocr-cls", {"x": x})
        (pid,) = worker_pids(d.log(), "onnxruntime")
        os.kill(pid, signal.SIGKILL)  # the OOM killer's way
        poll(lambda: "died of SIGKILL" in d.log(), 10)
        t0 = time.monotonic()
        after = c.infer("ocr-cls", {"x": x})
        took = time.monotonic() - t0
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    pids = worker_pids(d.log(), "onnxruntime")
    assert len(pids) == 2 and pids[1] != pid
    print(f"served again {took * 1e3:.0f} ms after the worker's death was known")
    assert d.stop() == 0, d.log()  # on SIGTERM, within the bound


NOBODY = 65534


def _need_root() -> None:
    if os.getuid() != 0:
        if os.environ.get("INFERD_TEST_ROOT"):
            pytest.fail("the quarantine tests need root (to run a client as another uid)")
        pytest.skip("needs root: a client of another uid plays the neighbour")


def as_uid(uid: int, endpoint: str, model: str, x: np.ndarray) -> str:
    """One infer from a forked child running as ``uid``: "OK" or "CODE: message"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only its answer
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            from inferd.ipc import Client as C

            try:
                with C(endpoint, timeout=60) as c:
                    c.infer(model, {"x": x})
                out = "OK"
            except RequestError as e:
                out = f"{e.code}: {e.message}"
            os.write(w, out.encode())
        except BaseException as e:  # noqa: BLE001  reported to the parent
            os.write(w, f"child failed: {e!r}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def shared_daemon(start_daemon, repo: Path, short_tmp: Path, **workers: object):
    os.chmod(short_tmp, 0o755)  # the other uid reaches the socket
    os.chmod(repo, 0o755)
    conf = short_tmp / "inferd.toml"
    extra = "".join(f"{k} = {v!r}\n" for k, v in workers.items())
    conf.write_text(f'[workers]\nisolation = "backend"\nrestart_backoff_s = 0.05\n{extra}\n'
                    '[server]\nsocket_mode = "0666"\n[models]\nallow_external_links = true\n'
                    '[metrics]\ntextfile = ""\n')
    return start_daemon("--config", str(conf), "--models", str(repo))


def test_a_client_that_keeps_killing_the_worker_is_refused_and_others_served(
        start_daemon, repo, short_tmp):
    _need_root()
    d = shared_daemon(start_daemon, repo, short_tmp, refuse_client_after=2,
                      set_aside_after=3)
    ok = np.full((1, 4), 7, np.float32)
    bad = np.full((1, 4), 1, np.float32)  # abort()
    with d.client() as c:
        for _ in range(2):
            with pytest.raises(RequestError) as e:
                c.infer("bomb", {"x": bad})
            assert "died of SIGABRT" in e.value.message
        with pytest.raises(RequestError) as e:
            c.infer("bomb", {"x": ok})  # refused, whatever it sends
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert e.value.message.startswith(f"model bomb: uid {os.getuid()} is refused for ")
        assert "(workers.refuse_client_after)" in e.value.message
    assert as_uid(NOBODY, d.endpoint, "bomb", ok) == "OK"  # the neighbour is served
    assert f"model bomb: uid {os.getuid()} refused for 60 s" in d.log()


GRAPH_BOMB = """
executor = "{executor}"
inputs = ["x"]
[outputs]
y = "b.y"
[[nodes]]
name = "b"
model = "bomb"
inputs = {{ x = "input.x" }}
"""


@pytest.mark.parametrize("executor", ["pipeline", "task"])
def test_a_graph_node_that_kills_its_models_worker_is_charged_to_the_graphs_client(
        executor, start_daemon, repo, short_tmp):
    """A graph's model node calls its model as the graph's client: the deaths it causes
    are charged to that client for the model, which the graph's node and the client's
    own calls of the model are then refused (before this, a graph's node calls carried no
    uid: a client could kill a model's worker through a graph for ever)."""
    (repo / "gb").mkdir()
    (repo / "gb" / "graph.toml").write_text(GRAPH_BOMB.format(executor=executor))
    d = daemon_with_workers(start_daemon, repo, short_tmp, refuse_client_after=2,
                            restart_backoff_s=0.05)
    ok = np.full((1, 4), 7, np.float32)
    bad = np.full((1, 4), 1, np.float32)  # abort()
    with d.client() as c:
        np.testing.assert_array_equal(c.infer("gb", {"x": ok})["y"], ok)
        for _ in range(2):
            with pytest.raises(RequestError) as e:
                c.infer("gb", {"x": bad})
            assert e.value.code is ErrorCode.UNAVAILABLE
            assert re.fullmatch(r"graph gb: node b: model bomb: engine onnxruntime \(worker "
                                r"\d+\) died of SIGABRT while running bomb version 1",
                                e.value.message), e.value.message
        refused = f"model bomb: uid {os.getuid()} is refused for "
        with pytest.raises(RequestError) as e:
            c.infer("gb", {"x": ok})
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert e.value.message.startswith(f"graph gb: node b: {refused}"), e.value.message
        with pytest.raises(RequestError) as e:
            c.infer("bomb", {"x": ok})
        assert e.value.message.startswith(refused), e.value.message
        # the refusal is the client's for that model, not the daemon's
        np.testing.assert_array_equal(c.infer("vad", VAD_OK)["output"].shape, (1, 1))
    assert f"model bomb: uid {os.getuid()} refused for 60 s" in d.log()


def set_aside_by_two_clients(d, c, model: str, bad: np.ndarray, ok: np.ndarray,
                             died: str) -> dict:
    """Uid NOBODY, then ``c``'s, send ``model`` an ``x`` that kills its worker (NOBODY's
    reply starts ``died``), with ``[workers] set_aside_after = 2``: the model is then
    refused to both, whatever they send, and its ``models`` row is FAILED with the
    reason; returns that row."""
    assert as_uid(NOBODY, d.endpoint, model, bad).startswith(died)
    with pytest.raises(RequestError):
        c.infer(model, {"x": bad})
    with pytest.raises(RequestError) as e:
        c.infer(model, {"x": ok})
    assert e.value.message.startswith(f"model {model} is set aside: its runs killed its "
                                      "worker for 2 clients within 60 s (uids "), \
        e.value.message
    row = next(m for m in c.models() if m["name"] == model)
    assert row["state"] == "failed", row
    assert row["error"].startswith("set aside: its runs killed its worker"), row
    assert as_uid(NOBODY, d.endpoint, model, ok).startswith(
        f"UNAVAILABLE: model {model} is set aside")
    return row


def test_a_model_that_kills_its_worker_for_several_clients_is_set_aside_until_reload(
        start_daemon, repo, short_tmp):
    _need_root()
    d = shared_daemon(start_daemon, repo, short_tmp, refuse_client_after=5,
                      set_aside_after=2)
    ok = np.full((1, 4), 7, np.float32)
    bad = np.full((1, 4), 2, np.float32)  # NULL
    with d.client() as c:
        set_aside_by_two_clients(d, c, "bomb", bad, ok, "UNAVAILABLE: engine onnxruntime")
        c.call("reload")
        np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)
    assert "ERROR inferd.daemon.workers.quarantine: model bomb set aside" in d.log()


def test_a_native_backend_whose_run_segfaults_costs_one_request(start_daemon, repo,
                                                                short_tmp):
    from onnx import TensorProto as T

    plugins = short_tmp / "plugins"
    plugins.mkdir()
    subprocess.run(["gcc", "-std=gnu11", "-O0", "-Wall", "-Werror", "-fPIC", "-shared",
                    "-fvisibility=hidden", f"-I{ROOT / 'libbackends' / 'include'}",
                    f"-I{ROOT / 'examples' / 'backends' / 'elementwise'}", "-o",
                    str(plugins / "libsegv_backend.so"),
                    str(ROOT / "tests" / "libbackends" / "plugins" / "segv_in_run.c"), "-lm"],
                   check=True)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                               helper.make_node("Sigmoid", ["h"], ["y"])], "rs",
                              [helper.make_tensor_value_info("x", T.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", T.FLOAT, ["N", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    (repo / "rs" / "1").mkdir(parents=True)
    onnx.save(model, repo / "rs" / "1" / "model.onnx")
    (repo / "rs" / "model.toml").write_text('backends = ["segv-c"]\n')
    conf = short_tmp / "inferd.toml"
    conf.write_text('[workers]\nisolation = "backend"\n[models]\nallow_external_links = '
                    'true\n[metrics]\ntextfile = ""\n')
    d = start_daemon("--config", str(conf), "--models", str(repo),
                     env={"INFERD_BACKENDS_PATH": str(plugins)})
    x = np.array([[0.5, -2, 3, 0]], np.float32)
    expected = 1 / (1 + np.exp(-np.maximum(x, 0)))
    neighbour = Neighbour(d)
    try:
        with d.client() as c:
            np.testing.assert_allclose(c.infer("rs", {"x": x})["y"], expected, rtol=1e-6)
            with pytest.raises(RequestError) as e:
                c.infer("rs", {"x": np.full((1, 4), -1, np.float32)})
            assert e.value.code is ErrorCode.UNAVAILABLE
            assert re.fullmatch(r"engine segv-c \(worker \d+\) died of SIGSEGV while "
                                r"running rs version 1", e.value.message), e.value.message
            np.testing.assert_allclose(c.infer("rs", {"x": x})["y"], expected, rtol=1e-6)
        poll(lambda: neighbour.runs >= 3, 30)
    finally:
        neighbour.finish()
    assert neighbour.errors == []
    assert d.proc.poll() is None


def test_a_worker_over_its_memory_limit_is_killed(start_daemon, repo, short_tmp):
    d = daemon_with_workers(start_daemon, repo, short_tmp, max_memory="350MiB")
    ok = np.full((1, 4), 7, np.float32)
    with d.client() as c:
        np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)
        with pytest.raises(RequestError) as e:
            c.infer("bomb", {"x": np.full((1, 4), 5, np.float32)})
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert re.fullmatch(r"engine onnxruntime \(worker \d+\) was killed: its resident "
                            r"memory [\d.]+ MiB passed workers\.max_memory \(350\.0 MiB\) "
                            r"while running bomb version 1", e.value.message), e.value.message
        np.testing.assert_array_equal(c.infer("bomb", {"x": ok})["y"], ok)
    assert "REASON=killed" in d.log() or "was killed: its resident memory" in d.log()


def test_model_toml_chooses_its_isolation(start_daemon, short_tmp, models_dir):
    repo = short_tmp / "repo"
    for name, isolation in (("vad", "model"), ("ocr-cls", "in-process")):
        (repo / name / "1").mkdir(parents=True)
        os.symlink(models_dir / name / "1" / "model.onnx", repo / name / "1" / "model.onnx")
        (repo / name / "model.toml").write_text(f'isolation = "{isolation}"\n')
    d = daemon_with_workers(start_daemon, repo, short_tmp)
    with d.client() as c:
        c.infer("vad", VAD_OK)
        c.infer("ocr-cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})
        rows = {m["name"]: m for m in c.models()}
    log = d.log()
    assert worker_pids(log, "vad version 1@onnxruntime")  # a worker of its own
    assert not worker_pids(log, "onnxruntime")  # ocr-cls runs in the daemon
    assert rows["ocr-cls"]["state"] == "ready"


def test_workers_settings_wait_for_a_restart(start_daemon, repo, short_tmp):
    d = daemon_with_workers(start_daemon, repo, short_tmp)
    conf = short_tmp / "inferd.toml"
    conf.write_text(conf.read_text().replace('isolation = "backend"',
                                             'isolation = "in-process"'))
    with d.client() as c:
        result = c.call("reload")
        c.infer("vad", VAD_OK)
    assert "workers.isolation" in result["needs_restart"], result
    assert worker_pids(d.log(), "onnxruntime")  # still in a worker
    assert "reload: workers.isolation changed; it takes effect at the next restart" in d.log()


def test_channels_shed_between_bursts_lose_no_request(start_daemon, repo, short_tmp):
    """Through a daemon, with ``[workers] channel_idle_s`` at 50 ms: four clients send
    ocr-cls requests (batch 8: 1.2 MB, through the arenas) in bursts with pauses around
    that length, so channels are closed between bursts and opened again, on the I/O
    thread's path and the model threads' alike. Every request is answered with the same
    bits as the first; once the clients stop, the worker maps no channel arena."""
    d = daemon_with_workers(start_daemon, repo, short_tmp, channel_idle_s=0.05)
    x = np.random.default_rng(8).random((8, 3, 48, 192), dtype=np.float32)
    with d.client() as c:
        expected = c.infer("ocr-cls", {"x": x})
        (row,) = [m for m in c.models() if m["name"] == "ocr-cls"]
        pid = row["worker"]["pid"]
    failures: list[str] = []

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        with d.client() as mine:
            for i in range(24):
                try:
                    got = mine.infer("ocr-cls", {"x": x})
                    for name, want in expected.items():
                        if got[name].tobytes() != want.tobytes():
                            failures.append(f"client {k} request {i}: {name} differs")
                except RequestError as e:
                    failures.append(f"client {k} request {i}: {e.code} {e.message}")
                if i % 6 == 5:
                    time.sleep(0.03 + float(rng.random()) * 0.06)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []

    def arenas() -> int:
        return sum("inferd-worker-arena" in line
                   for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    poll(lambda: arenas() == 0, 30)
    with d.client() as c:  # and served again after, by the same worker
        got = c.infer("ocr-cls", {"x": x})
        assert {k: v.tobytes() for k, v in got.items()} == \
            {k: v.tobytes() for k, v in expected.items()}
        (row,) = [m for m in c.models() if m["name"] == "ocr-cls"]
        assert row["worker"]["pid"] == pid
