"""The zygote: a small process forked from the daemon before it starts any thread (after
the backends are registered, before the socket is bound), that forks every worker.

Why: a worker forked from the threaded daemon would inherit locks held by threads that
do not exist in it (the allocator's, the logging module's, libzmq's); a fresh interpreter
per worker pays the imports again (numpy, inferd, ~0.3-1 s). The zygote is a copy of the
daemon at a moment when it has one thread: forking it is cheap, and a worker starts with
numpy, inferd and the registered backends already in memory, shared copy-on-write.

The daemon talks to it over one ``SOCK_SEQPACKET`` pair (:class:`Zygote`): ``spawn``
passes the worker's end of a fresh channel and gets the worker's pid back; when a
worker ends, the zygote (its parent) reaps it and sends ``exit`` with the wait status.
The zygote dies with the daemon (``PR_SET_PDEATHSIG``), and every worker with the zygote.
"""

from __future__ import annotations

import array
import ctypes
import gc
import logging
import os
import pickle
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from inferd.daemon.workers import pickles
from inferd.ipc.libc import own_signal_stack

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_MAX = 64 * 1024


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the channel's EOF ends a worker anyway


def describe_status(status: int) -> str:
    """``"died of SIGABRT"``, ``"exited with status 3"`` from a wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"died of {name}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"ended (wait status {status})"


class Zygote:
    """The daemon's handle on the zygote process.

    Args:
        worker_main: what a worker runs, ``worker_main(channel_socket, name)``; called in
            the forked worker, which exits when it returns.
        on_exit: called (on the daemon's supervising thread) with ``(pid, status)`` for
            every worker that ended.
    """

    def __init__(self, worker_main: Callable[[socket.socket, str], int],
                 on_exit: Callable[[int, int], None]) -> None:
        if threading.active_count() != 1:
            log.warning("the worker zygote is forked while %d threads run: %s",
                        threading.active_count(),
                        ", ".join(t.name for t in threading.enumerate()))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._closing = False
        """:meth:`close` was called: the end that follows is ours, and the pid is reaped."""
        self.ended = ""
        """How the zygote ended when it did before :meth:`close` (``died of SIGKILL``)."""
        sys.stdout.flush()
        sys.stderr.flush()
        # Every object the daemon has now is frozen in the zygote and its workers: their
        # garbage collector never visits it. Collecting it there would run destructors of
        # this process's objects in a copy that lacks its threads: an engine's object
        # left in a cycle (an OpenVINO model's: the collection hangs in a worker, tests/
        # daemon/test_workers.py) tears down thread pools that do not exist there; and
        # a visit alone writes to every page, undoing copy-on-write.
        gc.freeze()
        try:
            pid = os.fork()
        except BaseException:
            gc.unfreeze()
            raise
        if pid != 0:
            gc.unfreeze()  # here, collected as before
        if pid == 0:  # the zygote
            code = 1
            try:
                ours.close()
                code = _serve(theirs, worker_main)
            except BaseException:  # noqa: BLE001  its last word (the journal), then exit
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self.sock = ours
        self._thread = threading.Thread(target=self._read, name="inferd-zygote",
                                        daemon=True)

    def start(self) -> None:
        """Start reading the zygote's messages (call once the daemon may start threads)."""
        self._thread.start()

    def spawn(self, channel: socket.socket, name: str, timeout: float = 30.0) -> int:
        """Fork a worker serving ``channel`` (its end is passed, then closed here);
        returns its pid.

        Raises:
            OSError: the zygote is gone or did not answer in time.
        """
        with self._cond:
            if self._closed:
                raise OSError(f"the worker zygote has ended{self._how()}")
            self.sock.sendmsg([pickle.dumps({"op": "spawn", "name": name})],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                array.array("i", [channel.fileno()]))])
            channel.close()
            if not self._cond.wait_for(lambda: bool(self._replies) or self._closed,
                                       timeout):
                raise OSError(f"the worker zygote did not answer within {timeout:.0f} s")
            if not self._replies:
                raise OSError(f"the worker zygote has ended{self._how()}")
            reply = self._replies.pop(0)
        if "error" in reply:
            raise OSError(f"the worker zygote could not fork: {reply['error']}")
        return int(reply["pid"])

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX)
            except OSError:
                data = b""
            if not data:
                break
            try:  # what the daemon reads from another process: the allow-list's
                msg = pickles.loads(data)
                if not isinstance(msg, dict):
                    raise TypeError(f"a {type(msg).__name__}, not a dict")
            except Exception as e:  # noqa: BLE001  a zygote that says this is no use
                log.error("the worker zygote sent a message the daemon refuses to read "
                          "(%s); no worker can start from now on", e)
                self.ended = "sent a message the daemon refuses to read"
                break
            if msg.get("op") == "exit":
                self._on_exit(msg["pid"], msg["status"])
            else:
                with self._cond:
                    self._replies.append(msg)
                    self._cond.notify_all()
        with self._cond:
            closing = self._closing
        if not closing and not self.ended:  # how it ended, said once (not started again)
            self.ended = self._status()
            log.error("the worker zygote (pid %d) %s; no worker process can start until "
                      "inferd is restarted", self.pid, self.ended or "stopped answering",
                      extra={"ZYGOTE_PID": self.pid})
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _how(self) -> str:
        return f" ({self.ended})" if self.ended else ""

    def _status(self) -> str:
        """How the zygote ended, without reaping it (:meth:`close` does); "" if it has
        not within 2 s (its socket broke, but it runs)."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            return ""
        try:
            select.select([pidfd], [], [], 2.0)  # readable once it has ended
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return ""
        finally:
            os.close(pidfd)
        if info is None:
            return ""
        # waitid's (code, status) as the wait status describe_status reads
        exited = info.si_code == os.CLD_EXITED
        return describe_status(info.si_status << 8 if exited else info.si_status)

    def close(self) -> None:
        """End the zygote (its workers get SIGKILL from the kernel as it goes); again
        does nothing: once reaped, its pid may be another process's."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            os.kill(self.pid, signal.SIGKILL)  # a child not yet waited for: still ours
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        if self._thread.is_alive():
            self._thread.join(5)
        self.sock.close()


