"""Small ZeroMQ helpers shared by the server and the clients.

pyzmq's flag constants are ``enum.Flag`` members: every ``|`` or ``&`` on them runs
Python-level enum code (microseconds each, several per frame in ``send_multipart``).
On the request path flags are plain ints instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
COPY_THRESHOLD = 256 * 2**10
"""Frames smaller than this are copied when sent (``Socket.copy_threshold``; pyzmq's own
is 64 KiB). A zero-copy send costs pyzmq a tracked frame and a wake-up of its garbage
thread once libzmq is done with it: measured per 110 KB message (an ocr-cls batch-1
input) 83-93 us of CPU zero-copy vs 60-66 us copied, at 256 KiB 102-168 vs 85-88; from
about 512 KiB on, the copy costs more."""


def tuned(sock: zmq.Socket) -> zmq.Socket:
    """``sock`` with the request path's send settings (:data:`COPY_THRESHOLD`)."""
    sock.copy_threshold = COPY_THRESHOLD
    return sock


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an ``ipc://`` endpoint, else None."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


_SEND = zmq.backend.Socket.send
"""pyzmq's compiled send, without ``zmq.Socket.send``'s Python-level wrapper (which only
adds the DRAFT ``routing_id`` and ``group`` arguments): 0.4 instead of 1.0 us a frame."""


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """``send_multipart(frames, flags, copy=False)`` without enum arithmetic or pyzmq's
    Python-level wrappers (a blocking socket, not an asyncio one).

    pyzmq still copies frames below its copy threshold, which is cheaper for them.
    """
    send, more = _SEND, flags | SNDMORE
    for frame in frames[:-1]:
        send(sock, frame, more, False)
    send(sock, frames[-1], flags, False)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """``recv_multipart(copy=False)`` reading ``Frame.more`` instead of asking the socket
    for RCVMORE (an enum-typed getsockopt) after every frame."""
    frame = sock.recv(0, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames
