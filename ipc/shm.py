"""Shared-memory tensors (docs/protocol.md, "Shared memory"): a client hands the daemon
a sealed memfd once, over a unix socket beside the ZeroMQ one (``SCM_RIGHTS``), and then
names region + offset for an input or for the outputs instead of sending the bytes.

Why a passed descriptor and not a name in ``/dev/shm`` or ``/proc/<pid>/fd``: the unit's
``PrivateTmp=``, ``PrivateDevices=`` and ``ProtectProc=`` hide both from the daemon, while
a descriptor passed over a socket is the capability itself and ``SO_PEERCRED`` names who
passed it. The daemon maps each region once, checks its sender against ``[access]``,
refuses a memfd that may shrink (``F_SEAL_SHRINK``: a shrunk region would crash the
reader with SIGBUS), bounds every offset, lets only the process that registered a region
name it, and forgets a process's regions when its registration socket closes (a mapping
lives on until the last request using it finishes).

- :class:`Regions`: the daemon's side, its own thread (``inferd-shm``) serving the
  registration socket, and the lookups the I/O thread makes while decoding.
- :class:`Region`: the client's side, a memfd mapped in the client, with
  :meth:`Region.ndarray` to place tensors in it.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.access import Access, Peer
from inferd.ipc.errors import ErrorCode, InferdError, ProtocolError
from inferd.ipc.protocol import SHM_ALIGN, Resolver

log = logging.getLogger(__name__)

ALIGN = SHM_ALIGN
"""Offsets the client's allocator hands out (as the daemon places outputs)."""
MAX_REGION_BYTES = 4 * 2**30
"""Largest region one registration may map."""
MAX_REGIONS_PER_CONNECTION = 64
_UCRED = struct.Struct("3i")
_MAX_MESSAGE = 4096


def shm_path(socket_path: Path) -> Path:
    """The registration socket beside the daemon's ipc socket file."""
    return socket_path.with_name(socket_path.name + ".shm")


@dataclass(eq=False)
class _Mapped:
    token: str
    mm: mmap.mmap
    size: int
    owner: Peer
    conn: socket.socket


