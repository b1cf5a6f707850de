"""Runs sent to a worker from the I/O thread (daemon/model_threads.py, "Runs in a worker
from the I/O thread"), through a real daemon: once a model has served its first runs,
a request that finds it idle has its run sent to the worker by the I/O thread and
answered when the reply is in, with no model thread in between. Each test first brings
a model to that path (and checks, by the ``io_thread_runs`` count, that the request it
provokes went that way), then makes the worker crash, hang past ``kill_after_s``, or
outlive the request's deadline: the request gets exactly one reply, the I/O thread keeps
serving other clients meanwhile, and the model is served again."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import ErrorCode, Region, RequestError
from tests.e2e.test_cache_reload import poll
from tests.e2e.test_workers import HOW, daemon_with_workers, repo  # noqa: F401  fixture

pytestmark = pytest.mark.slow

WARM = 40
"""Runs that bring a model to the I/O thread's path (daemon: IO_RUN_AFTER = 32)."""
OK = np.full((1, 4), 7, np.float32)


def io_runs(c, model: str) -> int:
    (entry,) = [m for m in c.models() if m["name"] == model]
    return int(entry["io_thread_runs"])


def warm(c, model: str = "bomb", x: np.ndarray = OK) -> int:
    """Serve ``model`` until its requests are sent from the I/O thread; the count."""
    for _ in range(WARM):
        c.infer(model, {"x": x})
    runs = io_runs(c, model)
    assert runs > 0, "the model's runs are not sent from the I/O thread"
    return runs


class Pinger:
    """Another client pinging the daemon while a run is in flight: the pings answered
    before that run's reply show that the I/O thread did not wait in it."""

    def __init__(self, d) -> None:
        self.d = d
        self.answered = 0
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        with self.d.client(timeout=10) as c:
            while not self.stop.is_set():
                try:
                    assert c.ping()["pong"]
                    self.answered += 1
                except RequestError as e:
                    self.errors.append(f"{e.code}: {e.message}")
                self.stop.wait(0.02)

    def finish(self) -> int:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.errors == []
        return self.answered


@pytest.mark.parametrize("how", sorted(HOW))
def test_a_crash_of_a_run_sent_from_the_io_thread_costs_one_request(
        how, start_daemon, repo, short_tmp):  # noqa: F811  the repo fixture
    d = daemon_with_workers(start_daemon, repo, short_tmp)
    trigger, ended = HOW[how]
    with d.client() as c:
        before = warm(c)
        with pytest.raises(RequestError) as e:
            c.infer("bomb", {"x": np.full((1, 4), trigger, np.float32)})
        assert io_runs(c, "bomb") == before + 1  # the crash's run went that way
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert re.fullmatch(rf"engine onnxruntime \(worker \d+\) {ended} while running "
                            r"bomb version 1", e.value.message), e.value.message
        np.testing.assert_array_equal(c.infer("bomb", {"x": OK})["y"], OK)
    assert d.proc.poll() is None
    assert re.search(rf"ERROR inferd\.daemon\.workers\.pool: engine onnxruntime \(worker \d+\) "
                     rf"{ended} while running bomb version 1", d.log())


def test_a_run_sent_from_the_io_thread_past_kill_after_is_killed_by_the_io_loop(
        start_daemon, repo, short_tmp):  # noqa: F811
    d = daemon_with_workers(start_daemon, repo, short_tmp, kill_after_s=2.0,
                            restart_backoff_s=0.1)
    with d.client(timeout=60) as c:
        before = warm(c)
        pinger = Pinger(d)
        try:
            poll(lambda: pinger.answered >= 1, 10)
            began = pinger.answered
            with pytest.raises(RequestError) as e:
                c.infer("bomb", {"x": np.full((1, 4), 4, np.float32)})  # sleeps for ever
            during = pinger.answered - began
        finally:
            pinger.finish()
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert re.fullmatch(r"engine onnxruntime \(worker \d+\) was killed after 2 s in one "
                            r"call \(workers\.kill_after_s\) while running bomb version 1",
                            e.value.message), e.value.message
        # pings every 20 ms for the 2 s the run hung: the I/O thread served them
        assert during >= 5, during
        assert io_runs(c, "bomb") == before + 1
        np.testing.assert_array_equal(c.infer("bomb", {"x": OK})["y"], OK)


def test_a_deadline_passed_during_a_run_sent_from_the_io_thread_is_answered_once(
        start_daemon, repo, short_tmp):  # noqa: F811
    d = daemon_with_workers(start_daemon, repo, short_tmp, kill_after_s=3.0,
                            restart_backoff_s=0.1)
    with d.client(timeout=60) as c:
        warm(c)
        with pytest.raises(RequestError) as e:
            c.infer("bomb", {"x": np.full((1, 4), 4, np.float32)}, timeout=0.5)
        # answered at its deadline: the kill would have answered UNAVAILABLE
        assert e.value.code is ErrorCode.DEADLINE_EXCEEDED, e.value.message
        # the worker is killed at kill_after_s all the same; then the model serves again
        poll(lambda: "was killed after 3 s in one call" in d.log(), 20)
        np.testing.assert_array_equal(c.infer("bomb", {"x": OK})["y"], OK)
        assert c.ping()["pong"]
    assert d.proc.poll() is None


def test_shared_memory_in_and_out_on_runs_sent_from_the_io_thread(
        start_daemon, repo, short_tmp):  # noqa: F811
    d = daemon_with_workers(start_daemon, repo, short_tmp)
    rng = np.random.default_rng(5)
    x = rng.random((1, 3, 48, 192), dtype=np.float32)
    with d.client() as c:
        expected = c.infer("ocr-cls", {"x": x})
        warm(c, "ocr-cls", x)
        region = c.register(Region(2**20, name="inferd-io-starts"))
        before = io_runs(c, "ocr-cls")
        for i in range(10):
            region.reset()
            staged = region.ndarray(x.shape, np.float32)
            staged[...] = x + i
            out = c.infer("ocr-cls", {"x": staged}, outputs_into=(region, 2**19, 2**19))
            plain = c.infer("ocr-cls", {"x": x + i})
            for k in plain:
                assert np.shares_memory(out[k], np.frombuffer(region.buffer, np.uint8))
                np.testing.assert_array_equal(out[k], plain[k])
        assert io_runs(c, "ocr-cls") >= before + 20
        again = c.infer("ocr-cls", {"x": x})
    for k in expected:
        np.testing.assert_array_equal(expected[k], again[k])


