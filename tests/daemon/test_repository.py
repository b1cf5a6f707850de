"""The model repository as a careful operator changes it under a running daemon (issue
18, defects 4 and 5): a model or version folder that cannot be read fails only its own
model, with the path and the reason, at start-up and on reload; a version file replaced
in place is noticed by a reload and loaded again without a failed request.

Root reads every file whatever its mode, so as root the daemon runs without the two
capabilities that let it (``setpriv --bounding-set=-dac_override,-dac_read_search``):
a mode-000 folder is then really unreadable to it."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from inferd.ipc import Client, RequestError
from inferd.ipc.protocol import Op
from tests.e2e.test_cache_reload import add_version, poll, rows

pytestmark = pytest.mark.slow  # each test runs a daemon or a child process: seconds



def unprivileged() -> list[str]:
    """A command prefix under which the daemon cannot read a mode-000 folder."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root's file-reading capabilities")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def _failed(client: Any, name: str) -> str:
    (row,) = [r for r in rows(client, name) if r["default"]]
    assert row["state"] == "failed", row
    return row["error"]


def test_unreadable_model_and_version_folders_fail_only_their_models_at_start(
        models_dir: Path, short_tmp: Path, start_daemon: Any,
        demo_inputs: dict[str, Any]) -> None:
    repo = short_tmp / "repo"
    for name in ("ocr-cls", "vad", "ocr-det"):
        add_version(repo, models_dir, name, 1)
    (repo / "vad" / "1").chmod(0)  # a version folder
    (repo / "ocr-det").chmod(0)  # a model folder
    try:
        d = start_daemon("--models", str(repo), "--preload", "ocr-cls", wrap=unprivileged())
        with d.client() as c:
            assert "Permission denied" in _failed(c, "vad")
            assert f"cannot read {repo.resolve()}/vad/1" in _failed(c, "vad")
            assert f"cannot read {repo.resolve()}/ocr-det" in _failed(c, "ocr-det")
            assert c.infer("ocr-cls", demo_inputs["ocr-cls"])
            with pytest.raises(RequestError) as e:
                c.infer("vad", demo_inputs["vad"])
            assert "vad/1: Permission denied" in e.value.message
        log = d.log()
        assert f"model vad cannot be served: model vad: cannot read {repo.resolve()}/vad/1: " \
               f"Permission denied" in log
        assert "Traceback" not in log
    finally:
        (repo / "vad" / "1").chmod(0o755)
        (repo / "ocr-det").chmod(0o755)


def test_a_reload_with_an_unreadable_folder_applies_everything_else(
        models_dir: Path, short_tmp: Path, start_daemon: Any,
        demo_inputs: dict[str, Any]) -> None:
    repo = short_tmp / "repo"
    for name in ("ocr-cls", "vad"):
        add_version(repo, models_dir, name, 1)
    d = start_daemon("--models", str(repo), "--preload", "ocr-cls", "--preload", "vad",
                     wrap=unprivileged())
    try:
        (repo / "vad" / "1").chmod(0)
        add_version(repo, models_dir, "ocr-cls", 2)
        with d.client(timeout=120) as c:
            summary = c.call(Op.RELOAD)
            assert "ocr-cls: version 1 -> 2" in summary["changed"], summary
            assert (f"vad: cannot be served (model vad: cannot read {repo.resolve()}/vad/1: "
                    f"Permission denied)") in summary["changed"], summary
            assert [(r["version"], r["state"]) for r in rows(c, "ocr-cls")] == [(2, "ready")]
            assert "vad/1: Permission denied" in _failed(c, "vad")
            assert c.infer("ocr-cls", demo_inputs["ocr-cls"])
            # An unload must work even for a model that cannot be read now.
            c.unload("vad")
            (repo / "vad" / "1").chmod(0o755)
            assert "vad: can be served again" in c.call(Op.RELOAD)["changed"]
            assert c.infer("vad", demo_inputs["vad"])  # readable again: served again
        log = d.log()
        assert "reload failed" not in log and "Traceback" not in log
    finally:
        (repo / "vad" / "1").chmod(0o755)


def test_a_request_for_an_unreadable_model_says_why(
        models_dir: Path, short_tmp: Path, start_daemon: Any) -> None:
    repo = short_tmp / "repo"
    add_version(repo, models_dir, "vad", 1)
    d = start_daemon("--models", str(repo), wrap=unprivileged())
    (repo / "vad").chmod(0)
    try:
        with d.client() as c:
            for op in (Op.LOAD, Op.INFER):
                with pytest.raises(RequestError) as e:
                    c.call(op, "vad")
                assert f"cannot read {repo.resolve()}/vad: Permission denied" in \
                    e.value.message, (op, e.value.code, e.value.message)
        assert "Traceback" not in d.log()
    finally:
        (repo / "vad").chmod(0o755)


