"""A model's pipeline settings in a real daemon: model.toml stages, instances and
cpu_affinity; the placement `inferctl models --verbose` shows is what the kernel says
(/proc/<pid>/task/<tid>/status); post steps' string outputs reach the client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.links import link_tree

pytestmark = pytest.mark.slow


def cpus_allowed(pid: int, tid: int) -> str:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                if line.startswith("Cpus_allowed_list"))


def test_placement_of_every_thread_is_applied_and_shown(start_daemon: Any, short_tmp: Path,
                                                        models_dir: Path) -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    repo = short_tmp / "repo"
    (repo / "cls").mkdir(parents=True)
    link_tree(models_dir / "ocr-cls" / "1", repo / "cls" / "1")
    (repo / "cls" / "model.toml").write_text(f"""
instances = 2
cpu_affinity = [{core}]
max_batch = 4
max_delay_ms = 1
[[pre]]
op = "image.resize"
input = "image"
height = 48
width = 192
[[pre]]
op = "image.normalize"
input = "image"
scale = 0.00784313725
mean = 1.0
[[pre]]
op = "image.layout"
input = "image"
source = "HWC"
target = "NCHW"
[[pre]]
op = "rename"
mapping = {{ image = "x" }}
[[post]]
op = "topk"
k = 1
input = "save_infer_model/scale_0.tmp_1"
labels = ["0", "180"]
""")
    daemon = start_daemon("--models", str(repo), "--preload", "cls")
    image = np.full((30, 100, 3), 255, np.uint8)
    with daemon.client() as c:
        out = c.infer("cls", {"image": image}, outputs=["topk_labels", "topk_values"])
        assert out["topk_labels"].tolist() in ([["0"]], [["180"]])
        assert out["topk_values"].dtype == np.float32
        models = {m["name"]: m for m in c.models(verbose=True)}
        plain = {m["name"]: m for m in c.models()}
    assert "placement" not in plain["cls"]
    placement = [p for p in models["cls"]["placement"] if p["stage"] != "engine"]
    assert [p["thread"] for p in placement] == ["inferd-cls-pre", "inferd-cls-infer-0",
                                                "inferd-cls-infer-1", "inferd-cls-post"]
    for p in placement:
        assert cpus_allowed(daemon.proc.pid, p["native_id"]) == str(core), p
        assert p["affinity"] == [core]
    # the engine runs in a worker process: the worker's threads that ran the model keep
    # to its cores too, as the kernel says
    engine = [p for p in models["cls"]["placement"] if p["stage"] == "engine"]
    assert engine, models["cls"]["placement"]
    for p in engine:
        assert p["pid"] != daemon.proc.pid and p["thread"] == f"worker {p['pid']}"
        assert cpus_allowed(p["pid"], p["native_id"]) == str(core), p
        assert p["affinity"] == [core]
    shown = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                            daemon.endpoint, "models", "--verbose"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    for p in placement:
        assert (f"{p['thread']}: stage {p['stage']}, native id {p['native_id']}, cpus {core}"
                in shown.stdout), shown.stdout
    assert f"worker {engine[0]['pid']}: stage engine, native id " in shown.stdout
    assert "backend onnxruntime" in shown.stdout


def test_bad_pipeline_settings_fail_the_load_with_the_key_named(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    repo = short_tmp / "repo"
    (repo / "cls").mkdir(parents=True)
    link_tree(models_dir / "ocr-cls" / "1", repo / "cls" / "1")
    (repo / "cls" / "model.toml").write_text('pre = [{ op = "no.such" }]\n')
    daemon = start_daemon("--models", str(repo))
    from inferd.ipc import RequestError
    with daemon.client() as c, pytest.raises(RequestError) as e:
        c.infer("cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})
    assert "unknown processor 'no.such'" in e.value.message


def _threads(pid: int) -> dict[int, tuple[str, str]]:
    """Each thread of ``pid``: its name and the cores it may run on, read together; a
    thread that ends while they are read is left out (a timer's, a loader's)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(t.name)] = ((t / "comm").read_text().strip(), cpus_allowed(pid, int(t.name)))
        except FileNotFoundError:
            continue
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to tell a pinned thread from a free one")
def test_server_cpu_affinity_pins_the_io_threads_and_nothing_they_start(
        start_daemon: Any, short_tmp: Path, models_dir: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    everywhere = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) \
        else ",".join(map(str, cores))
    core = cores[-1]
    repo = short_tmp / "repo"
    (repo / "cls").mkdir(parents=True)
    link_tree(models_dir / "ocr-cls" / "1", repo / "cls" / "1")
    config = short_tmp / "inferd.toml"
    config.write_text(f"[server]\ncpu_affinity = [{core}]\n")
    daemon = start_daemon("--config", str(config), "--models", str(repo))
    with daemon.client() as c:
        # Loaded on first request: the loader thread is started by the pinned I/O thread.
        c.infer("cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})
        (model,) = c.models(verbose=True)
    pid = daemon.proc.pid
    threads = _threads(pid)
    assert cpus_allowed(pid, pid) == str(core)  # the I/O thread is the main thread
    zmq_io = [cpus for name, cpus in threads.values() if name.startswith("ZMQbg/IO")]
    assert str(core) in zmq_io, threads
    (worker,) = [p for p in model["placement"] if p["stage"] != "engine"]
    assert worker["affinity"] == cores
    # nor the worker process the engine runs in (started by the zygote, not the I/O thread)
    engine = [p for p in model["placement"] if p["stage"] == "engine"]
    assert engine and all(p["affinity"] == cores for p in engine), engine
    assert all(cpus_allowed(p["pid"], p["native_id"]) == everywhere for p in engine), engine
    for tid, (name, cpus) in threads.items():
        if tid != pid and not name.startswith("ZMQbg"):
            assert cpus == everywhere, (tid, name)
    assert f"I/O thread pinned to cores [{core}]" in daemon.log_path.read_text()
