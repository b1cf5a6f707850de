"""The model cache end to end: a real daemon process, real clients over ipc://, the real
demo models symlinked into a temporary repository that the test changes under load."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferd.ipc import Client, RequestError
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import Op
from tests.links import link_file



def add_version(repo: Path, models_dir: Path, name: str, version: int,
                demo: str | None = None) -> None:
    d = repo / name / str(version)
    d.mkdir(parents=True)
    link_file(models_dir / (demo or name) / "1" / "model.onnx", d / "model.onnx")


def poll(cond: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def rows(client: Client, name: str) -> list[dict[str, Any]]:
    return [m for m in client.models() if m["name"] == name]


def inferctl(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], capture_output=True, text=True, timeout=120, check=False)


class SteadyClient(threading.Thread):
    """Sends requests to one model back to back, recording every failure."""

    def __init__(self, endpoint: str, model: str, inputs: dict[str, Any]) -> None:
        super().__init__(name=f"client-{model}", daemon=True)
        self.endpoint, self.model, self.inputs = endpoint, model, inputs
        self.ok = 0
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with Client(self.endpoint, timeout=60) as c:
            while not self.halt.is_set():
                try:
                    c.infer(self.model, self.inputs)
                    self.ok += 1
                except RequestError as e:
                    self.failures.append(f"{self.model}: {e.code}: {e.message}")


@pytest.mark.slow
def test_reload_adds_removes_and_reversions_under_load_without_a_failed_request(
        models_dir: Path, short_tmp: Path, start_daemon: Any,
        demo_inputs: dict[str, Any]) -> None:
    repo = short_tmp / "repo"
    for name in ("ocr-cls", "vad", "ocr-det"):
        add_version(repo, models_dir, name, 1)
    config = short_tmp / "inferd.toml"
    config.write_text('[cache]\nmax_memory = "unlimited"\n')
    d = start_daemon("--config", str(config), "--models", str(repo))
    with d.client() as c:
        c.load("ocr-det")
    clients = [SteadyClient(d.endpoint, m, demo_inputs[m])
               for m in ("ocr-cls", "ocr-cls", "vad", "vad")]
    for t in clients:
        t.start()
    poll(lambda: all(t.ok >= 5 for t in clients))

    # 1. SIGHUP: a new model appears, ocr-cls gets version 2 beside version 1.
    add_version(repo, models_dir, "ocr-rec", 1)
    add_version(repo, models_dir, "ocr-cls", 2)
    d.proc.send_signal(signal.SIGHUP)
    with d.client() as c:
        poll(lambda: [(m["version"], m["state"]) for m in rows(c, "ocr-cls")]
             == [(2, "ready")])
        assert [m["state"] for m in rows(c, "ocr-rec")] == ["unloaded"]
        before = [t.ok for t in clients]
        poll(lambda: all(t.ok >= n + 5 for t, n in zip(clients, before, strict=True)))
        assert rows(c, "ocr-cls")[0]["requests"] > 0  # version 2 serves now

    # 2. inferctl reload: ocr-det is gone from the repository.
    shutil.rmtree(repo / "ocr-det")
    done = inferctl(d.endpoint, "reload")
    assert done.returncode == 0, done.stderr
    assert "removed: ocr-det" in done.stdout
    with d.client() as c:
        assert rows(c, "ocr-det") == []
        with pytest.raises(RequestError) as e:
            c.infer("ocr-det", demo_inputs["ocr-det"])
        assert e.value.code is ErrorCode.NOT_FOUND
        assert c.infer("ocr-rec", demo_inputs["ocr-rec"])  # the added model serves
        before = [t.ok for t in clients]
        poll(lambda: all(t.ok >= n + 5 for t, n in zip(clients, before, strict=True)))

    # 3. A config that does not validate is refused; the running one stays.
    config.write_text('[cache]\nmax_memory = "plenty"\n')
    refused = inferctl(d.endpoint, "reload")
    assert refused.returncode == 1 and "max_memory = 'plenty'" in refused.stderr

    for t in clients:
        t.halt.set()
    for t in clients:
        t.join(60)
    assert [f for t in clients for f in t.failures] == []
    assert sum(t.ok for t in clients) > 40
    log = d.log()
    assert "model ocr-cls version 1 unloaded: replaced by version 2" in log
    assert "model ocr-det version 1 unloaded: removed from the repository" in log
    assert d.stop() == 0


@pytest.mark.slow
def test_fifty_concurrent_first_requests_share_one_load_and_models_shows_it(
        models_dir: Path, short_tmp: Path, start_daemon: Any,
        demo_inputs: dict[str, Any]) -> None:
    repo = short_tmp / "repo"
    add_version(repo, models_dir, "ocr-cls", 1)
    # the BACKEND column is asserted below: the first backend that loads, not a measured
    # one (measured placement may move it to openvino meanwhile)
    (repo / "ocr-cls" / "model.toml").write_text('placement = "first"\n')
    add_version(repo, models_dir, "vad", 1)
    d = start_daemon("--models", str(repo), "--preload", "vad")
    with d.client() as c:
        pending = [c.submit(Op.INFER, "ocr-cls", demo_inputs["ocr-cls"]) for _ in range(50)]
        assert all(p.result() for p in pending)
        # A request is counted just after its reply is sent.
        poll(lambda: rows(c, "ocr-cls")[0]["requests"] == 50)
        (row,) = rows(c, "ocr-cls")
        assert (row["loads"], row["state"]) == (1, "ready")
        assert row["memory_bytes"] > 0
    table = inferctl(d.endpoint, "models")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "STATE", "VERSION", "BACKEND", "DEVICE", "MEMORY",
                                "PINNED", "LAST", "USED", "REQUESTS", "REASON"]
    cls = next(line.split() for line in lines if line.startswith("ocr-cls"))
    # MEMORY is two words ("1.6 MiB"), LAST USED three ("0s ago" is two).
    assert cls[:5] == ["ocr-cls", "ready", "1", "onnxruntime", "CPU"]
    assert cls[-2:] == ["50", "-"]
    vad = next(line.split() for line in lines if line.startswith("vad"))
    assert vad[7] == "yes"  # pinned by --preload
    unload = inferctl(d.endpoint, "unload", "ocr-cls")
    assert unload.returncode == 0 and "ocr-cls: unloaded" in unload.stdout
    assert d.stop() == 0


GRAPH = """
inputs = ["x"]
[outputs]
{output} = "cls.probs"
[[nodes]]
name = "cls"
model = "ocr-cls"
inputs = {{ x = "input.x" }}
rename = {{ "save_infer_model/scale_0.tmp_1" = "probs" }}
"""


@pytest.mark.slow
def test_reload_retires_a_changed_graph_without_a_failed_request(
        models_dir: Path, short_tmp: Path, start_daemon: Any,
        demo_inputs: dict[str, Any]) -> None:
    repo = short_tmp / "repo"
    add_version(repo, models_dir, "ocr-cls", 1)
    (repo / "g").mkdir()
    (repo / "g" / "graph.toml").write_text(GRAPH.format(output="before"))
    d = start_daemon("--models", str(repo))
    x = {"x": demo_inputs["ocr-cls"]["x"]}
    with d.client() as c:
        assert list(c.infer("g", x)) == ["before"]
    steady = SteadyClient(d.endpoint, "g", x)
    steady.start()
    poll(lambda: steady.ok >= 5)

    (repo / "g" / "graph.toml").write_text(GRAPH.format(output="after"))
    done = inferctl(d.endpoint, "reload")
    assert done.returncode == 0, done.stderr
    assert "graphs_retired: g" in done.stdout
    with d.client() as c:
        assert list(c.infer("g", x)) == ["after"]
        n = steady.ok
        poll(lambda: steady.ok >= n + 5)
    steady.halt.set()
    steady.join(60)
    assert steady.failures == []
    assert "graph g: graph.toml changed or removed; retiring the running graph" in d.log()
