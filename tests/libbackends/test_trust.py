"""Strict modes for loaded code (libbackends/trust.py; issue 31, finding 11): the rule
itself, then each caller (custom-op discovery for a model's folder and the daemon's
folders, the plugin loader, the processors) refusing code that another user can write,
without running it.

Every refused file here, if it ran, would create its marker file: the marker's absence
is what proves the code did not run (in the daemon or in a probe child).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from inferd.daemon.processors import ProcessorRegistry
from inferd.ipc.errors import ErrorCode
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.discovery import load_folders, load_model_ops
from inferd.libbackends.loader import Loader
from inferd.libbackends.registry import CandidateStatus, Registry, Stage
from inferd.libbackends.trust import StrictModes, UntrustedCode, group_is_trusted
from tests.libbackends.customops import kit

STRICT, LAX = StrictModes(True), StrictModes(False)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user "
                               "(os.chown) needs root; CI runs the tests as root")
NOBODY = 65534  # Debian's nobody / nogroup: another user, a group with someone else in it


def marked(marker: Path, body: str) -> str:
    """Python source that creates ``marker`` when it is imported, then ``body``."""
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n{body}"


def model_with_op(repo: Path, marker: Path) -> Path:
    """``repo/m`` with ``customops/sigmoid.py`` (cstSigmoid, marks when imported)."""
    ops = repo / "m" / "customops"
    ops.mkdir(parents=True)
    (ops / "sigmoid.py").write_text(marked(marker, kit.PY_OPS))
    kit.save(kit.conv_sigmoid_add(), repo / "m" / "1" / "model.onnx")
    return repo / "m"


# --------------------------------------------------------------------- the rule


def test_files_and_folders_only_root_and_the_daemon_can_write_pass(tmp_path: Path) -> None:
    op = model_with_op(tmp_path / "repo", tmp_path / "ran") / "customops" / "sigmoid.py"
    STRICT.check(op, tmp_path / "repo")  # 0644 files, 0755 folders: a fresh clone's modes
    os.chmod(op.parent, 0o1777)  # sticky: others cannot rename or remove sigmoid.py
    STRICT.check(op, tmp_path / "repo")


@pytest.mark.parametrize("where, mode, what", [
    ("file", 0o666, "is writable by every user (mode 0666"),
    ("folder", 0o777, "is writable by every user (mode 0777"),
    ("model", 0o757, "is writable by every user (mode 0757"),
    ("root", 0o777, "is writable by every user (mode 0777"),
])
def test_a_file_or_folder_up_to_the_root_that_every_user_may_write_is_refused(
        tmp_path: Path, where: str, mode: int, what: str) -> None:
    repo = tmp_path / "repo"
    op = model_with_op(repo, tmp_path / "ran") / "customops" / "sigmoid.py"
    node = {"file": op, "folder": op.parent, "model": repo / "m", "root": repo}[where]
    os.chmod(node, mode)
    with pytest.raises(UntrustedCode) as e:
        STRICT.check(op, repo)
    assert e.value.code is ErrorCode.PERMISSION_DENIED
    assert e.value.message.startswith(f"refusing to load code from {op}: {node} {what}, "
                                      f"owner ")
    assert e.value.message.endswith(f"can write, up to {repo} ([security] strict_modes)")
    LAX.check(op, repo)


def test_folders_above_the_root_are_not_checked(tmp_path: Path) -> None:
    """A repository inside a folder that every user may write (the root is where trust
    is decided, like /tmp above a test's repository)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    op = model_with_op(shared / "repo", tmp_path / "ran") / "customops" / "sigmoid.py"
    STRICT.check(op, shared / "repo")
    with pytest.raises(UntrustedCode, match=f": {shared} is writable by every user"):
        STRICT.check(op, shared)


def test_a_link_is_checked_where_it_leads(tmp_path: Path) -> None:
    """A link inside a trusted folder to a file in a folder every user may write: the
    target's folders count (up to / when it lies outside the root)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o777)
    (elsewhere / "sigmoid.py").write_text(kit.PY_OPS)
    ops = tmp_path / "repo" / "m" / "customops"
    ops.mkdir(parents=True)
    os.symlink(elsewhere / "sigmoid.py", ops / "sigmoid.py")
    with pytest.raises(UntrustedCode, match=f": {elsewhere} is writable by every user"):
        STRICT.check(ops / "sigmoid.py", tmp_path / "repo")
    os.chmod(elsewhere, 0o755)
    STRICT.check(ops / "sigmoid.py", tmp_path / "repo")


@ROOT_ONLY
def test_group_write_counts_only_where_the_group_holds_someone_else(tmp_path: Path) -> None:
    op = model_with_op(tmp_path / "repo", tmp_path / "ran") / "customops" / "sigmoid.py"
    os.chmod(op, 0o664)
    STRICT.check(op, tmp_path / "repo")  # group root: no one but root in it
    assert group_is_trusted(0, {0})
    assert not group_is_trusted(NOBODY, {0})  # nogroup is nobody's primary group
    os.chown(op, -1, NOBODY)
    with pytest.raises(UntrustedCode, match=r"sigmoid.py is writable by group nogroup "
                                            r"\(gid 65534\) \(mode 0664, owner root"):
        STRICT.check(op, tmp_path / "repo")


@ROOT_ONLY
def test_a_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    op = model_with_op(tmp_path / "repo", tmp_path / "ran") / "customops" / "sigmoid.py"
    os.chown(op, NOBODY, -1)
    with pytest.raises(UntrustedCode, match=r"sigmoid.py is owned by another user "
                                            r"\(mode 0644, owner nobody \(uid 65534\)"):
        STRICT.check(op, tmp_path / "repo")


# --------------------------------------------------------------------- custom ops


def test_a_world_writable_model_op_is_refused_and_never_runs(tmp_path: Path) -> None:
    """The finding: customops/sigmoid.py 0666 in a 0777 folder inside the repository.
    Before: imported (and run on the next request)."""
    marker = tmp_path / "ran"
    model = model_with_op(tmp_path / "repo", marker)
    os.chmod(model / "customops", 0o777)
    os.chmod(model / "customops" / "sigmoid.py", 0o666)
    with pytest.raises(UntrustedCode) as e:
        load_model_ops(model, OpRegistry(), strict=STRICT)
    assert f"{model / 'customops'} is writable by every user (mode 0777" in e.value.message
    assert not marker.exists(), "the refused op file was imported"

    ops = load_model_ops(model, OpRegistry(), strict=LAX)  # strict_modes = false
    assert marker.read_text() == "ran"
    assert ops.names() == ["cstSigmoid (any domain)"]


def test_a_refused_op_in_a_daemon_folder_is_skipped_the_others_load(
        tmp_path: Path, caplog: Any) -> None:
    folder = tmp_path / "ops"
    folder.mkdir()
    (folder / "good.py").write_text(kit.PY_OPS)
    (folder / "open.py").write_text(marked(tmp_path / "ran", kit.PY_OPS.replace(
        "cstSigmoid", "cstOpen")))
    os.chmod(folder / "open.py", 0o646)
    registry = OpRegistry()
    with caplog.at_level(logging.WARNING):
        load_folders([folder], registry, strict=STRICT)
    assert registry.names() == ["cstSigmoid (any domain)"] and not (tmp_path / "ran").exists()
    assert [(s.path, s.stage) for s in registry.skipped] == [(str(folder / "open.py"),
                                                              "opened")]
    line = next(r.getMessage() for r in caplog.records if "open.py" in r.getMessage())
    assert line.startswith(f"custom op file {folder / 'open.py'} skipped at stage 'opened': "
                           f"refusing to load code from {folder / 'open.py'}: "
                           f"{folder / 'open.py'} is writable by every user (mode 0646, ")


# --------------------------------------------------------------------- plugins


@ROOT_ONLY
def test_a_native_plugin_owned_by_another_user_is_refused(tmp_path: Path,
                                                          elementwise_so: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    so = plugins / elementwise_so.name
    shutil.copy(elementwise_so, so)
    os.chown(so, NOBODY, -1)
    registry = Registry()
    Loader(registry, builtins=(), strict=STRICT).load([plugins])
    [c] = registry.candidates
    assert (c.status, c.stage) == (CandidateStatus.FAILED, Stage.OPENED)
    assert c.reason.startswith(f"refusing to load code from {so}: {so} is owned by another "
                               f"user (mode 0755, owner nobody (uid 65534), group ")
    assert not registry.records

    os.chown(so, 0, -1)  # root's: loads
    registry = Registry()
    Loader(registry, builtins=(), strict=STRICT).load([plugins])
    assert list(registry.records) == ["elementwise-c"], registry.candidates


def test_a_python_plugin_another_user_may_write_is_never_imported(tmp_path: Path) -> None:
    """Not in the daemon, and not in the probe child either (which would run it too)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    os.chmod(plugins, 0o777)
    (plugins / "planted.py").write_text(marked(tmp_path / "ran", ""))
    registry = Registry()
    Loader(registry, builtins=(), strict=STRICT).load([plugins])
    [c] = registry.candidates
    assert (c.status, c.stage) == (CandidateStatus.FAILED, Stage.OPENED)
    assert f"{plugins} is writable by every user (mode 0777" in c.reason
    assert not (tmp_path / "ran").exists()

    Loader(Registry(), builtins=(), strict=LAX).load([plugins])
    assert (tmp_path / "ran").exists()  # strict_modes = false: imported (then refused)


def test_a_plugin_package_with_one_open_file_is_refused(tmp_path: Path) -> None:
    pkg = tmp_path / "plugins" / "mine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .impl import *\n")
    (pkg / "impl.py").write_text(marked(tmp_path / "ran", ""))
    os.chmod(pkg / "impl.py", 0o666)
    registry = Registry()
    Loader(registry, builtins=(), strict=STRICT).load([tmp_path / "plugins"])
    [c] = registry.candidates
    assert f"{pkg / 'impl.py'} is writable by every user (mode 0666" in c.reason
    assert not (tmp_path / "ran").exists()


# --------------------------------------------------------------------- processors


def test_a_processor_file_every_user_may_write_is_skipped(tmp_path: Path,
                                                          caplog: Any) -> None:
    folder = tmp_path / "processors"
    folder.mkdir()
    table = "PROCESSORS = {'twice': lambda: (lambda v: {k: 2 * x for k, x in v.items()})}\n"
    (folder / "mine.py").write_text(marked(tmp_path / "ran", table))
    os.chmod(folder / "mine.py", 0o666)
    with caplog.at_level(logging.WARNING):
        assert ProcessorRegistry(STRICT).load_directory(folder) == []
    assert not (tmp_path / "ran").exists()
    assert f"processor file {folder / 'mine.py'} skipped at import: refusing to load code " \
           f"from {folder / 'mine.py'}: {folder / 'mine.py'} is writable by every user" \
           in caplog.text
    assert ProcessorRegistry(LAX).load_directory(folder) == ["twice"]
    assert (tmp_path / "ran").exists()
