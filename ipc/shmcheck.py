"""What the shared-memory registration service (:mod:`inferd.ipc.shm`) takes, decided
without its sockets or thread: the bounds on regions and registration connections
(:class:`RegionLimits`, derived from the open-files limit and ``vm.max_map_count``), a
message's parse (its size and nesting bounded before the JSON parser sees it), and a
passed descriptor's check (a memfd sealed against shrinking, its size read only after
the seal is known to be there).
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.ipc.errors import ErrorCode, ProtocolError

MAX_REGION_BYTES = 4 * 2**30
"""Largest region one registration may map."""
MAX_REGIONS_PER_CONNECTION = 64
"""Regions one registration connection may hold."""
MAX_REGIONS_PER_PROCESS = 256
"""Regions one client process may hold over all its registration connections."""
MAX_DEPTH = 4
"""Deepest nesting of objects and arrays in a message (the message itself is 1)."""
FD_MARGIN = 64
"""Registrations are refused this many descriptors below the server's descriptor brake
(:attr:`inferd.ipc.clients.Connections.fd_brake`), so regions never take the descriptors
that client connections need."""
MAP_SHARE = 4
"""Regions take at most 1/MAP_SHARE of ``vm.max_map_count`` (one mapping each): the
engines, the allocator and the libraries need the rest."""
MAX_MESSAGE = 4096
"""Bytes of one message (one datagram) either way."""
MAX_FDS = 4
"""Descriptors one message may pass (only ``register`` passes one)."""


def max_map_count() -> int:
    """The kernel's ``vm.max_map_count`` (its default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


@dataclass(frozen=True)
class RegionLimits:
    """The registration service's bounds (:meth:`derive` them from the process's).

    Attributes:
        regions: regions registered at once, daemon-wide.
        per_uid: regions of one user, all its processes together.
        per_process: regions of one process, all its connections together.
        per_connection: regions of one registration connection.
        connections: registration connections open at once.
        connections_per_uid: registration connections of one user.
        fd_refuse: open descriptors of the process at which registrations and new
            registration connections are refused.
        fd_limit: the open-files limit (named in the errors).
        map_count: ``vm.max_map_count`` (named in the errors).
    """

    regions: int
    per_uid: int
    per_process: int
    per_connection: int
    connections: int
    connections_per_uid: int
    fd_refuse: int
    fd_limit: int
    map_count: int

    @classmethod
    def derive(cls, fd_limit: int, fd_brake: int, client_connections: int,
               map_count: int | None = None) -> RegionLimits:
        """Each region holds a descriptor (the mapping's) and each registration
        connection one: together they stay within what ``client_connections`` ZeroMQ
        connections leave below ``fd_brake`` less :data:`FD_MARGIN`, an eighth of that
        room for connections (each may hold many regions); regions also stay under
        1/:data:`MAP_SHARE` of ``vm.max_map_count``. One user may take half of each.

        Args:
            fd_limit: the open-files limit (soft, as raised at start).
            fd_brake: the server's descriptor brake (``Connections.fd_brake``).
            client_connections: the ZeroMQ connections it serves at most
                (``Connections.max``).
            map_count: ``vm.max_map_count`` (read from /proc by default).
        """
        maps = max_map_count() if map_count is None else map_count
        fd_refuse = fd_brake - FD_MARGIN
        room = max(16, fd_refuse - client_connections)
        connections = max(2, room // 8)
        regions = max(1, min(room - connections, maps // MAP_SHARE))
        return cls(regions=regions, per_uid=max(1, regions // 2),
                   per_process=min(MAX_REGIONS_PER_PROCESS, regions),
                   per_connection=MAX_REGIONS_PER_CONNECTION, connections=connections,
                   connections_per_uid=max(1, connections // 2), fd_refuse=fd_refuse,
                   fd_limit=fd_limit, map_count=maps)


def sealed_size(fd: int) -> int:
    """The size of the region passed as ``fd``, once it is known to be a memfd sealed
    against shrinking: read before the seals, it could shrink in between (and the
    mapping would reach past its end)."""
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
    size = os.fstat(fd).st_size
    if not 0 < size <= MAX_REGION_BYTES:
        raise ProtocolError(f"a region is 1 to {MAX_REGION_BYTES} bytes; this one is "
                            f"{size}", ErrorCode.RESOURCE_EXHAUSTED)
    return size


def parse(data: bytes) -> dict[str, Any]:
    """One message's JSON object; its depth is bounded before it is parsed (a deep one
    would exhaust the parser's recursion)."""
    if _depth(data) > MAX_DEPTH:
        raise ProtocolError(f"a shared-memory message nests deeper than {MAX_DEPTH} "
                            f"levels")
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        raise ProtocolError("shared-memory message is not JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("shared-memory message must be a JSON object")
    return msg


def _depth(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest (outside strings), up to one past
    :data:`MAX_DEPTH`."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def passed_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors passed (SCM_RIGHTS) in ``recvmsg``'s ancillary data."""
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    return fds


def _kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "device" if (
        stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) else "pipe or socket"
