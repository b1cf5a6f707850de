"""Where the daemon's log goes: the journal when stderr is connected to it, else stderr.

systemd sets ``$JOURNAL_STREAM`` to the ``device:inode`` of the stream it connected to
stderr; only when that matches ``fstat(2)`` are the records sent to journald natively,
each with its priority and the structured fields inferd uses (:data:`FIELDS`), so that
``journalctl -u inferd MODEL=ocr-det`` and ``journalctl -u inferd -p warning`` work.
Otherwise records are plain lines on stderr, the fields appended as ``KEY=value``.

Journal messages go through systemd-python's ``sendv`` when it is importable, else as
one datagram of the native journal protocol on ``/run/systemd/journal/socket``. Only
uppercase field names are ever sent: journald drops a message with any other name.

Repeated lines are rate-limited per cause (:class:`RepeatFilter`: the format string and
the fields naming the model, backend, plugin, stage or code): a client sending the same
bad request at full speed must not write thousands of lines a second. The first
:data:`BURST` records of a cause in :data:`WINDOW_S` go out in full; the rest are counted
and summed up in one line when the window ends ("… 4,213 more like this in the last
10 s: <the last one>"); while a flood lasts, only those summaries. DEBUG records, asked
for on purpose, are never held back.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

CAUSE_FIELDS = tuple(f for f in FIELDS if f != "REQUEST_ID")
"""The structured fields that tell causes apart (:meth:`RepeatFilter.cause`)."""
WINDOW_S = 10.0
"""The interval over which repeated records of one cause are counted."""
BURST = 5
"""Records of one cause written in full per interval (none while a flood lasts)."""
MAX_CAUSES = 1024
"""Causes tracked at once; past it, causes whose interval has ended are forgotten."""


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


@dataclass
class _Cause:
    start: float  # when its interval began
    written: int = 0  # records let through in this interval
    held: int = 0  # records held back in this interval
    flooding: bool = False  # the last interval held some back: write only summaries
    last: logging.LogRecord | None = None  # the last one held back


class RepeatFilter(logging.Filter):
    """Rate-limits repeated records per cause: the logger, the level, the message's
    format string (not its arguments) and the fields naming what it is about
    (:data:`CAUSE_FIELDS`).

    Args:
        handler: the handler this filter is on; the summaries go out through it.
        window: seconds per interval; burst: records of a cause written in full per
            interval.
        clock: the time source (tests pass their own).
        background: run the ``inferd-log-summary`` thread that writes each summary
            when its interval ends (tests call :meth:`flush_due` instead).
    """

    def __init__(self, handler: logging.Handler, window: float = WINDOW_S,
                 burst: int = BURST, clock: Callable[[], float] = time.monotonic,
                 background: bool = True) -> None:
        super().__init__()
        self._handler = handler
        self.window = window
        self.burst = burst
        self._clock = clock
        self._background = background
        self._causes: dict[tuple[object, ...], _Cause] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    @staticmethod
    def cause(record: logging.LogRecord) -> tuple[object, ...]:
        """The logger, the level, the format string and the structured fields that name
        what the record is about (a model, a backend, a plugin, a stage, a code): a
        different plugin or model is a different cause. Not the request id: every
        request has its own."""
        return (record.name, record.levelno, record.msg,
                *(getattr(record, f, None) for f in CAUSE_FIELDS))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or getattr(record, "inferd_summary", False):
            return True
        key, now = self.cause(record), self._clock()
        summary = None
        with self._lock:
            cause = self._causes.get(key)
            if cause is None:
                if len(self._causes) >= MAX_CAUSES:
                    self._forget_ended(now)
                cause = self._causes[key] = _Cause(now)
            elif now - cause.start >= self.window:
                summary = self._roll(cause, now)
            passed = not cause.flooding and cause.written < self.burst
            if passed:
                cause.written += 1
            else:
                cause.held += 1
                cause.last = record
                if self._background and self._thread is None and not self._closed:
                    self._thread = threading.Thread(target=self._summaries, daemon=True,
                                                    name="inferd-log-summary")
                    self._thread.start()
                self._wake.notify()
        if summary is not None:  # the interval that ended, before this record
            self._handler.handle(summary)
        return passed

    def _roll(self, cause: _Cause, now: float) -> logging.LogRecord | None:
        """End ``cause``'s interval (lock held): its summary record, if any held."""
        summary = None
        if cause.held and cause.last is not None:
            last = cause.last
            summary = logging.makeLogRecord({**last.__dict__, "exc_info": None,
                                             "exc_text": None, "stack_info": None,
                                             "args": None, "inferd_summary": True})
            summary.msg = (f"… {cause.held:,} more like this in the last "
                           f"{now - cause.start:.0f} s: {last.getMessage()}")
        cause.flooding = cause.held > 0
        cause.start, cause.written, cause.held, cause.last = now, 0, 0, None
        return summary

    def flush_due(self, now: float | None = None, everything: bool = False) -> None:
        """Write the summary of each interval that has ended (all, if ``everything``)."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [c for c in self._causes.values()
                   if c.held and (everything or now - c.start >= self.window)]
            out = [r for c in due if (r := self._roll(c, now)) is not None]
        for record in out:
            self._handler.handle(record)

    def _forget_ended(self, now: float) -> None:
        for key in [k for k, c in self._causes.items()
                    if now - c.start >= self.window and not c.held]:
            del self._causes[key]

    def _summaries(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                starts = [c.start for c in self._causes.values() if c.held]
                wait = (min(starts) + self.window - self._clock()) if starts else None
                if wait is None or wait > 0:
                    self._wake.wait(wait)
                    continue
            self.flush_due()

    def close(self) -> None:
        """Write every pending summary and stop the thread."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self.flush_due(everything=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)


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
    """Install the daemon's one log handler on the root logger (repeated records
    rate-limited: :class:`RepeatFilter`) and set the levels.

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
    repeats = RepeatFilter(handler)
    handler.addFilter(repeats)
    atexit.register(repeats.close)  # before logging's own (atexit runs last-in first)
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
        for f in _installed.filters:
            if isinstance(f, RepeatFilter):
                f.close()
        _installed.close()
    root.addHandler(handler)
    _installed = handler
    set_levels(level, modules)
    return handler


def shutdown() -> None:
    """Write the pending summaries of held-back records, then ``logging.shutdown()``
    (at exit; atexit does the same on a normal exit)."""
    if _installed is not None:
        for f in _installed.filters:
            if isinstance(f, RepeatFilter):
                f.close()
    logging.shutdown()


def set_levels(level: str, modules: Mapping[str, str] | None = None) -> None:
    """Apply the default level and the per-module levels (on start and reload)."""
    logging.getLogger().setLevel(level.upper())
    for name in _module_levels - set(modules or {}):
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, value in (modules or {}).items():
        logging.getLogger(name).setLevel(value.upper())
    _module_levels.clear()
    _module_levels.update(modules or {})
