"""Files the daemon creates beside other users (issue 18, defect 3): a link another user
planted at the socket's lock file or at the metrics textfile's names is never written
through, and a directory every user may write into without a sticky bit is refused,
with one line saying why. As root, the user nobody plants the links (CI runs as root
with INFERD_TEST_ROOT=1); the daemon's side runs in this test process as root."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.daemon.config import load_config
from inferd.daemon.metrics import TextfileWriter
from inferd.daemon.runtime import Runtime
from inferd.ipc.runfiles import UnsafePath, replace_file
from inferd.ipc.socketfile import SocketLock

NOBODY = 65534
SECRET = "root only\n"


def _need_root() -> None:
    if os.getuid() != 0:
        if os.environ.get("INFERD_TEST_ROOT"):
            pytest.fail("the planted-link tests need root (nobody plants the links)")
        pytest.skip("needs root: the user nobody plants links for a root daemon")


def _as_nobody(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=30,
                   preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))


@pytest.fixture
def victim(short_tmp: Path) -> Path:
    """A file only root may read or write."""
    private = short_tmp / "private"
    private.mkdir(mode=0o700)
    path = private / "shadow"
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


def _untouched(victim: Path) -> None:
    assert victim.read_text() == SECRET
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def _shared_dir(short_tmp: Path, mode: int) -> Path:
    short_tmp.chmod(0o755)
    shared = short_tmp / "shared"
    shared.mkdir()
    shared.chmod(mode)
    return shared


def test_lock_link_in_a_directory_writable_by_all_is_refused(short_tmp: Path,
                                                             victim: Path) -> None:
    _need_root()
    shared = _shared_dir(short_tmp, 0o777)
    _as_nobody("ln", "-s", str(victim), str(shared / "inferd.sock.lock"))
    with pytest.raises(UnsafePath) as e:
        SocketLock(shared / "inferd.sock").acquire()
    assert "writable by every user (mode 0777) and not sticky" in e.value.message
    _untouched(victim)


@pytest.mark.parametrize("plant", ["symlink", "own file"])
def test_lock_planted_in_a_sticky_directory_is_not_used(short_tmp: Path, victim: Path,
                                                        plant: str) -> None:
    _need_root()
    shared = _shared_dir(short_tmp, 0o1777)  # like /tmp: others cannot remove our files
    lock = shared / "inferd.sock.lock"
    if plant == "symlink":
        _as_nobody("ln", "-s", str(victim), str(lock))
        why = "is a symbolic link (not followed)"
    else:
        _as_nobody("touch", str(lock))
        why = f"belongs to uid {NOBODY}, not to the daemon"
    with pytest.raises(UnsafePath) as e:
        SocketLock(shared / "inferd.sock").acquire()
    assert why in e.value.message
    _untouched(victim)


def test_lock_in_a_safe_directory_is_taken_and_taken_again(short_tmp: Path) -> None:
    lock = SocketLock(short_tmp / "inferd.sock")
    for _ in range(2):  # the second time over the lock file the first one left
        lock.acquire()
        assert lock.lock_path.read_text() == f"{os.getpid()}\n"
        assert stat.S_IMODE(lock.lock_path.stat().st_mode) == 0o644
        lock.release()


@pytest.fixture
def writer(short_tmp: Path) -> Iterator[TextfileWriter]:
    def make(path: Path) -> TextfileWriter:
        return TextfileWriter(rt.metrics, path, 60.0)

    rt = Runtime(load_config(None, {"server.socket": f"ipc://{short_tmp}/unused.sock",
                                    "models.repository": str(short_tmp / "no-models"),
                                    "metrics.textfile": ""}))
    yield make  # type: ignore[misc]
    rt.server.close()


def test_textfile_is_never_written_through_a_planted_link(short_tmp: Path, victim: Path,
                                                          writer) -> None:
    _need_root()
    shared = _shared_dir(short_tmp, 0o1777)
    path = shared / "metrics.prom"
    # The temporary name the writer used to take, and the textfile's own name.
    _as_nobody("ln", "-s", str(victim), str(shared / f".metrics.prom.{os.getpid()}.tmp"))
    other = victim.with_name("other")
    other.write_text(SECRET)
    other.chmod(0o600)
    _as_nobody("ln", "-s", str(other), str(path))
    writer(path).write()
    _untouched(victim)
    _untouched(other)
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert "# TYPE inferd_requests_total counter" in path.read_text()


def test_textfile_directory_writable_by_all_is_refused_once(short_tmp: Path, writer,
                                                             caplog) -> None:
    caplog.set_level(logging.INFO, "inferd.daemon.metrics")
    shared = _shared_dir(short_tmp, 0o777)
    w = writer(shared / "metrics.prom")
    w.write()
    w.write()
    assert not (shared / "metrics.prom").exists()
    lines = [r.getMessage() for r in caplog.records if "metrics.prom" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "writable by every user (mode 0777) and not sticky" in lines[0]
    shared.chmod(0o755)  # fixed: written again, and said so
    w.write()
    assert (shared / "metrics.prom").exists()
    assert any("written again" in r.getMessage() for r in caplog.records)


def test_replace_file_leaves_no_temporary_file_when_the_write_fails(short_tmp: Path) -> None:
    target = short_tmp / "a-directory"
    target.mkdir()  # rename over a directory fails
    with pytest.raises(OSError):
        replace_file(target, "x")
    assert sorted(p.name for p in short_tmp.iterdir()) == ["a-directory"]