def test_unload_of_a_model_whose_model_toml_became_unreadable(
        models_dir: Path, short_tmp: Path, start_daemon: Any) -> None:
    """Issue 18, defect 10: an unload must always work."""
    repo = short_tmp / "repo"
    add_version(repo, models_dir, "vad", 1)
    settings = repo / "vad" / "model.toml"
    settings.write_text("instances = 1\n")
    d = start_daemon("--models", str(repo), wrap=unprivileged())
    try:
        with d.client(timeout=120) as c:
            c.load("vad")
            settings.chmod(0)
            c.call(Op.RELOAD)
            assert "Permission denied" in _failed(c, "vad")
            c.unload("vad")
            assert [r["state"] for r in rows(c, "vad")] == ["failed"]  # unloaded; unservable
            assert not any(r["state"] == "ready" for r in rows(c, "vad"))
            c.unload("vad")  # twice: nothing loaded, still fine
        assert "model vad version 1 unloaded: unload requested" in d.log()
    finally:
        settings.chmod(0o644)


def add_model(add: float) -> bytes:
    """An ONNX model y = x + ``add`` (x: [N, 4] float): what it adds tells which file
    served a request. Models of different ``add`` have the same size."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor("c", TensorProto.FLOAT, [4], [add] * 4)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m.SerializeToString()


class Adder(threading.Thread):
    """Sends requests back to back, recording what each added (or its failure)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="adder", daemon=True)
        self.endpoint = endpoint
        self.added: list[float] = []
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        x = np.zeros((1, 4), np.float32)
        with Client(self.endpoint, timeout=60) as c:
            while not self.halt.is_set():
                try:
                    self.added.append(float(c.infer("m", {"x": x})["y"][0, 0]))
                except RequestError as e:
                    self.failures.append(f"{e.code}: {e.message}")


def _replace(path: Path, data: bytes, how: str) -> None:
    if how == "rename":  # a new file swapped in atomically: a new inode
        tmp = path.with_name("model.onnx.new")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    elif how == "overwrite":  # the same inode, the same size, the mtime put back
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["rename", "overwrite"])
def test_a_version_file_replaced_in_place_is_loaded_again_without_a_failed_request(
        short_tmp: Path, start_daemon: Any, how: str) -> None:
    """Issue 18, defect 5."""
    model = short_tmp / "repo" / "m" / "1" / "model.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(add_model(1.0))
    assert len(add_model(1.0)) == len(add_model(2.0))
    d = start_daemon("--models", str(short_tmp / "repo"), "--preload", "m")
    adder = Adder(d.endpoint)
    adder.start()
    poll(lambda: len(adder.added) >= 20)
    _replace(model, add_model(2.0), how)
    with d.client(timeout=120) as c:
        summary = c.call(Op.RELOAD)
        assert "m: version 1 changed on disk, loaded again" in summary["changed"], summary
        n = len(adder.added)
        poll(lambda: len(adder.added) >= n + 20)
        assert c.call(Op.RELOAD)["changed"] == []  # reported once
    adder.halt.set()
    adder.join(60)
    assert adder.failures == []
    assert set(adder.added) == {1.0, 2.0} and adder.added[-1] == 2.0
    assert adder.added == sorted(adder.added)  # never the old file after the new one
    assert "model m version 1 unloaded: its files changed on disk" in d.log()


def test_a_truncated_version_file_is_reported_and_an_unloaded_one_too(
        short_tmp: Path, start_daemon: Any) -> None:
    repo = short_tmp / "repo"
    for name in ("m", "n"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(add_model(1.0))
    d = start_daemon("--models", str(repo), "--preload", "m")
    os.truncate(repo / "m" / "1" / "model.onnx", 0)
    (repo / "n" / "1" / "model.onnx").write_bytes(add_model(3.0))
    with d.client(timeout=120) as c:
        summary = c.call(Op.RELOAD)
        assert summary["failed"] == ["m"], summary
        assert "n: version 1 changed on disk" in summary["changed"], summary
        with pytest.raises(RequestError) as e:
            c.infer("m", {"x": np.zeros((1, 4), np.float32)})
        assert "failed to load" in e.value.message
        assert c.infer("n", {"x": np.zeros((1, 4), np.float32)})["y"][0, 0] == 3.0
        (repo / "m" / "1" / "model.onnx").write_bytes(add_model(2.0))  # fixed
        c.call(Op.RELOAD)
        poll(lambda: _served(c, "m") == 2.0)
    assert "model m version 1 changed on disk and failed to load again" in d.log()


def _served(c: Any, name: str) -> float | None:
    try:
        return float(c.infer(name, {"x": np.zeros((1, 4), np.float32)})["y"][0, 0])
    except RequestError:
        return None
