"""Where the daemon's log goes: the journal when stderr is connected to it, else stderr.

systemd sets ``$JOURNAL_STREAM`` to the ``device:inode`` of the stream it connected to
stderr; only when that matches ``fstat(2)`` are the records sent to journald natively,
each with its priority and the structured fields inferd uses (:data:`FIELDS`), so that
``journalctl -u inferd MODEL=ocr-det`` and ``journalctl -u inferd -p warning`` work.
Otherwise records are plain lines on stderr, the fields appended as ``KEY=value``.

Journal messages go through systemd-python's ``sendv`` when it is importable, else as
one datagram of the native journal protocol on ``/run/systemd/journal/socket``. Only
uppercase field names are ever sent: journald drops a message with any other name.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Mapping
from typing import TextIO

try:  # Debian: python3-systemd
    from systemd import journal as _sd_journal
except ImportError:
    _sd_journal = None

FIELDS = ("MODEL", "BACKEND", "REQUEST_ID", "PLUGIN_PATH", "STAGE", "CODE")
"""The structured fields inferd attaches to records via ``extra={...}``."""

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "inferd"
MAX_MESSAGE_BYTES = 64 * 1024  # larger messages are cut; a datagram has to fit

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
             logging.DEBUG: 7}

log = logging.getLogger(__name__)


def journal_stream_matches(stream: TextIO | None = None) -> bool:
    """True when ``$JOURNAL_STREAM`` names the file that ``stream`` (stderr) is."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat((stream or sys.stderr).fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (journalctl -p)."""
    for level in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= level:
            return _PRIORITY[level]
    return _PRIORITY[logging.DEBUG]


def record_fields(record: logging.LogRecord) -> dict[str, str]:
    """inferd's structured fields present (and not empty) on ``record``."""
    out = {}
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is not None and value != "":
            out[name] = str(value)
    return out


def encode_journal(fields: Mapping[str, str]) -> bytes:
    """The native journal protocol: ``KEY=value\\n``, or for a value with a newline,
    ``KEY\\n`` + its length as little-endian uint64 + the value + ``\\n``."""
    parts = []
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            parts.append(key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n")
        else:
            parts.append(key.encode() + b"=" + data + b"\n")
    return b"".join(parts)


def decode_journal(data: bytes) -> dict[str, str]:
    """The fields of one native-protocol datagram, as journald reads it (the inverse of
    :func:`encode_journal`; tests and ``make deb-test`` stand in for journald with it)."""
    fields = {}
    while data:
        line, _, rest = data.partition(b"\n")
        if b"=" in line:
            key, value = line.split(b"=", 1)
            data = rest
        else:  # binary-safe form
            (size,) = struct.unpack("<Q", rest[:8])
            key, value, data = line, rest[8:8 + size], rest[9 + size:]
        fields[key.decode()] = value.decode("utf-8", "replace")
    return fields


class JournalHandler(logging.Handler):
    """Sends records to journald with their priority and structured fields.

    Args:
        address: journald's socket; another path makes the handler send datagrams
            there (tests stand in for journald that way). systemd-python is used only
            for the default address.
        identifier: ``SYSLOG_IDENTIFIER`` of every message.
    """

    def __init__(self, address: str = JOURNAL_SOCKET, identifier: str = IDENTIFIER,
                 level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.address = address
        self.identifier = identifier
        self._library = _sd_journal is not None and address == JOURNAL_SOCKET
        self._sock: socket.socket | None = None
        self._sock_lock = threading.Lock()
        self.setFormatter(logging.Formatter("%(message)s"))

    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        """Every field of the journal entry for ``record``; uppercase names only."""
        message = self.format(record)
        if len(message) > MAX_MESSAGE_BYTES:
            message = message[:MAX_MESSAGE_BYTES] + " [message truncated]"
        out = {"MESSAGE": message, "PRIORITY": str(priority(record.levelno)),
               "SYSLOG_IDENTIFIER": self.identifier, "LOGGER": record.name,
               "CODE_FILE": record.pathname, "CODE_LINE": str(record.lineno),
               "CODE_FUNC": record.funcName, "THREAD_NAME": record.threadName or ""}
        out.update(record_fields(record))
        return {k: v for k, v in out.items() if v != ""}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = self.fields(record)
            if self._library:
                _sd_journal.sendv(*(f"{k}={v}" for k, v in fields.items()))
                return
            with self._sock_lock:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX,
                                               socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(encode_journal(fields), self.address)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        with self._sock_lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        super().close()


class PlainFormatter(logging.Formatter):
    """``time LEVEL logger: message [KEY=value ...]`` for a terminal or a file."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = record_fields(record)
        if fields:
            text += " [" + " ".join(f"{k}={v}" for k, v in fields.items()) + "]"
        return text


_installed: logging.Handler | None = None
_module_levels: set[str] = set()


def setup_logging(level: str = "info", modules: Mapping[str, str] | None = None, *,
                  stream: TextIO | None = None, journal: bool | None = None) -> logging.Handler:
    """Install the daemon's one log handler on the root logger and set the levels.

    Calling it again (on reload) replaces the handler and re-applies the levels; a
    module left out of ``modules`` goes back to inheriting ``level``.

    Args:
        level: the default level (``logging.level``).
        modules: logger name -> level (``logging.modules``), e.g.
            ``{"inferd.ipc.server": "debug"}``.
        stream: where plain lines go (default stderr).
        journal: force the sink; None decides by :func:`journal_stream_matches`.

    Returns:
        The handler installed.
    """
    global _installed
    stream = stream or sys.stderr
    use_journal = journal_stream_matches(stream) if journal is None else journal
    handler: logging.Handler
    if use_journal:
        handler = JournalHandler()
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(PlainFormatter())
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
        _installed.close()
    root.addHandler(handler)
    _installed = handler
    set_levels(level, modules)
    return handler


def set_levels(level: str, modules: Mapping[str, str] | None = None) -> None:
    """Apply the default level and the per-module levels (on start and reload)."""
    logging.getLogger().setLevel(level.upper())
    for name in _module_levels - set(modules or {}):
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, value in (modules or {}).items():
        logging.getLogger(name).setLevel(value.upper())
    _module_levels.clear()
    _module_levels.update(modules or {})