def test_runs_sent_from_the_io_thread_and_queued_ones_race_with_crashes_and_kills(
        start_daemon, repo, short_tmp):  # noqa: F811
    """Races of the new path: four clients keep ``bomb`` busy (so its requests go both
    ways, sent from the I/O thread when it is idle and through its threads when not)
    while one of them sends a crashing input now and then and the test SIGKILLs the
    worker from outside: every request gets exactly one reply (a right answer, or
    UNAVAILABLE naming the worker's death), and once the traffic stops the model is
    idle again (nothing in flight or queued) and serves."""
    import os
    import signal

    from tests.e2e.test_workers import worker_pids

    d = daemon_with_workers(start_daemon, repo, short_tmp, restart_backoff_s=0.05,
                            refuse_client_after=1000, set_aside_after=1000)
    with d.client() as c:
        warm(c)
    errors: list[str] = []
    counts = {"ok": 0, "died": 0}
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        with d.client(timeout=60) as c:
            for i in range(150):
                crash = k == 0 and i % 25 == 24
                x = np.full((1, 4), 1 if crash else 10 + k, np.float32)
                try:
                    y = c.infer("bomb", {"x": x})["y"]
                    if crash or not np.array_equal(y, x):
                        errors.append(f"client {k} request {i}: {y}")
                    with lock:
                        counts["ok"] += 1
                except RequestError as e:
                    if e.code is not ErrorCode.UNAVAILABLE or (
                            "died of" not in e.message and "was killed" not in e.message):
                        errors.append(f"client {k} request {i}: {e.code}: {e.message}")
                    with lock:
                        counts["died"] += 1
                if rng.random() < 0.3:
                    time.sleep(0.002)  # now and then idle: the I/O thread's path

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(3):  # the OOM killer's way, while the traffic runs
        time.sleep(0.3)
        pids = worker_pids(d.log(), "bomb version 1@onnxruntime")
        try:
            os.kill(pids[-1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert errors == [], errors[:5]
    assert counts["ok"] + counts["died"] == 4 * 150  # one reply each, no more, no less
    assert counts["died"] >= 6, counts  # the crashes it asked for, and the kills
    with d.client() as c:
        def idle() -> bool:
            (entry,) = [m for m in c.models() if m["name"] == "bomb"]
            return entry["in_flight"] == 0 and entry["queued"] == 0
        poll(idle, 30)
        assert io_runs(c, "bomb") > WARM
        np.testing.assert_array_equal(c.infer("bomb", {"x": OK})["y"], OK)
    assert d.proc.poll() is None


def _a_beside_bs_run(c, release: Path, n: int):
    """Load "a", bring plugin model "b" (whose run on a negative input waits for
    ``release``) to a run in progress, then serve ``n`` of a's requests beside it. b's
    first run is measured (one measured run at a time, for all models: another model's
    would wait for it), its second, of the same shapes, is not and waits. Returns that
    request's future and the worker pids of a and b."""
    c.load("a")
    np.testing.assert_array_equal(c.infer("b", {"x": OK})["y"], OK)
    waiting = c.submit("infer", "b", {"x": -OK})
    poll(lambda: Path(f"{release}.running").exists(), 60)
    for _ in range(n):
        np.testing.assert_array_equal(c.infer("a", {"x": OK})["y"], OK)
    pids = {m["name"]: m["worker"]["pid"] for m in c.models()}
    return waiting, pids["a"], pids["b"]


FIRST_MEMORY_DEBUG = ('[placement]\nmode = "first"\n'
                      '[logging]\nmodules = { "inferd.daemon.memory" = "debug" }\n')
DROPPED = r"model a version 1: working memory of shape class .* measured beside other " \
          r"runs .*: dropped"


def test_a_model_whose_first_runs_overlapped_other_runs_reaches_the_io_thread(
        start_daemon, short_tmp):
    """A model's first runs measured while another model's run is in progress in the
    same process are dropped as its working memory (the peak is a whole process's); the
    class is tried again now and then (daemon/memory.py, RETRY_AFTER) and settles once
    the other run is over, and the model's runs go to the I/O thread's path. Before, it
    was never tried again: the model took its threads for every request for as long as
    the daemon ran. The other run here is one that waits for the test, of plugin model
    "b", which shares its worker with "a" (both on the plugin, ``isolation =
    "backend"``)."""
    release = short_tmp / "release"
    shared = 'backends = ["slowload"]\nisolation = "backend"\n'
    d = _slowload_daemon(start_daemon, short_tmp, {
        "a": shared, "b": f'{shared}[slowload]\nrun_release = "{release}"\n'},
        FIRST_MEMORY_DEBUG)
    try:
        with d.client() as c:
            waiting, a_pid, b_pid = _a_beside_bs_run(c, release, 10)
            assert re.search(DROPPED, d.log()), d.log()
            assert io_runs(c, "a") == 0
            assert a_pid == b_pid
            release.touch()
            np.testing.assert_array_equal(waiting.result()["y"], -OK)

            def reached() -> bool:
                for _ in range(100):
                    c.infer("a", {"x": OK})
                return io_runs(c, "a") > 0
            poll(reached, timeout=120)
    finally:
        release.touch()


def test_a_run_in_another_worker_leaves_a_models_measurements_alone(
        start_daemon, short_tmp):
    """Runs in progress are counted by the process they run in: a model's run in one
    worker does not spoil the working-memory measurement of a model in another (each
    measures its own process's peak). Here "a" (onnxruntime's worker) serves its first
    runs while plugin model "b"'s run waits in a worker of its own: a's class settles
    and its requests go the I/O thread's way at once, b's run still in progress. Before,
    one count for every worker: each of a's measurements was dropped, and its requests
    took its threads until b's run ended."""
    release = short_tmp / "release"
    d = _slowload_daemon(start_daemon, short_tmp, {
        "a": "", "b": f'backends = ["slowload"]\n[slowload]\nrun_release = "{release}"\n'},
        FIRST_MEMORY_DEBUG)
    try:
        with d.client() as c:
            waiting, a_pid, b_pid = _a_beside_bs_run(c, release, WARM)
            assert a_pid != b_pid
            assert not re.search(DROPPED, d.log()), d.log()
            assert io_runs(c, "a") > 0, d.log()
            release.touch()
            np.testing.assert_array_equal(waiting.result()["y"], -OK)
    finally:
        release.touch()


SLOW_LOAD_BACKEND = '''
import time
from pathlib import Path

import numpy as np

from inferd.ipc.errors import ModelError
from inferd.libbackends.contract import Backend, DeviceKind, LoadedModel, Probe, TensorSpec


def _wait(release):
    """Until the file ``release`` names exists (at most 120 s); None: no wait."""
    deadline = time.monotonic() + 120
    while release is not None and not Path(release).exists() \\
            and time.monotonic() < deadline:
        time.sleep(0.05)


class Copy(LoadedModel):
    inputs = (TensorSpec("x", "float32", (None, None)),)
    outputs = (TensorSpec("y", "float32", (None, None)),)

    def __init__(self, run_release):
        self.run_release = run_release

    def run(self, inputs, outputs=None):
        if self.run_release is not None and inputs["x"].flat[0] < 0:  # a run that waits
            Path(self.run_release + ".running").touch()
            _wait(self.run_release)
        return {"y": np.array(inputs["x"])}

    def unload(self):
        pass


class SlowLoad(Backend):
    """Its load returns once the file model.toml's [slowload] release names exists; a
    run on an input whose first value is negative, once the file run_release names does
    (it makes RUN_RELEASE.running when it begins to wait)."""

    id = "slowload"
    version = "1.0"
    kind = DeviceKind.CPU

    def probe(self):
        return Probe(True, devices=("cpu",))

    def supports(self, model_path):
        return True, ""

    def load(self, model_path, options):
        for key in options.options:
            if key not in ("release", "run_release"):
                raise ModelError(f"[slowload] {key}: no such key")
        _wait(options.options.get("release"))
        return Copy(options.options.get("run_release"))


def create_backend():
    return SlowLoad()
'''


def _slowload_daemon(start_daemon, short_tmp, models_toml: dict[str, str], config: str):
    """A daemon with engines in workers, over an Identity model per name of
    ``models_toml`` (its model.toml's text, if any), the slowload plugin beside the
    shipped backends, and ``config`` after [workers] and [metrics]."""
    from tests.daemon.test_workers import unary_model

    models = short_tmp / "repo"
    for name, toml in models_toml.items():
        unary_model(models, name, "Identity")
        if toml:
            (models / name / "model.toml").write_text(toml)
    backends = short_tmp / "backends"
    backends.mkdir()
    (backends / "slowload.py").write_text(SLOW_LOAD_BACKEND)
    conf = short_tmp / "inferd.toml"
    conf.write_text('[workers]\nisolation = "backend"\n[metrics]\ntextfile = ""\n' + config)
    return start_daemon("--config", str(conf), "--models", str(models), "--backends-dir",
                        str(backends))


def test_a_model_in_a_worker_takes_the_io_threads_path_while_its_rivals_are_measured(
        start_daemon, short_tmp):
    """A rival measured for placement in a worker of its own counts as no run in the
    daemon: the serving model's first runs are measured alone, its shape class settles,
    and its requests are sent from the I/O thread while the contest goes on (here, a
    rival whose load waits for the test). Before, the contest counted as a run in
    progress for every meter: each of those measurements was dropped, and every request
    went through the model's threads until placement ended, up to [placement]
    time_limit_s (an Identity model: its first ~3,000 requests)."""
    release = short_tmp / "release"
    d = _slowload_daemon(start_daemon, short_tmp, {
        "a": f'backends = ["onnxruntime", "slowload"]\n[slowload]\nrelease = "{release}"\n'},
        '[placement]\nmode = "measured"\n')
    try:
        with d.client() as c:
            c.load("a")
            # the rival's worker started; its load waits for the release file
            poll(lambda: "a version 1@slowload (measuring) started" in d.log(), timeout=60)
            for _ in range(WARM):
                np.testing.assert_array_equal(c.infer("a", {"x": OK})["y"], OK)
            (row,) = [m for m in c.models() if m["name"] == "a"]
            assert row["placement_status"] == "measuring", row
            assert io_runs(c, "a") > 0, d.log()
    finally:
        release.touch()
