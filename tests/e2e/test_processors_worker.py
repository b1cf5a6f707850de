"""Processors in the processors worker, through a real daemon (issue 30, item 1): a user
processor that aborts or dereferences NULL on a trigger value, as a model's ``[[pre]]``
step and as a graph node, costs the request that was running, never the daemon; the
step is served again on the next request, and a client of another model sees nothing
the whole time. The daemon itself never maps OpenCV: the built-in step that uses it runs
in the processors worker."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import ErrorCode, RequestError
from tests.daemon.test_workers import unary_model
from tests.e2e.test_cache_reload import poll
from tests.e2e.test_workers import Neighbour

pytestmark = pytest.mark.slow

CRASHY = '''
import ctypes
import os


def make_crashy(note=False):
    def step(values):
        x = values["x"]
        how = int(x.reshape(-1)[0]) if x.size else 0
        if how == 1:
            os.abort()
        if how == 2:
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if note:  # a graph node's values may be anything
            return {"x": x + 1, "note": ["a list", {"of": x[:1]}]}
        return {"x": x + 1}
    return step


PROCESSORS = {"crashy": make_crashy}
'''

GRAPH = '''
inputs = ["x"]
[outputs]
y = "neg.y"
small = "shrink.x"

[[nodes]]
name = "crashy"
processor = "crashy"
params = { note = true }
inputs = { x = "input.x" }

[[nodes]]
name = "neg"
model = "neg"
inputs = { x = "crashy.x" }

[[nodes]]
name = "shrink"
processor = "image.resize"
params = { input = "x", height = 2, width = 2 }
inputs = { x = "input.x" }
'''

HOW = {"abort": (1, "died of SIGABRT"), "null": (2, "died of SIGSEGV")}


@pytest.fixture
def daemon(start_daemon, short_tmp: Path):  # type: ignore[no-untyped-def]
    return _daemon(start_daemon, short_tmp)


def _daemon(start_daemon, short_tmp: Path, workers: str = ""):  # type: ignore[no-untyped-def]
    repo, processors = short_tmp / "repo", short_tmp / "processors"
    for name, op in (("neg", "Neg"), ("other", "Identity")):
        unary_model(repo, name, op)
    (repo / "neg" / "model.toml").write_text('[[pre]]\nop = "crashy"\n')
    (repo / "g").mkdir()
    (repo / "g" / "graph.toml").write_text(GRAPH)
    processors.mkdir()
    (processors / "crashy.py").write_text(CRASHY)
    (processors / "broken.py").write_text("this is not python\n")
    conf = short_tmp / "inferd.toml"
    if "isolation" not in workers:
        workers = f'isolation = "backend"\n{workers}'
    conf.write_text(f'[workers]\nrestart_backoff_s = 0.1\n{workers}'
                    f'[processors]\ndirectory = "{processors}"\n'
                    f'[models]\nrepository = "{repo}"\n[metrics]\ntextfile = ""\n')
    return start_daemon("--config", str(conf))


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("how", sorted(HOW))
def test_a_processor_that_crashes_costs_one_request(how, daemon) -> None:
    d = daemon
    trigger, ended = HOW[how]
    ok = np.arange(8, dtype=np.float32).reshape(2, 4) + 10
    bad = np.full((1, 4), trigger, np.float32)
    died = {"neg": re.compile(rf"model neg: step pre\[0\] crashy: processors \(worker \d+\) "
                              rf"{ended} while running processor crashy"),
            # the graph's other processor node may be running in that worker too
            "g": re.compile(rf"graph g: node crashy: processors \(worker \d+\) {ended} "
                            rf"while running processor crashy(, processor image\.resize)?")}
    neighbour = Neighbour(d, "other", np.arange(6, dtype=np.float32).reshape(2, 3))
    try:
        with d.client() as c:
            # the graph's node adds 1, then neg's [[pre]] step 1 more
            expected = {"neg": -(ok + 1), "g": -(ok + 2)}
            np.testing.assert_array_equal(c.infer("neg", {"x": ok})["y"], expected["neg"])
            # what the processors worker holds counts in the cache budget, as an engine
            first = c.status()["cache"]["engines_bytes"].get("processors", 0)
            assert first > 0, c.status()["cache"]
            out = c.infer("g", {"x": ok})
            np.testing.assert_array_equal(out["y"], expected["g"])
            assert out["small"].shape == (2, 2)
            for model in ("neg", "g"):  # a [[pre]] step, then a graph node
                with pytest.raises(RequestError) as e:
                    c.infer(model, {"x": bad})
                assert e.value.code is ErrorCode.UNAVAILABLE, e.value
                assert died[model].fullmatch(e.value.message), e.value.message
                assert c.ping()["pong"]
                # built again in a new processors worker at the next call
                np.testing.assert_array_equal(c.infer(model, {"x": ok})["y"],
                                              expected[model])
            text = c.call("metrics")["text"]
            # counted again for the new worker (the dead one's count went with it)
            assert c.status()["cache"]["engines_bytes"].get("processors", 0) > 0
        poll(lambda: neighbour.runs >= 3, 30)
    finally:
        neighbour.finish()
    assert neighbour.errors == []
    assert d.proc.poll() is None
    assert 'inferd_worker_restarts_total{backend="processors",reason="signal"} 2.0' in text
    log = d.log()
    assert re.search(rf"ERROR inferd\.daemon\.workers\.pool: processors \(worker \d+\) "
                     rf"{ended} while running processor crashy; its steps are built again",
                     log), log
    # the user files were imported in the processors worker, which logs as the daemon
    assert re.search(r"processor file \S+/broken\.py skipped at import", log), log
    assert re.search(r"processor file \S+/crashy\.py: registered crashy", log), log
    # OpenCV (image.resize) is mapped in the processors worker, never in the daemon
    pids = [int(p) for p in re.findall(r"worker processors started: pid (\d+)", log)]
    assert len(pids) >= 3, log  # at start (the user files), then after each death
    assert "/cv2/" in _maps(pids[-1])
    assert "/cv2/" not in _maps(d.proc.pid)
    counted = re.findall(r"processors worker \(pid (\d+)\) holds [\d.]+ MiB \(PSS\) after "
                         r"its first step: counted in the cache budget while it runs", log)
    assert len(set(counted)) >= 3, log  # the first worker, then each one after a death


def test_a_client_whose_steps_keep_killing_the_processors_worker_is_refused(
        start_daemon, short_tmp: Path) -> None:
    """A [[pre]] step's deaths are charged as a run's are (daemon/workers/quarantine.py):
    the client is refused for that model, the other models still serve it."""
    d = _daemon(start_daemon, short_tmp, "refuse_client_after = 2\n")
    ok = np.full((1, 4), 10, np.float32)
    with d.client() as c:
        for _ in range(2):
            with pytest.raises(RequestError) as e:
                c.infer("neg", {"x": np.full((1, 4), 1, np.float32)})
            assert "processors (worker" in e.value.message, e.value.message
        with pytest.raises(RequestError) as e:
            c.infer("neg", {"x": ok})
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert e.value.message.startswith(f"model neg: uid {os.getuid()} is refused for "), \
            e.value.message
        np.testing.assert_array_equal(c.infer("other", {"x": ok})["y"], ok)


def test_in_process_the_steps_run_in_the_daemon(start_daemon, short_tmp: Path) -> None:
    """``isolation = "in-process"``: no processors worker; the user files are imported by
    the daemon at start, and its steps run there."""
    d = _daemon(start_daemon, short_tmp, 'isolation = "in-process"\n')
    ok = np.full((1, 4), 10, np.float32)  # not a trigger: here it would end the daemon
    with d.client() as c:
        np.testing.assert_array_equal(c.infer("neg", {"x": ok})["y"], -(ok + 1))
    log = d.log()
    assert "worker processors started" not in log and "zygote" not in log, log
    assert re.search(r"processor file \S+/crashy\.py: registered crashy", log), log
