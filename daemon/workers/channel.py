"""The control channel between the daemon and a worker process: one ``AF_UNIX``
``SOCK_SEQPACKET`` socket per caller, request then reply, tensors beside it in shared
memory.

A message is one datagram: a 4-byte length, a pickled header (the two ends are the same
code, started by the daemon: nothing a client sent is unpickled, the daemon decoded it
first; every pickle is made by one end's own code), then the bytes of the small
tensors; string tensors travel pickled in the header. A processor step's values
(:mod:`inferd.daemon.workers.steps`) travel as tensors too: their numeric arrays, and
one uint8 tensor that is a pickle of the rest made by the sender (the daemon, or the
processors worker). A tensor of :data:`INLINE_BYTES` or more is written into the sender's
*arena* instead, a memfd that each end of a channel owns for what it sends and that is
reused from call to call: it is passed to the peer (``SCM_RIGHTS``) once, and again only
when it has to grow. A call is strictly request -> reply on its channel, so a sender's
arena is free again once the answer to what it sent is in: the worker reads the inputs
in place. The daemon either copies the outputs out of the worker's arena, or takes them
as views of it (``lend``: a run's outputs go on to a reply frame that libzmq sends
without a copy); then the worker's arena is lent to those views, and the channel carries
no call until the last of them is gone (:meth:`Channel.lent`): the worker writes its
arena only to answer a call on its channel, so nothing overwrites bytes a reply frame
still points into.

A peer that died is an empty read (the kernel closes its end); :class:`Gone` says so.

**What the daemon takes from a worker.** A worker runs native code a client's input
reaches; one taken over by a hostile input writes what its attacker wants on its
channels. So the daemon's end (the default, ``trusted=False``; a worker's end reads the
daemon, which is trusted) reads a worker's header pickle under the allow-list of
:mod:`inferd.daemon.workers.pickles` (plain data, numpy arrays, TensorSpec and
BatchSizes: no global that runs code), takes no dtype that holds Python objects (an
object array made from a worker's bytes would be pointers it chose), no descriptor but
its arena, and that arena only as a memfd sealed against shrinking and as large as said
(a mapping past a file's end is SIGBUS in the daemon). A message that breaks any of this
raises :class:`Unreadable`, a :class:`Gone`: the daemon treats the channel as broken,
its worker as dead (the pool kills it and starts it again), and the call fails, never
the daemon.
"""

from __future__ import annotations

import array
import fcntl
import logging
import mmap
import os
import pickle
import socket
import struct
import weakref
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.daemon.workers import pickles
from inferd.ipc.dtypes import dtype_name, numpy_dtype

log = logging.getLogger(__name__)

INLINE_BYTES = 64 * 1024
"""Tensors smaller than this travel inside the datagram (up to :data:`INLINE_TOTAL`)."""
INLINE_TOTAL = 1024 * 1024
"""Inline bytes of one message at most; further tensors go through the arena."""
MAX_DATAGRAM = 4 * 1024 * 1024
"""Socket buffers are sized for this; inline bytes of one message stay far under it."""
ALIGN = 64
_LEN = struct.Struct("<I")
_TIMEVAL = struct.Struct("@ll")
_ANCILLARY = socket.CMSG_SPACE(16 * array.array("i").itemsize)
"""Room for the descriptors one message passes (a call passes a few at most)."""
_PAGE = mmap.PAGESIZE


class Gone(Exception):
    """The peer's end of the channel closed: it died or was ended."""


class Unreadable(Gone):
    """A worker sent a message the daemon refuses to read (a global not allowed, an
    object dtype, a descriptor or an arena it does not take, bytes that are no message):
    its channel is treated as broken, as if the worker had died."""


_Spec = tuple  # (name, dtype str, shape, inline, offset, nbytes): pickles 4x faster


