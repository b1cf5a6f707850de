"""The ``inferd-decode`` thread: decodes the tensors of a request that take time to
decode, off the I/O thread, once the model or graph the request names is known to exist.

The I/O thread reads a request's header and prices its tensors from their descriptions
(:func:`inferd.ipc.protocol.decode_request` with ``defer=True``): numeric tensors become
views of their frames or region at once, while packed types (unpacked to a byte per
element) and strings (a Python object per element) are left for
:meth:`~inferd.ipc.protocol.Request.decode`. A request whose decoding makes more than
:data:`INLINE_DECODE_BYTES` comes here, in arrival order: its name is resolved first (an
unknown model or graph is refused without anything decoded), then its tensors are
decoded, and the request goes back to the I/O thread, which hands it on as any other.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from inferd.ipc.protocol import Op, Request
from inferd.ipc.replies import Ticket

log = logging.getLogger(__name__)

INLINE_DECODE_BYTES = 64 * 2**10
"""A request whose decoding makes at most this many bytes (a few thousand strings, a
64 Ki-element int4 tensor) is decoded on the I/O thread: two thread hand-overs would
cost more."""

Resolve = Callable[[Request], None]
"""Raises (an ``InferdError``: NOT_FOUND...) if the model or graph a request names does
not exist; may read the model repository."""
Decoded = Callable[[Ticket, "Exception | None"], None]
"""Told (on the decode thread) that a request was decoded, or why it was refused."""


class Decoder:
    """One ``inferd-decode`` thread and its queue.

    Args:
        resolve: checks the name of an ``infer`` request before its tensors are decoded
            (None: no check, every request is decoded).
        decoded: told each request's outcome, on the decode thread (the server hands it
            back to the I/O thread).
    """

    def __init__(self, resolve: Resolve | None, decoded: Decoded) -> None:
        self._resolve = resolve
        self._decoded = decoded
        self._queue: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``'s request for its name check and decoding (I/O thread)."""
        if self._thread is None:  # started on first use: most daemons never need it
            self._thread = threading.Thread(target=self._loop, name="inferd-decode",
                                            daemon=True)
            self._thread.start()
        self._queue.put(ticket)

    def stop(self, timeout: float = 1.0) -> None:
        """End the thread after what it is decoding now; what is still queued is left
        (the server answers every open request at its close)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            request = ticket.request
            if ticket.code is not None:  # answered meanwhile (the stop): nothing to do
                continue
            error: Exception | None = None
            try:
                if self._resolve is not None and request.op is Op.INFER:
                    self._resolve(request)
                request.decode()
            except Exception as e:  # noqa: BLE001  the request's reply says what failed
                error = e
            try:
                self._decoded(ticket, error)
            except Exception:  # noqa: BLE001  a bug there must not end the thread
                log.exception("handing decoded request %s back failed", request.id)
