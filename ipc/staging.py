"""The Python clients' automatic use of shared memory (docs/protocol.md, "Inline limit"):
a request whose frames would pass what the daemon takes inline has its largest numeric
inputs copied into a region of the client's own and named by reference, so that big
tensors never cross the socket, where libzmq would hold them whole before the daemon's
bounds see them.

The regions are sealed memfds (:class:`~inferd.ipc.shm.Region`) registered over a
registration connection of their own, so they never count against the regions an
application registers itself. A region is an arena: each request's moved inputs take one
block of it, lent for the request and freed with its reply, so that many requests in
flight share a few regions. A block whose request was given up on before its reply came
is never lent again (the daemon may still read it); its region goes once nothing else
in it is lent.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.dtypes import PACKED, STRING, dtype_name
from inferd.ipc.errors import ErrorCode, InferdError, RequestError
from inferd.ipc.shm import ALIGN, Region, Registration

INLINE_BYTES = 32 * 2**10
"""What the clients send inline at most, all frames of a request together: the least the
daemon's ``server.max_message_bytes = "auto"`` ever gives, so that no daemon refuses it."""
ARENA_BYTES = 16 * 2**20
"""The smallest region made (a bigger request's inputs get a power of two that holds
them). Its pages cost memory only once written."""
KEEP_IDLE = 2
"""Regions with nothing lent that are kept for later requests; more are handed back to
the daemon and freed."""


def frame_bytes(frames: list[Any]) -> int:
    """Bytes of a message's frames together."""
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


