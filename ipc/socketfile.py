"""The ipc socket file: an exclusive claim on its path, and its group.

:class:`SocketLock` holds ``<path>.lock`` so that a second daemon refuses to start
instead of libzmq silently taking over a live socket; :func:`_chgrp` gives the socket
file the configured ``server.socket_group``. Used by :meth:`inferd.ipc.server.Server.bind`.
The lock file is never written through a link planted beside the socket
(:mod:`inferd.ipc.runfiles`), and a directory every user may write into without a
sticky bit is refused.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
from pathlib import Path

from inferd.ipc.errors import ErrorCode, InferdError
from inferd.ipc.runfiles import check_directory, open_own_file

log = logging.getLogger("inferd.ipc.server")  # the server's logger, as before the split


class SocketLock:
    """Exclusive claim on an ipc socket path, held through a lock file beside it.

    libzmq silently takes over a path that a live daemon serves, so the daemon takes
    ``<path>.lock`` with flock first: held by another process means "refuse to start";
    free means any socket file left there is stale and is removed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (raises InferdError if another daemon holds it, or if the
        directory or the lock file is unsafe: :mod:`inferd.ipc.runfiles`)."""
        check_directory(self.lock_path)
        fd = open_own_file(self.lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InferdError(f"another inferd (pid {owner}) is serving {self.path}; "
                              f"refusing to start (lock {self.lock_path} is held)",
                              ErrorCode.UNAVAILABLE) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        if self.path.exists() or self.path.is_symlink():
            log.info("removing stale socket file %s left by a daemon that is gone", self.path)
            try:
                self.path.unlink()  # a link itself, never what it points to
            except OSError as e:
                os.close(fd)
                self._fd = None
                raise InferdError(f"cannot remove the stale socket file {self.path}: "
                                  f"{e.strerror}", ErrorCode.UNAVAILABLE) from e

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # libzmq leaves the socket file behind
        finally:
            os.close(self._fd)
            self._fd = None


def _chgrp(path: Path, group: str) -> None:
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        # Usually the file already has it (the daemon's own group): then no chown, which
        # the unit's SystemCallFilter=~@privileged would refuse.
        if os.lstat(path).st_gid != gid:
            os.chown(path, -1, gid, follow_symlinks=False)
    except (KeyError, OSError) as e:
        raise InferdError(f"cannot give {path} the group {group!r} (server.socket_group): "
                          f"{e}", ErrorCode.UNAVAILABLE) from e
