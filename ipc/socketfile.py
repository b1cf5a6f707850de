"""The ipc socket file: an exclusive claim on its path, its listening socket, its group.

:class:`SocketLock` holds ``<path>.lock`` so that a second daemon refuses to start
instead of libzmq silently taking over a live socket. :class:`Listener` makes the
listening socket itself (mode, group) and gives it to libzmq (``ZMQ_USE_FD``), so that
the server can pause libzmq's accepting when the connections reach their bound: libzmq
accepts every connection it can and aborts the process when ``accept`` meets the
open-files limit (EMFILE). Used by :meth:`inferd.ipc.server.Server.bind`.
The lock file is never written through a link planted beside the socket
(:mod:`inferd.ipc.runfiles`), and a directory every user may write into without a
sticky bit is refused.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import socket
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


class Listener:
    """The listening socket of an ipc endpoint, made here and adopted by libzmq.

    libzmq accepts on descriptor :attr:`fd`. :meth:`pause` points that descriptor at a
    listening socket nobody connects to (libzmq's next ``accept`` then finds nothing:
    EAGAIN), and connections wait on the real one, which the server empties with
    :meth:`refuse_waiting` (accept and close at once: one descriptor for a moment);
    :meth:`resume` points it back. Connections already open are not touched.

    Args:
        path: the socket file (its directory exists, the lock is held).
        mode: its file mode; group: its group ("" leaves the process's own).
        backlog: connections the kernel may hold before they are accepted.
    """

    def __init__(self, path: Path, mode: int, group: str = "", backlog: int = 1024) -> None:
        self.path = path
        self.paused = False
        real = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        real.setblocking(False)  # the description's flag: libzmq's accept never blocks
        old = os.umask(0o777 & ~mode)
        try:
            real.bind(str(path))
        except OSError as e:
            real.close()
            raise InferdError(f"cannot bind {path}: {e.strerror}", ErrorCode.UNAVAILABLE) from e
        finally:
            os.umask(old)
        try:
            os.chmod(path, mode)  # the directory is the daemon's alone (SocketLock)
            if group:
                _chgrp(path, group)
            real.listen(backlog)
            # A listener nobody knows: where libzmq's descriptor points while paused.
            self._idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._idle.setblocking(False)
            self._idle.bind(b"")  # an autobound abstract address
            self._idle.listen(1)
        except BaseException:
            real.close()
            raise
        self._waiting = real  # kept to empty it while paused, and to resume
        self.fd = os.dup(real.fileno())  # libzmq's; it closes it
        self._handed_over = False

    def adopted(self) -> None:
        """libzmq has the descriptor (its ``bind`` succeeded): it closes it from now."""
        self._handed_over = True

    @property
    def waiting_fd(self) -> int:
        """The real listening socket: readable while connections wait (poll it while
        paused)."""
        return self._waiting.fileno()

    def pause(self) -> None:
        """Stop libzmq from accepting."""
        if not self.paused:
            os.dup2(self._idle.fileno(), self.fd)
            self.paused = True

    def resume(self) -> None:
        """Let libzmq accept again."""
        if self.paused:
            os.dup2(self._waiting.fileno(), self.fd)
            self.paused = False

    def refuse_waiting(self) -> int:
        """Accept and close every connection waiting (while paused); how many."""
        n = 0
        while True:
            try:
                conn, _ = self._waiting.accept()
            except (BlockingIOError, InterruptedError):
                return n
            except OSError as e:  # EMFILE or worse: leave them waiting in the backlog
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ECONNABORTED):
                    log.warning("cannot refuse waiting connections on %s: %s", self.path,
                                e.strerror)
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        """Close the daemon's own sockets (after libzmq closed its descriptor)."""
        if not self._handed_over:
            os.close(self.fd)
        self._idle.close()
        self._waiting.close()
