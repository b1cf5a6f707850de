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


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an ``ipc://`` endpoint, else None."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """``send_multipart(frames, flags, copy=False)`` without enum arithmetic.

    pyzmq still copies frames below its copy threshold, which is cheaper for them.
    """
    last = len(frames) - 1
    more = flags | SNDMORE
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags, copy=False)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """``recv_multipart(copy=False)`` reading ``Frame.more`` instead of asking the socket
    for RCVMORE (an enum-typed getsockopt) after every frame."""
    frame = sock.recv(0, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames
