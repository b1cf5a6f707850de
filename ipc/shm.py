"""Shared-memory tensors (docs/protocol.md, "Shared memory"): a client hands the daemon
a sealed memfd once, over a unix socket beside the ZeroMQ one (``SCM_RIGHTS``), and then
names region + offset for an input or for the outputs instead of sending the bytes.

Why a passed descriptor and not a name in ``/dev/shm`` or ``/proc/<pid>/fd``: the unit's
``PrivateTmp=``, ``PrivateDevices=`` and ``ProtectProc=`` hide both from the daemon, while
a descriptor passed over a socket is the capability itself and ``SO_PEERCRED`` names who
passed it. The daemon maps each region once, checks its sender against ``[access]``,
refuses a memfd that may shrink (``F_SEAL_SHRINK``, checked before its size is read: a
shrunk region would crash the reader with SIGBUS), bounds every offset, lets only the
process that registered a region name it, and forgets a process's regions when its
registration socket closes (a mapping lives on until the last request using it
finishes).

The registration socket is open to every local client the socket's mode lets in, so
nothing one client sends may stop it for the others (issue 31):

- every message read is answered, whatever it holds or whatever fails while serving it
  (:mod:`inferd.ipc.shmcheck` bounds a message's size and nesting before parsing it);
- replies are sent without blocking; a connection that leaves more than
  :data:`MAX_UNREAD_REPLIES` unread is closed (and its regions forgotten);
- each region holds one descriptor of the daemon (the one passed, kept: its mapping is
  made with ``mmap(2)`` itself, since Python's :class:`mmap.mmap` keeps a duplicate of
  the descriptor it maps) and one mapping, both released with the last view of the
  region (:class:`Shared`); a worker process the region is handed to holds one
  descriptor and one mapping of its own, counted there (:mod:`inferd.daemon.workers.pool`):
  regions are bounded per connection, process, user and
  daemon-wide, from the open-files limit and ``vm.max_map_count``
  (:class:`~inferd.ipc.shmcheck.RegionLimits`), and refused outright once the process's
  descriptors near the server's descriptor brake, so that client connections always
  find theirs;
- a failure of the service's loop itself is logged with its traceback and the loop
  starts again over the same connections and regions (:meth:`Regions._run`).

- :class:`Regions`: the daemon's side, its own thread (``inferd-shm``) serving the
  registration socket, and the lookups the I/O thread makes while decoding.
- :class:`Region`: the client's side, a memfd mapped in the client, with
  :meth:`Region.ndarray` to place tensors in it; :class:`Registration`, its connection.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import json
import logging
import mmap
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.access import Access, Peer
from inferd.ipc.errors import ErrorCode, InferdError, ProtocolError, failure
from inferd.ipc.protocol import SHM_ALIGN, Resolver
from inferd.ipc.shmcheck import (MAX_FDS, MAX_MESSAGE, RegionLimits,
                                 parse, passed_fds, sealed_size)

log = logging.getLogger(__name__)

ALIGN = SHM_ALIGN
"""Offsets the client's allocator hands out (as the daemon places outputs)."""
MAX_UNREAD_REPLIES = 64
"""Replies kept for a connection beyond what its socket buffer takes; past it the
connection is closed (a client that never reads must not stop the service)."""
ACCEPT_RETRY_S = 1.0
"""How long accepting pauses after the kernel had no descriptor for a connection."""
MAX_REFUSED = 16
"""Connections refused (past a bound) kept open until their first message, which is
answered with the reason; past these, one is closed at once after sending it."""
_UCRED = struct.Struct("3i")
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * struct.calcsize("i"))
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


def shm_path(socket_path: Path) -> Path:
    """The registration socket beside the daemon's ipc socket file."""
    return socket_path.with_name(socket_path.name + ".shm")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_ids = itertools.count(1)


