"""Who a client is and whether it may be served: the ``[access]`` allow-list.

:class:`Peer` holds a connection's credentials (SO_PEERCRED through libzmq's
``Peer-Address`` metadata), :class:`Access` the allow-list, and :class:`Peers` the I/O
thread's per-connection cache of both: the credentials looked up once per connection,
and a refused connection logged once. The server (:mod:`inferd.ipc.server`) asks it for
every request before decoding it.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zmq

from inferd.ipc.errors import ErrorCode

# The server's logger: operators turn on "new client" lines with
# [logging] modules = { "inferd.ipc.server" = "debug" } (docs/troubleshooting.md).
log = logging.getLogger("inferd.ipc.server")

PEER_CACHE_SIZE = 4096


@dataclass(frozen=True)
class Peer:
    """A client's credentials as the kernel saw them when it connected (SO_PEERCRED,
    read from libzmq's ``Peer-Address`` metadata: ``localhost:<uid>:<gid>:<pid>``)."""

    uid: int
    gid: int
    pid: int
    groups: frozenset[int]

    @classmethod
    def parse(cls, address: str | None) -> Peer | None:
        parts = (address or "").split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            return None
        uid, gid, pid = (int(p) for p in parts[1:])
        return cls(uid, gid, pid, frozenset(_groups_of(uid, gid)))

    def describe(self) -> str:
        return f"uid {self.uid} gid {self.gid} pid {self.pid}"


def _groups_of(uid: int, gid: int) -> list[int]:
    # The socket carries only the primary gid; supplementary groups come from the user
    # database (the daemon cannot read other users' /proc entries under ProtectProc).
    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except (KeyError, OSError):
        return [gid]


@dataclass(frozen=True)
class Access:
    """The ``[access]`` allow-list: empty lists allow every client that can open the
    socket; otherwise a client is served if its uid is in ``uids`` or one of its groups
    is in ``gids``."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, uids: Iterable[int] = (), gids: Iterable[int] = ()) -> Access:
        return cls(frozenset(uids), frozenset(gids))

    def allows(self, peer: Peer | None) -> bool:
        if not self.uids and not self.gids:
            return True
        if peer is None:  # no credentials (tcp://): an allow-list cannot be met
            return False
        return peer.uid in self.uids or bool(peer.groups & self.gids)


class Peers:
    """The I/O thread's per-connection view (``key``: the routing id): each
    connection's credentials, read once, and the connections refused already (both
    bounded by PEER_CACHE_SIZE); and which file descriptor each connection's messages
    came on, so that :meth:`gone` can name the clients of a closed one. Used on the I/O
    thread only."""

    def __init__(self) -> None:
        self._peers: OrderedDict[bytes, Peer | None] = OrderedDict()
        self._refused: set[bytes] = set()
        self._fd_keys: dict[int, set[bytes]] = {}  # open connection fd -> keys on it

    def lookup(self, key: bytes, frame: Any) -> Peer | None:
        """The credentials of the connection a message came on (``key``: its routing
        id), read from a body ``frame``; logged once per connection."""
        if key in self._peers:
            self._peers.move_to_end(key)
            return self._peers[key]
        try:
            # A body frame: libzmq 4.3.4 (Debian 12) leaves the metadata off the routing
            # id frame when the socket was polled before the read.
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            address = None
        try:
            self._fd_keys.setdefault(int(frame.get(zmq.SRCFD)), set()).add(key)
        except (zmq.ZMQError, TypeError, ValueError):
            pass  # no descriptor: its disconnection goes unnoticed (requests still run)
        peer = Peer.parse(address)
        if peer is not None:
            log.debug("new client: %s", peer.describe())
        else:
            log.debug("new client without credentials (%s)", address)
        self._peers[key] = peer
        if len(self._peers) > PEER_CACHE_SIZE:
            self._peers.popitem(last=False)
        return peer

    def gone(self, fd: int) -> set[bytes]:
        """The connection on ``fd`` has closed: forget its clients and return their
        keys."""
        keys = self._fd_keys.pop(fd, set())
        for key in keys:
            self._peers.pop(key, None)
            self._refused.discard(key)
        return keys

    def refuse(self, peer: Peer | None, key: bytes, rid: str | None) -> str:
        """Log a refused request (WARNING once per connection, then DEBUG) and return
        the PERMISSION_DENIED message for its reply."""
        who = peer.describe() if peer else "a client without credentials"
        message = (f"permission denied: {who} is not in the [access] allow-list of "
                   f"the inferd configuration")
        if key in self._refused:
            log.debug("refused request %s from %s", rid, who)
        else:  # once per connection: a refused client retrying must not flood the log
            if len(self._refused) >= PEER_CACHE_SIZE:
                self._refused.clear()
            self._refused.add(key)
            log.warning("refused a request from %s: not in the [access] allow-list", who,
                        extra={"REQUEST_ID": rid or "",
                               "CODE": str(ErrorCode.PERMISSION_DENIED)})
        return message