class _Arena:
    """A memfd this end writes (``own``) or a peer's memfd it reads (``peer``)."""

    def __init__(self, fd: int, size: int, writable: bool) -> None:
        self.fd = fd
        self.size = size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot) if size else None
        self.address = 0
        """Where it is mapped in this process (0: not mapped)."""
        if self.map is not None:
            self.address = np.frombuffer(self.map, np.uint8, 1).__array_interface__[
                "data"][0]

    def offset_of(self, a: NDArray[Any]) -> int | None:
        """Where C-contiguous ``a`` lies in this arena, None if it does not."""
        at = a.__array_interface__["data"][0] - self.address
        if self.address and 0 <= at and at + a.nbytes <= self.size \
                and a.flags.c_contiguous:
            return int(at)
        return None

    @classmethod
    def make(cls, size: int) -> _Arena:
        size = max(_PAGE, -(-size // _PAGE) * _PAGE)
        fd = os.memfd_create("inferd-worker-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        # never shrunk (a peer's mapping past the end would be SIGBUS there): the daemon
        # takes a worker's arena only sealed so (an arena grows as a new memfd)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        return cls(fd, size, True)

    @classmethod
    def checked(cls, fd: int, size: Any, writable: bool) -> _Arena:
        """A worker's arena, if it is one the daemon can map without harm: a memfd
        sealed against shrinking, of at least ``size`` bytes."""
        if type(size) is not int or size <= 0:
            raise ValueError(f"an arena of size {size!r}")
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise ValueError("an arena not sealed against shrinking")
        if os.fstat(fd).st_size < size:
            raise ValueError(f"an arena of {os.fstat(fd).st_size} bytes said to be {size}")
        return cls(fd, size, writable)

    def view(self) -> memoryview:
        assert self.map is not None
        return memoryview(self.map)

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # arrays still view it: the mapping goes with the last of them
        os.close(self.fd)


_CODES: dict[np.dtype[Any], str] = {}
_DTYPES: dict[str, np.dtype[Any]] = {}
"""Both ways between a numeric dtype and its code, filled as dtypes are met (a few
dozen at most: strings, whose dtypes are many, are not numeric)."""


def dtype_code(a: NDArray[Any]) -> str:
    """numpy's code of ``a``'s (numeric) dtype; for ml_dtypes' types (bfloat16, int4,
    float8..., whose codes, ``|V1`` or ``<f1``, numpy cannot read back) ``wire:`` and their
    wire name."""
    code = _CODES.get(a.dtype)
    if code is None:
        if a.dtype.kind == "V" or type(a.dtype).__module__.startswith("ml_dtypes") \
                or a.dtype.type.__module__.startswith("ml_dtypes"):
            code = "wire:" + dtype_name(a)
        else:
            code = a.dtype.str
        if len(_CODES) < 256:
            _CODES[a.dtype] = code
    return code


def dtype_of(code: str) -> np.dtype[Any]:
    """The dtype of a peer's code (:func:`dtype_code`); never one that holds Python
    objects (``O``, or a record with such a field): numpy makes an array of those from
    a buffer's bytes as pointers, which a worker would choose."""
    dtype = _DTYPES.get(code)
    if dtype is None:
        dtype = numpy_dtype(code[5:]) if code.startswith("wire:") else np.dtype(code)
        if dtype.hasobject:
            raise ValueError(f"dtype {code!r} holds Python objects")
        if len(_DTYPES) < 256:  # codes come from the peer: the map stays small
            _DTYPES[code] = dtype
    return dtype


def _layout(tensors: dict[str, NDArray[Any]], placed: dict[str, int]
            ) -> tuple[list[_Spec], list[Any], list[tuple[_Spec, NDArray[Any]]], int]:
    """Where each tensor of a message goes: its specs, the inline buffers, the tensors to
    copy into the arena (with their specs) and the arena bytes used. ``placed``: tensors
    already in the arena, at these offsets (the copies go after the last of them)."""
    specs: list[_Spec] = []
    inline: list[Any] = []
    big: list[tuple[_Spec, NDArray[Any]]] = []
    inline_at = 0
    arena_at = max((-(-(at + tensors[name].nbytes) // ALIGN) * ALIGN
                    for name, at in placed.items()), default=0)
    for name, value in tensors.items():
        a = value if type(value) is np.ndarray else np.asarray(value)
        if a.dtype.hasobject or a.dtype.kind in "US":  # strings: pickled with the header
            specs.append((name, "pickle", a, True, 0, 0))
            continue
        nbytes = a.nbytes
        if name in placed:
            spec = (name, dtype_code(a), a.shape, False, placed[name], nbytes)
        elif nbytes < INLINE_BYTES and inline_at + nbytes <= INLINE_TOTAL:
            spec = (name, dtype_code(a), a.shape, True, inline_at, nbytes)
            # sent as it lies (a C-contiguous array is a buffer of its bytes)
            inline.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
            inline_at += nbytes
        else:
            spec = (name, dtype_code(a), a.shape, False, arena_at, nbytes)
            big.append((spec, a))
            arena_at += -(-nbytes // ALIGN) * ALIGN
        specs.append(spec)
    return specs, inline, big, arena_at


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, MAX_DATAGRAM)
        except OSError:
            pass  # the kernel's cap (wmem_max) stands; inline bytes stay far under it


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of channel sockets (close-on-exec both)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    _tune(a)
    _tune(b)
    return a, b


class Channel:
    """One end of a channel: :meth:`send` a header and tensors, :meth:`receive` them.

    Not thread-safe: one caller at a time (the daemon keeps a pool of them per worker).

    Args:
        sock: this end's socket.
        writable_peer: map the peer's arena writable (the daemon's end: outputs it takes
            as views, ``receive(lend=True)``, are writable as copies would be; a worker
            reads the daemon's arena read-only).
        trusted: the peer is the daemon (a worker's end): its messages are read as they
            come. Else (the daemon's end) a message is read under the module's "What
            the daemon takes from a worker".
    """

    def __init__(self, sock: socket.socket, writable_peer: bool = False,
                 trusted: bool = False) -> None:
        self.sock = sock
        self.trusted = trusted
        self._own: _Arena | None = None
        self._peer: _Arena | None = None
        self._writable_peer = writable_peer
        self._lease: weakref.ref[NDArray[np.uint8]] | None = None
        """The peer's arena as lent to the last message's tensors (all views of it)."""
        self._announce = False  # this end's arena is new: its fd goes with the next send
        # received into, then copied out by its length: recvmsg(4 MiB) allocates and
        # frees 4 MiB per call (21 us against 3.6 here)
        self._buf: bytearray | None = None
        sock.settimeout(None)
        self._timeout: float | None = None
        self.arena_bytes = 0
        """Bytes of tensors this end has copied into its arena (what did not travel
        inline or by reference to a shared-memory region)."""
        self.idle_since = 0.0
        """When the daemon's pool last had it free (monotonic; the pool's)."""

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, seconds: float | None) -> None:
        """How long :meth:`receive` waits at most (None: for ever). The kernel keeps it
        (``SO_RCVTIMEO``, set again only when it changes), so that the socket stays
        blocking: a socket with Python's own timeout polls before every send and
        receive, a syscall more each way on every call."""
        if seconds == self._timeout:
            return
        whole = 0 if seconds is None else max(seconds, 1e-3)
        usec = round(whole * 1e6)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                             _TIMEVAL.pack(usec // 1_000_000, usec % 1_000_000))
        self._timeout = seconds

    # ----------------------------------------------------------------- sending

    def _grow(self, size: int) -> _Arena:
        """This end's arena, made at least ``size`` bytes (a new memfd, passed to the peer
        with the next message, when it is smaller)."""
        if self._own is None or self._own.size < size:
            old = self._own
            self._own = _Arena.make(max(size, 2 * old.size if old else 0))
            if old is not None:
                old.close()
            self._announce = True
        return self._own

    def reserve(self, specs: list[tuple[str, np.dtype[Any], tuple[int, ...]]]
                ) -> dict[str, NDArray[Any]]:
        """Room for tensors of the next message in this end's arena: a writable array of
        each ``(name, dtype, shape)``, laid out as :meth:`send` lays them. Written by
        their maker (an engine writing its outputs there), they are sent in place, not
        copied. Valid until the next :meth:`send` or :meth:`reserve`."""
        places = []
        at = 0
        for name, dtype, shape in specs:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            places.append((name, dtype, shape, at))
            at += -(-nbytes // ALIGN) * ALIGN
        arena = self._grow(at)
        assert arena.map is not None
        return {name: np.ndarray(shape, dtype, arena.map, offset)
                for name, dtype, shape, offset in places}

    def send(self, header: dict[str, Any],
             tensors: dict[str, NDArray[Any]] | None = None, fds: list[int] | None = None
             ) -> None:
        """Send ``header`` with ``tensors`` (big ones through this end's arena: copied
        there, unless they lie there already, :meth:`reserve`)."""
        tensors = tensors or {}
        own = self._own
        placed: dict[str, int] = {}
        if own is not None and own.address:
            for name, value in tensors.items():
                if type(value) is np.ndarray and value.nbytes >= INLINE_BYTES:
                    at = own.offset_of(value)
                    if at is not None:
                        placed[name] = at
        specs, inline, big, arena_at = _layout(tensors, placed)
        if big and (own is None or own.size < arena_at):
            if placed:  # the arena is made anew: every tensor is copied into the new one
                specs, inline, big, arena_at = _layout(tensors, {})
            self._grow(arena_at)
        if big:
            assert self._own is not None
            view = self._own.view()
            for spec, a in big:
                dest = np.frombuffer(view, a.dtype, a.size, spec[4]).reshape(a.shape)
                np.copyto(dest, a, casting="no")
                self.arena_bytes += spec[5]
            del view
        send_fds = list(fds or ())
        arena_size = None
        if self._announce:
            assert self._own is not None
            send_fds.append(self._own.fd)
            arena_size = self._own.size
            self._announce = False
        body = pickle.dumps((header, specs, arena_size), protocol=pickle.HIGHEST_PROTOCOL)
        parts: list[Any] = [_LEN.pack(len(body)), body, *inline]
        if send_fds:
            self.sock.sendmsg(parts, [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       array.array("i", send_fds))])
        else:
            self.sock.sendmsg(parts)

    # ----------------------------------------------------------------- receiving

    def lent(self) -> bool:
        """Whether tensors of the last message received with ``lend`` still view the
        peer's arena (then the channel must carry no call: the peer's answer would be
        written over them)."""
        return self._lease is not None and self._lease() is not None

    def receive(self, copy: bool = False, lend: bool = False
                ) -> tuple[dict[str, Any], dict[str, NDArray[Any]], list[int]]:
        """The next message: its header, its tensors (views of the datagram or of the
        peer's arena; ``copy`` makes them the receiver's own) and any descriptors passed
        with it (other than an arena's).

        ``lend``: the inline tensors are the receiver's own (one writable copy of them
        all) and those in the peer's arena are views of it, lent to them until the last
        of them (and of any view of them) is gone; :meth:`lent` says when.

        Raises:
            Gone: the peer closed its end.
            Unreadable: (the daemon's end) a worker's message the daemon refuses to
                read; the channel is shut down.
            TimeoutError: nothing came within the socket's timeout.
        """
        assert not self.lent(), "a call on a channel whose peer's arena is still lent"
        self._lease = None
        if self._buf is None:
            self._buf = bytearray(MAX_DATAGRAM)
        try:
            n, ancdata, _flags, _addr = self.sock.recvmsg_into([self._buf], _ANCILLARY)
        except ConnectionResetError as e:
            raise Gone(str(e)) from e
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError(f"no message within {self._timeout:g} s") from None
        if not n:
            raise Gone("the peer closed the channel")
        passed: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                passed.extend(fds)
        if self.trusted:
            return self._decode(n, passed, copy, lend)
        try:
            return self._decode(n, passed, copy, lend)
        except Exception as e:  # noqa: BLE001  whatever a worker's bytes make of the read
            for fd in passed:  # those not taken as its arena: the daemon takes none
                os.close(fd)
            why = str(e) if isinstance(e, pickles.Refused) else \
                f"{type(e).__name__}: {e}"
            log.error("a worker sent a message the daemon refuses to read: %s; its "
                      "channel is treated as broken (the worker is killed)", why)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise Unreadable(f"a message the daemon refuses to read: {why}") from None

    def _decode(self, n: int, passed: list[int], copy: bool, lend: bool
                ) -> tuple[dict[str, Any], dict[str, NDArray[Any]], list[int]]:
        """The message of ``n`` bytes in the receive buffer, with the descriptors
        ``passed`` (the arena's taken from them)."""
        assert self._buf is not None
        mem = memoryview(self._buf)
        (length,) = _LEN.unpack_from(mem)
        base = _LEN.size + length
        if n < base:
            raise ValueError(f"a header of {length} bytes in a message of {n}")
        if self.trusted:
            header, specs, arena_size = pickle.loads(mem[_LEN.size:base])
        else:
            header, specs, arena_size = pickles.loads(mem[_LEN.size:base])
            if type(header) is not dict or type(specs) is not list:
                raise ValueError("a message that is no (header, specs, arena) of a worker")
            if len(passed) != (arena_size is not None):
                raise ValueError(f"{len(passed)} descriptors passed with a message "
                                 f"{'with' if arena_size is not None else 'without'} an "
                                 f"arena")
        if arena_size is not None:
            fd = passed.pop()
            if self._peer is not None:
                self._peer.close()
                self._peer = None
            try:
                self._peer = (_Arena(fd, arena_size, self._writable_peer) if self.trusted
                              else _Arena.checked(fd, arena_size, self._writable_peer))
            except BaseException:
                os.close(fd)
                raise
        # the datagram's buffer is the next message's: inline tensors are copied out of
        # it (one copy of them all unless ``copy`` makes each its own)
        if copy or base == n:
            data: Any = mem
        else:
            data = (bytearray if lend else bytes)(mem[base:n])
        at = base if data is mem else 0
        lease: NDArray[np.uint8] | None = None
        tensors: dict[str, NDArray[Any]] = {}
        for name, code, shape, inline, offset, nbytes in specs:
            if code == "pickle":
                if not self.trusted and not (type(shape) is np.ndarray
                                             and shape.dtype.kind in "OUS"):
                    raise ValueError(f"tensor {name!r}: a {type(shape).__name__} where "
                                     f"an array of strings goes")
                tensors[name] = shape  # the array itself
                continue
            if inline:
                a = np.ndarray(shape, dtype_of(code), data, at + offset)
            else:
                assert self._peer is not None and self._peer.map is not None
                if lend:
                    if lease is None:
                        # every tensor is a view of this one array (numpy makes a view
                        # of a view the base's view): it lives while any of them does
                        lease = np.frombuffer(self._peer.map, np.uint8)
                    dtype = dtype_of(code)
                    tensors[name] = lease[offset:offset + nbytes].view(dtype).reshape(shape)
                    continue
                a = np.ndarray(shape, dtype_of(code), self._peer.map, offset)
            tensors[name] = a.copy() if copy else a
        if lease is not None:
            self._lease = weakref.ref(lease)
        return header, tensors, passed

    def close(self) -> None:
        self.sock.close()
        for arena in (self._own, self._peer):
            if arena is not None:
                arena.close()
        self._own = self._peer = None
