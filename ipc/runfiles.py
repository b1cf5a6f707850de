"""Files the daemon creates beside other users: never through a link someone planted.

The daemon may run as root, and the directories of its socket and of its metrics
textfile may be writable by others. Each file it creates there is created exclusively
(``O_EXCL | O_NOFOLLOW``, or ``mkstemp`` then ``fchmod`` and ``rename``), so a symbolic
or hard link planted at the name cannot redirect the write to another file; a directory
that every user may write into and that has no sticky bit (others could then remove and
replace the daemon's files) is refused outright. Each refusal is one line that says why.

Used by :class:`inferd.ipc.socketfile.SocketLock` (the socket's lock file) and the
metrics textfile writer (:class:`inferd.daemon.metrics.TextfileWriter`).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from inferd.ipc.errors import ErrorCode, InferdError


class UnsafePath(InferdError):
    """A file the daemon would write is in an unsafe place, or is not its own."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.UNAVAILABLE)


def check_directory(path: Path) -> None:
    """Refuse to create ``path`` if every user may write into its directory and the
    directory is not sticky.

    Raises:
        UnsafePath: it is such a directory, saying which.
    """
    folder = path.parent
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return  # no such directory (or not ours to see): the write fails and says so
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise UnsafePath(f"refusing to write {path}: its directory is writable by every "
                         f"user (mode {stat.S_IMODE(mode):04o}) and not sticky, so another "
                         f"user could plant a link there; make {folder} writable only by "
                         f"the daemon (or sticky: chmod +t)")


def open_own_file(path: Path, mode: int = 0o644) -> int:
    """A read-write descriptor of the regular file ``path``: created exclusively if it
    is not there, else opened without following a link and only if the daemon owns it
    and it has no other name (a hard link planted by someone else).

    Raises:
        UnsafePath: ``path`` is a link, not a regular file, or not the daemon's.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafePath(f"cannot create {path}: {e.strerror}") from e
    try:
        fd = os.open(path, flags)
    except OSError as e:  # ELOOP: a symbolic link
        why = ("it is a symbolic link (not followed); remove it" if os.path.islink(path)
               else e.strerror)
        raise UnsafePath(f"refusing to write {path}: {why}") from e
    st = os.fstat(fd)
    problem = (None if stat.S_ISREG(st.st_mode) else "it is not a regular file")
    if problem is None and st.st_uid != os.geteuid():
        problem = f"it belongs to uid {st.st_uid}, not to the daemon (uid {os.geteuid()})"
    if problem is None and st.st_nlink != 1:
        problem = f"it has {st.st_nlink} names (a hard link)"
    if problem is not None:
        os.close(fd)
        raise UnsafePath(f"refusing to write {path}: {problem}; remove it")
    return fd


def replace_file(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` atomically: to a new temporary file beside it (created
    exclusively by ``mkstemp``), ``fchmod`` to ``mode``, then rename it over ``path``
    (which replaces a link planted there instead of following it).

    Raises:
        OSError: the write failed (the temporary file is removed).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