class Shared:
    """A registered region as the daemon holds it: its one descriptor (``fd``, the one
    the client passed) and one shared mapping of ``size`` bytes at ``addr``, both
    released when the last view of the mapping goes (a request still reading a region
    that was unregistered keeps it until its reply). What a worker process needs to map
    the region too: ``id`` names it on the worker's channel, ``fd`` is passed once.

    ``released`` is set when the region is forgotten (unregistered, or its client's
    registration connection closed); the listeners added with :meth:`listen` (the
    worker pool, which then has its workers unmap it) are told once."""

    __slots__ = ("id", "fd", "size", "addr", "released", "_listeners", "_lock",
                 "__weakref__")

    def __init__(self, fd: int, size: int, addr: int) -> None:
        self.id = next(_ids)
        self.fd = fd
        self.size = size
        self.addr = addr
        self.released = False
        self._listeners: list[Callable[[Shared], None]] = []
        self._lock = threading.Lock()

    def listen(self, listener: Callable[[Shared], None]) -> bool:
        """Tell ``listener`` when the region is released; False if it is already."""
        with self._lock:
            if self.released:
                return False
            self._listeners.append(listener)
            return True

    def release(self) -> None:
        """The region is forgotten: no new request may name it (its mapping and
        descriptor stay while views of it are alive)."""
        with self._lock:
            if self.released:
                return
            self.released = True
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            try:
                listener(self)
            except Exception:  # noqa: BLE001  a listener's failure is not the caller's
                log.exception("a listener of region %d's release failed", self.id)


def _unmap(addr: int, size: int, fd: int) -> None:
    _libc.munmap(addr, size)
    os.close(fd)


