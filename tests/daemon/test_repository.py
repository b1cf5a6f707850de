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
from pathlib import Path
from typing import Any

import pytest

from inferd.ipc import RequestError
from inferd.ipc.protocol import Op
from tests.e2e.test_cache_reload import add_version, rows



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