class Regions:
    """The daemon's registered regions and their registration socket.

    Args:
        path: the registration socket's path (beside the ipc socket file).
        mode: its file mode (that of the ipc socket).
        access: the server's allow-list, read at each registration (reloads apply).
    """

    def __init__(self, path: Path, mode: int, access: Callable[[], Access]) -> None:
        self.path = path
        self._mode = mode
        self._access = access
        self._lock = threading.Lock()
        self._regions: dict[str, _Mapped] = {}
        self._by_conn: dict[socket.socket, list[str]] = {}
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
        self._listener = s
        self._thread = threading.Thread(target=self._serve, name="inferd-shm", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, close every connection and the socket, forget the regions
        (their mappings go when the last request using them lets go)."""
        if self._thread is not None:
            self._stop_w.send(b"x")
            self._thread.join(10)
            self._thread = None
        with self._lock:
            for conn in list(self._by_conn):
                conn.close()
            self._by_conn.clear()
            self._regions.clear()
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
            return memoryview(region.mm)
        return resolve

    def count(self) -> int:
        with self._lock:
            return len(self._regions)

    # ----------------------------------------------------------------- inferd-shm

    def _serve(self) -> None:
        assert self._listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        while True:
            for key, _ in sel.select():
                if key.data == "stop":
                    sel.close()
                    return
                if key.data == "accept":
                    try:
                        conn, _ = self._listener.accept()
                    except OSError:
                        continue
                    with self._lock:
                        self._by_conn[conn] = []
                    sel.register(conn, selectors.EVENT_READ, "conn")
                    continue
                client = key.fileobj
                assert isinstance(client, socket.socket)
                if not self._message(client):
                    sel.unregister(client)
                    self._forget(client)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            tokens = self._by_conn.pop(conn, [])
            for t in tokens:
                self._regions.pop(t, None)
        conn.close()
        if tokens:
            log.debug("a client's registration socket closed: %d regions dropped",
                      len(tokens))

    def _message(self, conn: socket.socket) -> bool:
        """Serve one message of ``conn``; False when it closed."""
        fds: list[int] = []
        try:
            data, ancdata, _, _ = conn.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(
                4 * struct.calcsize("i")))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
                    fds.extend(a)
        except OSError:
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            reply = self._handle(conn, data, fds)
        except InferdError as e:
            reply = {"error": {"code": str(e.code), "message": e.message}}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            conn.send(json.dumps(reply).encode())
        except OSError:
            return False
        return True

    def _handle(self, conn: socket.socket, data: bytes, fds: list[int]) -> dict[str, Any]:
        try:
            msg = json.loads(data)
        except ValueError:
            raise ProtocolError("shared-memory message is not JSON") from None
        if not isinstance(msg, dict):
            raise ProtocolError("shared-memory message must be a JSON object")
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET,
                                                      socket.SO_PEERCRED, _UCRED.size))
        peer = Peer.parse(f"localhost:{uid}:{gid}:{pid}")
        if peer is None or not self._access().allows(peer):
            raise InferdError(f"uid {uid} gid {gid} pid {pid} is not allowed by [access]",
                              ErrorCode.PERMISSION_DENIED)
        op = msg.get("op")
        if op == "unregister":
            token = msg.get("region")
            with self._lock:
                mine = self._by_conn.get(conn, [])
                if token not in mine:
                    raise ProtocolError(f"unknown shared-memory region {str(token)[:40]!r}")
                mine.remove(token)
                self._regions.pop(token, None)
            return {"ok": True}
        if op != "register":
            raise ProtocolError(f"shared-memory op must be 'register' or 'unregister', got "
                                f"{str(op)[:40]!r}", ErrorCode.UNSUPPORTED)
        if len(fds) != 1:
            raise ProtocolError(f"register passes exactly one file descriptor "
                                f"(SCM_RIGHTS); got {len(fds)}")
        fd = fds[0]
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError("the region must be a memfd (memfd_create), not a "
                                f"{_kind(st.st_mode)}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise ProtocolError("the region must be a memfd made with MFD_ALLOW_SEALING "
                                f"and sealed with F_SEAL_SHRINK ({e.strerror})") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ProtocolError("the region's memfd must be sealed with F_SEAL_SHRINK "
                                "(a region that shrinks would crash its reader)")
        if not 0 < st.st_size <= MAX_REGION_BYTES:
            raise ProtocolError(f"a region is 1 to {MAX_REGION_BYTES} bytes; this one is "
                                f"{st.st_size}", ErrorCode.RESOURCE_EXHAUSTED)
        with self._lock:
            if len(self._by_conn.get(conn, [])) >= MAX_REGIONS_PER_CONNECTION:
                raise ProtocolError(f"at most {MAX_REGIONS_PER_CONNECTION} regions per "
                                    f"connection", ErrorCode.RESOURCE_EXHAUSTED)
        try:
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise InferdError(f"cannot map the region: {os.strerror(e.errno or errno.EIO)}",
                              ErrorCode.RESOURCE_EXHAUSTED) from None
        token = "r" + secrets.token_hex(12)
        with self._lock:
            self._regions[token] = _Mapped(token, mm, st.st_size, peer, conn)
            self._by_conn.setdefault(conn, []).append(token)
        log.debug("region %s of %d bytes registered by %s", token, st.st_size,
                  peer.describe())
        return {"region": token, "size": st.st_size}


def _kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "device" if (
        stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) else "pipe or socket"


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
        if fds:
            socket.send_fds(self.sock, [payload], fds)
        else:
            self.sock.send(payload)
        reply = json.loads(self.sock.recv(_MAX_MESSAGE))
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