def map_region(fd: int, size: int) -> tuple[NDArray[np.uint8], Shared]:
    """Map ``size`` bytes of the memfd ``fd`` shared, read and write, keeping ``fd`` as
    the region's one descriptor (no duplicate, unlike :class:`mmap.mmap` on this
    Python): the bytes (every view of the region derives from them) and the
    :class:`Shared` record. The mapping and ``fd`` are released with the last view;
    ``fd`` is the mapping's from here on, also if this raises (it is closed then)."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno() or errno.EIO
        os.close(fd)
        raise OSError(err, os.strerror(err))
    raw = (ctypes.c_ubyte * size).from_address(addr)
    shared = Shared(fd, size, addr)
    raw.inferd_shared = shared  # type: ignore[attr-defined]  # found from any view
    weakref.finalize(raw, _unmap, addr, size, fd).atexit = False  # never under a reader
    return np.frombuffer(raw, np.uint8), shared  # type: ignore[call-overload]


def shared_of(array: Any) -> tuple[Shared, int] | None:
    """(the region, the byte offset) of ``array`` if it is a C-contiguous numpy array
    whose bytes lie in a region this daemon mapped (:func:`map_region`), found through
    its chain of bases; None otherwise (a copy, a frame, another buffer)."""
    if type(array) is not np.ndarray:
        return None
    node: Any = array
    for _ in range(32):  # on the hot path: a few type checks for a tensor in a frame
        if type(node) is np.ndarray:
            node = node.base
        elif type(node) is memoryview:
            node = node.obj
        else:
            break
    if not isinstance(node, ctypes.Array):
        return None
    shared = getattr(node, "inferd_shared", None)
    if type(shared) is not Shared or not array.flags.c_contiguous:
        return None
    offset = int(array.__array_interface__["data"][0]) - shared.addr
    if offset < 0 or offset + array.nbytes > shared.size:
        return None
    return shared, offset


@dataclass(eq=False)
class _Mapped:
    token: str
    data: NDArray[np.uint8]
    size: int
    owner: Peer
    shared: Shared


class _Conn:
    """One registration connection: its socket (non-blocking), its client (SO_PEERCRED,
    fixed when it connected), the regions registered on it and the replies its socket
    has not taken yet; or, for a connection refused, why (its first message's reply)."""

    def __init__(self, sock: socket.socket, peer: Peer,
                 refusal: InferdError | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.refusal = refusal
        self.tokens: list[str] = []
        self.unsent: deque[bytes] = deque()

    @property
    def closed(self) -> bool:
        return self.sock.fileno() == -1


class Regions:
    """The daemon's registered regions and their registration socket.

    The regions, their counts and the connections are this object's; the ``inferd-shm``
    thread changes them, the I/O thread reads the regions (:meth:`resolver`). A failure
    of the thread's loop is logged with its traceback and the loop starts again over the
    same state; a failure while serving one message is an error reply to its sender.

    Args:
        path: the registration socket's path (beside the ipc socket file).
        mode: its file mode (that of the ipc socket).
        access: the server's allow-list, read at each registration (reloads apply).
        limits: the bounds (:meth:`RegionLimits.derive`).
        open_fds: the process's open descriptors now (checked at each registration
            against ``limits.fd_refuse``).
    """

    def __init__(self, path: Path, mode: int, access: Callable[[], Access],
                 limits: RegionLimits, open_fds: Callable[[], int]) -> None:
        self.path = path
        self.limits = limits
        self.failures = 0
        """Times the thread's loop failed and started again."""
        self._mode = mode
        self._access = access
        self._open_fds = open_fds
        self._lock = threading.Lock()  # the regions and their counts (I/O thread reads)
        self._regions: dict[str, _Mapped] = {}
        self._per_process: Counter[tuple[int, int]] = Counter()
        self._per_uid: Counter[int] = Counter()
        # the inferd-shm thread's alone:
        self._conns: dict[int, _Conn] = {}  # by descriptor, refused ones too
        self._refused = 0  # of those, refused
        self._conns_per_uid: Counter[int] = Counter()
        self._sel: selectors.BaseSelector | None = None
        self._listening = True  # False while accepting pauses (no descriptor to spare)
        self._accept_failing = False  # the last accept failed (its warning is written)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop_r, self._stop_w = socket.socketpair()

    def bind(self, chgrp: Callable[[Path], None] | None = None) -> None:
        """Create the registration socket (the ipc socket's lock is held: a stale file
        of ours may be replaced) and start the ``inferd-shm`` thread."""
        if self.path.is_socket():
            self.path.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~self._mode)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, self._mode)
        if chgrp is not None:
            chgrp(self.path)
        s.listen(64)
        s.setblocking(False)
        self._listener = s
        lim = self.limits
        log.info("shared-memory regions: at most %d (%d per user, %d per process, %d per "
                 "connection) on %d registration connections (open-files limit %d, "
                 "vm.max_map_count %d)", lim.regions, lim.per_uid, lim.per_process,
                 lim.per_connection, lim.connections, lim.fd_limit, lim.map_count)
        self._thread = threading.Thread(target=self._run, name="inferd-shm", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, close every connection and the socket, forget the regions
        (their mappings go when the last request using them lets go)."""
        if self._thread is not None:
            self._stop_w.send(b"x")
            self._thread.join(10)
            self._thread = None
        with self._lock:
            released = [r.shared for r in self._regions.values()]
            self._regions.clear()
            self._per_process.clear()
            self._per_uid.clear()
        for shared in released:
            shared.release()
        for conn in self._conns.values():
            conn.sock.close()
        self._conns.clear()
        self._conns_per_uid.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self.path.unlink(missing_ok=True)
        self._stop_r.close()
        self._stop_w.close()

    # ----------------------------------------------------------------- I/O thread

    def resolver(self, peer: Peer | None) -> Resolver:
        """Lookups for a request of ``peer``: only regions that process registered."""
        def resolve(token: str) -> memoryview:
            with self._lock:
                region = self._regions.get(token) if isinstance(token, str) else None
            if region is None or peer is None or (region.owner.pid, region.owner.uid) != (
                    peer.pid, peer.uid):
                # one answer for "unknown" and "another's": no probing for tokens
                raise ProtocolError(f"unknown shared-memory region {str(token)[:40]!r} "
                                    f"(not registered by this client, or unregistered)")
            return memoryview(region.data)  # type: ignore[arg-type]
        return resolve

    def count(self) -> int:
        """Regions registered now."""
        with self._lock:
            return len(self._regions)

    # ----------------------------------------------------------------- inferd-shm

    def _run(self) -> None:
        """The thread: serve until stopped. A failure of the loop itself (not of one
        message: that is its sender's error reply) is logged with its traceback, and the
        loop starts again over the same connections and regions; one that keeps failing
        starts again after a pause that doubles up to a second."""
        pause = 0.0
        while True:
            started = time.monotonic()
            try:
                self._serve()
                return
            except Exception:  # noqa: BLE001  the one place the loop's failure is caught
                self.failures += 1
                log.exception("the shared-memory registration service failed; serving "
                              "again with its %d regions and %d connections",
                              self.count(), len(self._conns) - self._refused)
            quick = time.monotonic() - started < 1.0
            pause = min(1.0, max(0.01, 2 * pause)) if quick else 0.0
            if pause and select.select([self._stop_r], [], [], pause)[0]:
                return

    def _serve(self) -> None:
        assert self._listener is not None
        sel = selectors.DefaultSelector()
        self._sel = sel
        try:
            sel.register(self._stop_r, _READ)
            if self._listening:
                sel.register(self._listener, _READ)
            for conn in self._conns.values():
                sel.register(conn.sock, _READ | _WRITE if conn.unsent else _READ, conn)
            while True:
                ready = sel.select(None if self._listening else ACCEPT_RETRY_S)
                if not ready and not self._listening:
                    self._listen(True)
                for key, events in ready:
                    if key.fileobj is self._stop_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept()
                        continue
                    conn = key.data
                    if events & _WRITE and not conn.closed:
                        self._flush(conn)
                    if events & _READ and not conn.closed:
                        self._message(conn)
        finally:
            self._sel = None
            sel.close()

    def _listen(self, on: bool) -> None:
        if on == self._listening or self._listener is None:
            return
        self._listening = on
        if self._sel is not None:
            if on:
                self._sel.register(self._listener, _READ)
            else:
                self._sel.unregister(self._listener)

    def _accept(self) -> None:
        assert self._listener is not None and self._sel is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE, ENFILE, ENOBUFS: the kernel had nothing to spare
            self._listen(False)
            if not self._accept_failing:  # once until an accept succeeds again
                log.warning("cannot accept a shared-memory registration connection (%s): "
                            "accepting again in %g s or when one closes",
                            e.strerror, ACCEPT_RETRY_S)
            self._accept_failing = True
            return
        self._accept_failing = False
        sock.setblocking(False)
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET,
                                                      socket.SO_PEERCRED, _UCRED.size))
        peer = Peer.parse(f"localhost:{uid}:{gid}:{pid}")
        assert peer is not None  # three integers
        refusal = self._connection_refusal(peer)
        if refusal is not None and self._refused >= MAX_REFUSED:
            try:  # told at once; it reads this after its send fails
                sock.send(_error_reply(refusal))
            except OSError:
                pass
            sock.close()
            return
        conn = _Conn(sock, peer, refusal)
        self._conns[sock.fileno()] = conn
        if refusal is None:
            self._conns_per_uid[uid] += 1
        else:  # told why in the reply to its first message, then closed
            self._refused += 1
        self._sel.register(sock, _READ, conn)

    def _connection_refusal(self, peer: Peer) -> InferdError | None:
        lim = self.limits
        served = len(self._conns) - self._refused
        if served >= lim.connections:
            return _exhausted(f"{served} shared-memory registration connections "
                              f"are open, the most the daemon serves (from its open-files "
                              f"limit {lim.fd_limit}); one per client process is enough")
        if self._conns_per_uid[peer.uid] >= lim.connections_per_uid:
            return _exhausted(f"uid {peer.uid} has {self._conns_per_uid[peer.uid]} "
                              f"shared-memory registration connections open, the most one "
                              f"user may have; one per client process is enough")
        return self._descriptor_refusal()

    def _descriptor_refusal(self) -> InferdError | None:
        lim, fds = self.limits, self._open_fds()
        if fds < lim.fd_refuse:
            return None
        return _exhausted(f"the daemon has {fds} descriptors open, {lim.fd_limit - fds} "
                          f"below its open-files limit {lim.fd_limit}: no region is "
                          f"registered within {lim.fd_limit - lim.fd_refuse} of it (client "
                          f"connections need them); try again later")

    def _close(self, conn: _Conn, why: str = "") -> None:
        """Close ``conn`` and forget its regions."""
        if conn.closed:
            return
        fd = conn.sock.fileno()
        if self._sel is not None:
            self._sel.unregister(conn.sock)
        with self._lock:
            for token in conn.tokens:
                self._drop(token)
        if why:
            log.warning("closed the shared-memory registration connection of %s: %s; its "
                        "%d regions are forgotten", conn.peer.describe(), why,
                        len(conn.tokens))
        elif conn.tokens:
            log.debug("a client's registration socket closed: %d regions dropped",
                      len(conn.tokens))
        conn.tokens.clear()
        del self._conns[fd]
        if conn.refusal is None:
            _decrement(self._conns_per_uid, conn.peer.uid)
        else:
            self._refused -= 1
        conn.sock.close()
        self._listen(True)  # a descriptor came free

    def _message(self, conn: _Conn) -> None:
        """Serve one message of ``conn``: every message read is answered."""
        try:
            data, ancdata, flags, _ = conn.sock.recvmsg(MAX_MESSAGE, _ANCILLARY,
                                                        socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        fds = passed_fds(ancdata)
        try:
            if not data:  # the client closed (or sent an empty datagram: the same)
                self._close(conn)
                return
            if conn.refusal is not None:
                self._send(conn, _error_reply(conn.refusal))
                self._close(conn)
                return
            reply = self._answer(conn, data, flags, fds)
        finally:
            for fd in fds:
                os.close(fd)
        self._send(conn, reply)

    def _answer(self, conn: _Conn, data: bytes, flags: int, fds: list[int]) -> bytes:
        """The reply to one message: its result, or the error it met, whatever that is."""
        try:
            if flags & socket.MSG_TRUNC:
                raise ProtocolError(f"a shared-memory message is at most {MAX_MESSAGE} "
                                    f"bytes")
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"a shared-memory message passes at most {MAX_FDS} "
                                    f"file descriptors (SCM_RIGHTS)")
            return json.dumps(self._handle(conn, parse(data), fds)).encode()
        except Exception as e:  # noqa: BLE001  a message's failure is its sender's reply
            return _error_reply(e)

    def _send(self, conn: _Conn, reply: bytes) -> None:
        """Send without blocking; what the socket does not take waits for it, up to
        :data:`MAX_UNREAD_REPLIES` replies, past which the connection is closed."""
        if conn.closed:
            return
        if not conn.unsent:
            try:
                conn.sock.send(reply)
                return
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        conn.unsent.append(reply)
        if len(conn.unsent) > MAX_UNREAD_REPLIES:
            self._close(conn, f"it left more than {MAX_UNREAD_REPLIES} replies unread")
        elif len(conn.unsent) == 1 and self._sel is not None:
            self._sel.modify(conn.sock, _READ | _WRITE, conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.unsent:
            try:
                conn.sock.send(conn.unsent[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            conn.unsent.popleft()
        if self._sel is not None:
            self._sel.modify(conn.sock, _READ, conn)

    def _handle(self, conn: _Conn, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        peer = conn.peer
        if not self._access().allows(peer):
            raise InferdError(f"{peer.describe()} is not allowed by [access]",
                              ErrorCode.PERMISSION_DENIED)
        op = msg.get("op")
        if op == "unregister":
            token = msg.get("region")
            if not isinstance(token, str) or token not in conn.tokens:
                raise ProtocolError(f"unknown shared-memory region {str(token)[:40]!r}")
            with self._lock:
                conn.tokens.remove(token)
                self._drop(token)
            return {"ok": True}
        if op != "register":
            raise ProtocolError(f"shared-memory op must be 'register' or 'unregister', got "
                                f"{str(op)[:40]!r}", ErrorCode.UNSUPPORTED)
        if len(fds) != 1:
            raise ProtocolError(f"register passes exactly one file descriptor "
                                f"(SCM_RIGHTS); got {len(fds)}")
        size = sealed_size(fds[0])
        self._check_budget(conn)
        fd = fds.pop()  # the mapping's from here on: the caller closes the others
        try:
            data, shared = map_region(fd, size)
        except OSError as e:
            raise InferdError(f"cannot map the region: {os.strerror(e.errno or errno.EIO)}",
                              ErrorCode.RESOURCE_EXHAUSTED) from None
        token = "r" + secrets.token_hex(12)
        with self._lock:
            self._regions[token] = _Mapped(token, data, size, peer, shared)
            self._per_process[peer.pid, peer.uid] += 1
            self._per_uid[peer.uid] += 1
            conn.tokens.append(token)
        log.debug("region %s of %d bytes registered by %s", token, size, peer.describe())
        return {"region": token, "size": size}

    def _check_budget(self, conn: _Conn) -> None:
        """Raise the first bound one more region of ``conn`` would pass."""
        lim, peer = self.limits, conn.peer
        with self._lock:
            held = (len(conn.tokens), self._per_process[peer.pid, peer.uid],
                    self._per_uid[peer.uid], len(self._regions))
        if held[0] >= lim.per_connection:
            raise _exhausted(f"at most {lim.per_connection} regions per connection; "
                             f"unregister one first")
        if held[1] >= lim.per_process:
            raise _exhausted(f"at most {lim.per_process} regions per process (pid "
                             f"{peer.pid} holds {held[1]}); unregister one first")
        if held[2] >= lim.per_uid:
            raise _exhausted(f"at most {lim.per_uid} regions per user (uid {peer.uid} "
                             f"holds {held[2]}); unregister one first")
        if held[3] >= lim.regions:
            raise _exhausted(f"the daemon holds {held[3]} regions, its limit (from its "
                             f"open-files limit {lim.fd_limit} and vm.max_map_count "
                             f"{lim.map_count}); try again when others have unregistered")
        refusal = self._descriptor_refusal()
        if refusal is not None:
            raise refusal

    def _drop(self, token: str) -> None:
        """Forget region ``token`` (the lock is held)."""
        region = self._regions.pop(token, None)
        if region is not None:
            _decrement(self._per_process, (region.owner.pid, region.owner.uid))
            _decrement(self._per_uid, region.owner.uid)
            region.shared.release()  # the workers it was handed to unmap it


def _exhausted(message: str) -> InferdError:
    return InferdError(message, ErrorCode.RESOURCE_EXHAUSTED)


def _error_reply(e: BaseException) -> bytes:
    code, message = failure(e, "shared-memory registration", log)
    return json.dumps({"error": {"code": str(code), "message": message}}).encode()


def _decrement(counter: Counter[Any], key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


# --------------------------------------------------------------------------- client


class Region:
    """A shared-memory region of the client: a memfd sealed against shrinking and
    growing, mapped here; :meth:`ndarray` places arrays in it (64-byte aligned). Register
    it with :meth:`inferd.ipc.Client.register` before naming it in a request.

    Args:
        size: bytes.
        name: the memfd's name (shown in /proc/<pid>/fd).
    """

    def __init__(self, size: int, name: str = "inferd-region") -> None:
        if size <= 0:
            raise ValueError(f"a region needs a positive size, got {size}")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self.buffer = memoryview(self.mm)
        self.base = np.frombuffer(self.mm, np.uint8).ctypes.data
        self.token: str | None = None
        self._next = 0

    def ndarray(self, shape: tuple[int, ...] | list[int], dtype: Any = np.float32,
                offset: int | None = None) -> NDArray[Any]:
        """An array of ``shape`` and ``dtype`` inside the region, at ``offset`` or at the
        next free 64-byte boundary; inputs placed here travel by reference."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        start = self._next + -self._next % ALIGN if offset is None else offset
        if start < 0 or start + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at offset {start} do not fit a region of "
                             f"{self.size}")
        if offset is None:
            self._next = start + nbytes
        return np.frombuffer(self.mm, dt, int(np.prod(shape, dtype=np.int64)),
                             start).reshape(shape)

    def reset(self) -> None:
        """Let :meth:`ndarray` hand out the region from its start again."""
        self._next = 0

    def free(self) -> tuple[int, int]:
        """(offset, bytes) of what :meth:`ndarray` has not handed out."""
        start = self._next + -self._next % ALIGN
        return start, max(0, self.size - start)

    def locate(self, array: NDArray[Any]) -> int | None:
        """The offset of ``array``'s data in this region, if it is a contiguous array
        wholly inside it."""
        if not array.flags.c_contiguous or array.nbytes == 0:
            return None
        start = array.ctypes.data - self.base
        return start if 0 <= start and start + array.nbytes <= self.size else None

    def close(self) -> None:
        self.buffer.release()
        try:
            self.mm.close()
        except BufferError:  # arrays still use it: the mapping goes with the last one
            pass
        os.close(self.fd)


class Registration:
    """A client's connection to the daemon's registration socket (one per client):
    registered regions live until :meth:`close` (or the process ends)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(30)
        self.sock.connect(str(path))

    def _call(self, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        payload = json.dumps(msg).encode()
        try:
            if fds:
                socket.send_fds(self.sock, [payload], fds)
            else:
                self.sock.send(payload)
        except (BrokenPipeError, ConnectionResetError):
            # a connection the daemon refused: its one reply says why, if it is there
            self.sock.setblocking(False)
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                raise
        else:
            data = self.sock.recv(MAX_MESSAGE)
        if not data:
            raise ConnectionResetError("the daemon closed the registration connection")
        reply = json.loads(data)
        if "error" in reply:
            raise InferdError(reply["error"]["message"], ErrorCode(reply["error"]["code"]))
        return reply  # type: ignore[no-any-return]

    def register(self, region: Region) -> str:
        token: str = self._call({"op": "register"}, [region.fd])["region"]
        region.token = token
        return token

    def unregister(self, region: Region) -> None:
        if region.token is not None:
            self._call({"op": "unregister", "region": region.token})
            region.token = None

    def close(self) -> None:
        self.sock.close()
