"""The systemd service protocol: sd_notify messages and the watchdog.

:class:`Notifier` sends ``READY=1``, ``STATUS=``, ``RELOADING=1`` (with
``MONOTONIC_USEC=``), ``STOPPING=1``, ``EXTEND_TIMEOUT_USEC=`` and ``WATCHDOG=1`` to the
socket named by ``$NOTIFY_SOCKET`` as one AF_UNIX datagram of ``KEY=VALUE`` lines (the
whole protocol). Not through systemd-python's ``sd_notify``: it holds the GIL during a
blocking ``sendmsg``, so a notify socket whose queue is full (nobody reading it;
``net.unix.max_dgram_qlen`` is 10 by default) froze every thread of the daemon. A
Python socket releases the GIL while it waits, and waits at most ``SEND_TIMEOUT_S``.
Without ``$NOTIFY_SOCKET`` every call is a silent no-op, so the daemon runs the same
outside systemd.

:class:`Watchdog` pings at half of ``$WATCHDOG_USEC``, and only while a health probe
says the daemon really works, so systemd restarts a stuck daemon.

This module imports nothing from inferd, so that it can be tested on its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0
"""How long one message may wait for room in the notify socket's queue; past it the
message is dropped (a watchdog ping is sent again next period) and that is logged."""


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares MONOTONIC_USEC with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _address(value: str) -> str | bytes:
    # "@name" is an abstract socket: a leading NUL byte on the wire.
    return b"\0" + value[1:].encode() if value.startswith("@") else value


class Notifier:
    """Sends sd_notify messages to one notify socket.

    Args:
        address: the socket (a path, or ``@name`` for an abstract socket); None or ""
            makes every call a no-op.
    """

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_env(cls) -> Notifier:
        """A notifier for ``$NOTIFY_SOCKET`` (a no-op one when it is not set)."""
        return cls(os.environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> bool:
        """Send one message of ``KEY=value`` lines; True if it was sent.

        Keys are passed as keyword arguments (``notify(READY=1, STATUS="...")``);
        newlines inside a value are replaced, since the protocol is line based.
        """
        if self.address is None:
            return False
        text = "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items())
        try:
            self._send(text.encode())
        except OSError as e:  # TimeoutError: the queue stayed full for SEND_TIMEOUT_S
            if not self._warned:  # once: a broken notify socket must not flood the log
                log.warning("cannot notify systemd at %s: %s", self.address, e)
                self._warned = True
            return False
        return True

    def _send(self, payload: bytes) -> None:
        with self._lock:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX,
                                           socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.settimeout(SEND_TIMEOUT_S)
            self._sock.sendto(payload, _address(self.address or ""))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # ------------------------------------------------------------- the messages

    def ready(self, status: str) -> bool:
        """``READY=1`` with a ``STATUS=`` line for ``systemctl status``."""
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def reloading(self, status: str = "reloading configuration") -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (systemd 253+ matches the two)."""
        return self.notify(RELOADING=1, MONOTONIC_USEC=monotonic_usec(), STATUS=status)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(STOPPING=1, STATUS=status)

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        """Ask for ``seconds`` more before the start/stop timeout, counted from now."""
        fields: dict[str, object] = {"EXTEND_TIMEOUT_USEC": int(seconds * 1_000_000)}
        if status:
            fields["STATUS"] = status
        return self.notify(**fields)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)


def watchdog_interval() -> float | None:
    """Seconds of ``$WATCHDOG_USEC`` when it is meant for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return value / 1_000_000 if value > 0 else None


Probe = Callable[[float], "str | None"]
"""Health probe: given a time limit in seconds, None when healthy, else the reason."""


class Watchdog:
    """Pings systemd's watchdog at half its interval while ``probe`` reports health.

    Args:
        notifier: where ``WATCHDOG=1`` goes.
        interval_s: systemd's watchdog interval (``$WATCHDOG_USEC``).
        probe: checks the daemon; gets a time limit (a quarter of the interval) and
            returns None when healthy or the reason it is not.
    """

    def __init__(self, notifier: Notifier, interval_s: float, probe: Probe) -> None:
        self.notifier = notifier
        self.period = interval_s / 2
        self._probe = probe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inferd-watchdog",
                                        daemon=True)
        self.pings = 0

    def start(self) -> None:
        log.info("watchdog: pinging systemd every %.3g s while healthy", self.period)
        self._thread.start()

    def stop(self, wait: bool = False) -> None:
        """Stop pinging; ``wait`` joins the thread (never from the I/O thread: the
        probe in progress may be waiting for it)."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        last_reason: str | None = None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                reason = self._probe(self.period / 2)
            except Exception as e:  # the probe itself failing is a failed check
                reason = f"health probe failed: {type(e).__name__}: {e}"
            if reason is None:
                if last_reason is not None:
                    log.warning("watchdog: healthy again; pinging systemd")
                if self.notifier.watchdog():
                    self.pings += 1
            elif reason != last_reason:
                log.error("watchdog: not pinging systemd: %s", reason,
                          extra={"STAGE": "watchdog"})
            last_reason = reason
            self._stop.wait(max(0.0, self.period - (time.monotonic() - started)))