class _Arena:
    """A registered region and the blocks of it lent out (first fit, 64-byte aligned)."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.free: list[tuple[int, int]] = [(0, region.size)]  # (start, end), sorted
        self.lent = 0
        self.lost = False  # a block was given up on: never reused, the region retires

    def take(self, nbytes: int) -> int | None:
        for i, (start, end) in enumerate(self.free):
            at = start + -start % ALIGN
            if at + nbytes <= end:
                pieces = [p for p in ((start, at), (at + nbytes, end)) if p[0] < p[1]]
                self.free[i:i + 1] = pieces
                self.lent += 1
                return at
        return None

    def give(self, start: int, nbytes: int) -> None:
        self.lent -= 1
        self.free.append((start, start + nbytes))
        self.free.sort()
        merged = [self.free[0]]
        for s, e in self.free[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
            else:
                merged.append((s, e))
        self.free = merged


class Lease:
    """One request's moved inputs: a block of a region lent by :class:`Staging`.

    Attributes:
        inputs: the request's inputs, those moved replaced by their copies in the region.
    """

    def __init__(self, arena: _Arena, start: int, nbytes: int,
                 inputs: dict[str, NDArray[Any]]) -> None:
        self.arena = arena
        self.start = start
        self.nbytes = nbytes
        self.inputs = inputs

    def locate(self, array: NDArray[Any]) -> tuple[str, int] | None:
        """Where ``array`` lies if it is one of the copies (a ``Locator``)."""
        region = self.arena.region
        offset = region.locate(array)
        if offset is None or region.token is None:
            return None
        return region.token, offset


class Staging:
    """A client's regions for inputs too big to send inline; thread-safe.

    Args:
        path: the daemon's registration socket (``<socket>.shm``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._registration: Registration | None = None
        self._arenas: list[_Arena] = []
        self.made = 0  # regions made so far (tests, benchmarks)

    def stage(self, inputs: dict[str, NDArray[Any]], over: int,
              placed: Callable[[NDArray[Any]], object] | None = None) -> Lease | None:
        """Copy the largest numeric inputs, together at least ``over`` bytes when there
        are that many, into a block of a region; None when no input can move (strings,
        4-bit types and empty tensors stay in frames, as do inputs that ``placed`` finds
        in a region the application registered).

        Raises:
            RequestError: the daemon's registration socket refused or cannot be reached.
        """
        movable = []
        for name, value in inputs.items():
            array = np.asarray(value)
            if array.nbytes and dtype_name(array) not in (STRING, *PACKED) and (
                    placed is None or placed(array) is None):
                movable.append((array.nbytes, name, array))
        movable.sort(key=lambda m: -m[0])
        chosen, moved = [], 0
        for nbytes, name, array in movable:
            if moved >= over:
                break
            chosen.append((name, array))
            moved += nbytes
        if not chosen:
            return None
        need = sum(a.nbytes + ALIGN for _, a in chosen)
        try:
            arena, start = self._take(need)
        except _Unreachable:
            return None  # nothing serves the registration socket: frames, and whoever
            # answers says what it takes
        moved_inputs = dict(inputs)
        at = start
        for name, array in chosen:
            at += -at % ALIGN
            dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else \
                array.dtype
            copy = arena.region.ndarray(array.shape, dtype, offset=at)
            copy[...] = array
            moved_inputs[name] = copy
            at += array.nbytes
        return Lease(arena, start, need, moved_inputs)

    def give_back(self, lease: Lease, reusable: bool) -> None:
        """Take ``lease``'s block back: free for a later request when its reply came
        (``reusable``), else (the client stopped waiting: the daemon may still read it)
        never lent again."""
        arena = lease.arena
        with self._lock:
            if reusable:
                arena.give(lease.start, lease.nbytes)
            else:
                arena.lent -= 1
                arena.lost = True
            idle = [a for a in self._arenas if a.lent == 0]
            for a in idle:
                if a.lost or a.region.token is None or idle.index(a) >= KEEP_IDLE:
                    self._arenas.remove(a)
                    self._drop(a.region)

    def close(self) -> None:
        """Free every region; the daemon forgets them with the registration connection."""
        with self._lock:
            for arena in self._arenas:
                arena.region.close()
            self._arenas.clear()
            if self._registration is not None:
                self._registration.close()
                self._registration = None

    def _take(self, need: int) -> tuple[_Arena, int]:
        with self._lock:
            if self._registration is not None and not _alive(self._registration):
                # the daemon stopped (it closes every registration): its regions are gone
                for arena in self._arenas:
                    arena.lost = True
                    if arena.lent == 0:
                        arena.region.close()
                self._arenas = [a for a in self._arenas if a.lent]
                self._registration.close()
                self._registration = None
            for arena in self._arenas:
                if not arena.lost:
                    start = arena.take(need)
                    if start is not None:
                        return arena, start
            size = max(ARENA_BYTES, 1 << (need - 1).bit_length())
            region = Region(size, name="inferd-staging")
            if self._registration is None:
                try:
                    self._registration = _connect(self.path)
                except (FileNotFoundError, ConnectionRefusedError):
                    region.close()
                    raise _Unreachable from None
            try:
                self._registration.register(region)
            except InferdError as e:
                region.close()
                raise RequestError(f"cannot move the request's tensors into shared memory: "
                                   f"{e.message}", e.code) from None
            except OSError as e:
                region.close()
                raise RequestError(f"cannot move the request's tensors into shared memory: "
                                   f"the daemon's registration socket {self.path}: "
                                   f"{e.strerror or e}", ErrorCode.UNAVAILABLE) from None
            self.made += 1
            arena = _Arena(region)
            self._arenas.append(arena)
            start = arena.take(need)
            assert start is not None  # a new region holds it
            return arena, start

    def _drop(self, region: Region) -> None:
        if self._registration is not None and region.token is not None:
            try:
                self._registration.unregister(region)
            except (InferdError, OSError):
                pass  # the connection is gone: the daemon forgot it already
        region.close()

class _Unreachable(Exception):
    """Nothing listens on the registration socket."""


CONNECT_WAIT_S = 10.0
"""How long a connection to the registration socket is retried while its backlog is full
(many clients starting at once)."""


def _connect(path: Path) -> Registration:
    """A registration connection; a full backlog (EAGAIN) is retried, backing off, for up
    to :data:`CONNECT_WAIT_S`."""
    give_up = time.monotonic() + CONNECT_WAIT_S
    pause = 0.001
    while True:
        try:
            return Registration(path)
        except BlockingIOError:
            if time.monotonic() + pause > give_up:
                raise
            time.sleep(pause)
            pause = min(0.1, 2 * pause)


def _alive(registration: Registration) -> bool:
    """Whether the registration connection is still up: the daemon closes it when it
    stops (end of file, or a hang-up); a restarted daemon knows none of its regions."""
    poller = select.poll()
    poller.register(registration.sock, select.POLLIN)
    events = poller.poll(0)
    if not events:
        return True
    if events[0][1] & (select.POLLHUP | select.POLLERR):
        return False
    try:
        return bool(registration.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:
        return False