def _serve(sock: socket.socket, worker_main: Callable[[socket.socket, str], int]) -> int:
    """The zygote's loop: fork workers on ``spawn``, report each one's end."""
    # A stack for its signal handlers (SIGCHLD) of its own, and its workers': the one of
    # the thread that forked it may be gone (an engine's, unmapped since: ipc/libc.py),
    # and the first worker's end would kill it with SIGSEGV.
    own_signal_stack()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # SIGCHLD wakes the loop through a pipe (the handler only writes a byte)
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # The zygote inherits the mask of the thread that forked it: a SIGCHLD blocked there
    # (by the daemon's parent, or a library on that thread) would never wake this loop,
    # and no worker's end would be reported. Its workers inherit this empty one.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(rfd, select.POLLIN)
    while True:
        for fd, _ev in poller.poll():
            if fd == rfd:
                try:
                    os.read(rfd, 512)
                except BlockingIOError:
                    pass
                if not _reap(sock):
                    return 1  # _reap said why
                continue
            fds = array.array("i")
            try:
                data, anc, _f, _a = sock.recvmsg(_MAX, socket.CMSG_SPACE(4 * fds.itemsize))
            except OSError as e:
                print(f"inferd worker zygote: cannot read the daemon's socket: {e}",
                      file=sys.stderr, flush=True)
                return 1
            if not data:
                return 0  # the daemon is gone
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            msg = pickle.loads(data)
            if msg.get("op") != "spawn" or not fds:
                continue
            gc.freeze()  # the zygote's own objects too (see Zygote.__init__)
            try:
                pid = os.fork()
            except OSError as e:
                for fd_ in fds:
                    os.close(fd_)
                sock.send(pickle.dumps({"error": str(e)}))
                continue
            if pid == 0:  # the worker
                code = 70
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(rfd)
                    os.close(wfd)
                    sock.close()
                    die_with_parent()
                    channel = socket.socket(fileno=fds[0])
                    code = worker_main(channel, msg["name"])
                except BaseException:  # noqa: BLE001  the worker's last word, then exit
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)
            for fd_ in fds:
                os.close(fd_)
            sock.send(pickle.dumps({"pid": pid}))


def _reap(sock: socket.socket) -> bool:
    """Report every ended worker; False when the daemon's end is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        try:
            sock.send(pickle.dumps({"op": "exit", "pid": pid, "status": status}))
        except OSError as e:
            print(f"inferd worker zygote: cannot report worker {pid}'s end: {e}",
                  file=sys.stderr, flush=True)
            return False
