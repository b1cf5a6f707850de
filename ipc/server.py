"""The daemon's side of the wire: one I/O thread owns the ROUTER socket.

Requests are decoded here and handed to a handler as their ticket (which holds the
decoded request: ``ticket.request``). A handler either answers at once
(returns a :class:`Reply`) or keeps the :class:`~inferd.ipc.replies.Ticket` and answers
later from any thread with :meth:`Server.send_reply`; a reply from another thread is
encoded there and handed to the I/O thread in a queue, with an eventfd that wakes its
poll, so no other thread touches the ROUTER. Every request gets exactly one reply: the
server keeps each request's ticket (its one in-flight record, ``ipc/replies.py``) until
it is answered, refuses new work while stopping, and answers whatever is still open
with UNAVAILABLE when the grace period ends. Every wire reply passes
:meth:`Server._deliver`, the one place where it is counted: the per-client limits are
given the ticket back and the observer (the request metrics) is told.

Connections: libzmq's socket monitor reports each accepted and each closed connection
by its file descriptor. Past ``server.max_connections``
(:class:`~inferd.ipc.clients.Connections`) a new connection is shut down at once and
logged (libzmq would abort the process when ``accept`` meets the open-files limit). A
client that disconnects is told to :attr:`Server.on_peer_gone` (the daemon answers its
queued requests CANCELLED instead of running them for nobody, and frees its streams):
:class:`~inferd.ipc.access.Peers` notes each client's descriptor from its first message
(beside its credentials).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from inferd.ipc.access import Access, Peer, Peers
from inferd.ipc.clients import REPLY_TRACK_BYTES, ClientLimits, Connections
from inferd.ipc.decoder import INLINE_DECODE_BYTES, Decoder, Resolve
from inferd.ipc.errors import ErrorCode, Failure, InferdError, ProtocolError, failure
from inferd.ipc.protocol import Reply, decode_request, encode_reply, peek_request_id
from inferd.ipc.replies import Observer, Ticket
from inferd.ipc.shm import Regions, shm_path
from inferd.ipc.shmcheck import RegionLimits
from inferd.ipc.socketfile import Listener, SocketLock, _chgrp
from inferd.ipc.transport import NOBLOCK, ipc_path, recv_frames, send_frames, tuned

log = logging.getLogger(__name__)


Handler = Callable[[Ticket], Reply | None]


RECEIVE_HWM = 1
"""Requests libzmq may hold per connection before the I/O thread reads them (ZMQ_RCVHWM);
past it the client's sends wait (backpressure), nothing is dropped. libzmq receives a
message whole before the daemon sees it and counts messages, not bytes: with 1 it holds
at most two per connection (this one and the one it is receiving), each frame at most
``ZMQ_MAXMSGSIZE``, which is what bounds the socket layer's memory for all connections
together (``daemon.runtime.message_bound``). A client's further requests wait in its own
send queue, in its own memory."""


def over_inline(size: int, limit: int) -> str:
    """The answer to a request whose frames pass ``server.max_message_bytes``."""
    return (f"message of {size} bytes is over the limit of {limit} bytes "
            f"(server.max_message_bytes): send tensors this large through shared memory, "
            f"named by region and offset (docs/protocol.md, \"Shared memory\"); a single "
            f"frame over {2 * limit} bytes closes the connection")


def _fd_count_in_size() -> bool:
    try:
        return os.stat("/proc/self/fd").st_size > 0
    except OSError:
        return False


_FD_COUNT_IN_SIZE = _fd_count_in_size()
"""Whether the size of /proc/self/fd is the number of descriptors (Linux >= 6.2: 3 us
here); before, a listing (~0.2 ms for 800)."""
_BRAKE_EVERY = 1 if _FD_COUNT_IN_SIZE else 64
"""How many monitor events may pass between two looks at the descriptors."""


def _open_fds() -> int:
    """Descriptors the process holds now (0 if /proc cannot say)."""
    try:
        if _FD_COUNT_IN_SIZE:
            return os.stat("/proc/self/fd").st_size
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own one
    except OSError:
        return 0


def _shut_down(fd: int) -> None:
    """Shut down the connection on ``fd`` (libzmq's own): libzmq then sees it end and
    closes it. No new descriptor is needed (none may be left)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return  # already gone
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closing
    finally:
        sock.detach()  # the descriptor stays libzmq's


class Server:
    """ROUTER server loop. Create, :meth:`bind`, then :meth:`run` on the I/O thread.

    Args:
        endpoint: where to bind, e.g. ``ipc:///run/inferd/inferd.sock``.
        handler: called on the I/O thread for each decoded request.
        max_message_bytes: requests larger than this (all frames) get RESOURCE_EXHAUSTED,
            naming shared memory (the way for bigger tensors); libzmq drops the connection
            of a peer sending one frame over twice this.
        socket_mode: file mode set on an ipc socket file.
        socket_group: group given to an ipc socket file ("" leaves the process's own).
        access: the allow-list; replace :attr:`access` to change it (e.g. on reload).
        grace_s: how long :meth:`run` waits for in-flight requests when stopping.
        cpu_affinity: cores for the I/O thread and libzmq's own I/O thread (empty: any
            core). Threads that the I/O thread starts inherit them.
        observe: told about every answered ticket, on the I/O thread, as its reply
            leaves (the request metrics).
        max_connections: client connections open at once; past it new ones are closed
            (lowered to what the open-files limit leaves room for).
        max_bytes_in_flight: bytes of requests received and not yet answered, from all
            clients together (0: no bound; :class:`~inferd.ipc.clients.ClientLimits`).
        resolve: checks, off the I/O thread, that the model or graph an ``infer`` names
            exists before tensors that take time to decode are decoded
            (:mod:`inferd.ipc.decoder`); raises to refuse the request.
    """

    def __init__(self, endpoint: str, handler: Handler, *, max_message_bytes: int,
                 socket_mode: int = 0o660, grace_s: float = 10.0, socket_group: str = "",
                 access: Access | None = None, cpu_affinity: Iterable[int] = (),
                 max_requests_per_client: int = 512, max_bytes_per_client: int = 128 * 2**20,
                 max_replies_queued_per_client: int = 1000,
                 observe: Observer | None = None, max_connections: int = 2048,
                 max_bytes_in_flight: int = 0, resolve: Resolve | None = None) -> None:
        self.endpoint = endpoint
        self._decoder = Decoder(resolve, self._decoded)
        self._observe = observe
        self.clients = ClientLimits(max_requests_per_client, max_bytes_per_client,
                                    max_bytes_in_flight)
        self.connections = Connections(max_connections,
                                       resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._max_replies_queued = max_replies_queued_per_client
        self._handler = handler
        self.max_message_bytes = max_message_bytes
        self._mode = socket_mode
        self._group = socket_group
        self.access = access or Access()
        self._peers = Peers()
        self._grace_s = grace_s
        self._ctx = zmq.Context()
        self._cores = sorted(cpu_affinity)
        for core in self._cores:  # before the first socket starts libzmq's I/O thread
            self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, core)
        self._router: zmq.Socket | None = None
        self.regions: Regions | None = None  # shared-memory tensors (ipc:// only)
        # Replies answered on other threads, encoded, for the I/O thread to send; each
        # one put there is followed by a write to the eventfd that wakes its poll (a
        # deque and an eventfd cost a sixth of an inproc PUSH/PULL hand-over).
        self._handed: deque[tuple[Ticket, list[Any]]] = deque()
        self._handed_fd = -1  # made by bind()
        # Held by another thread while it hands a reply over, and while the hand-over
        # closes: nothing is handed over after _closed is set.
        self._send_lock = threading.Lock()
        self._closed = False
        # seq -> the request's record, from receipt until its reply leaves
        self._inflight: dict[int, Ticket] = {}
        self._seq = 0
        self._io_ident: int | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._calls: deque[Callable[[], None]] = deque()
        self._stop = False
        self._lock: SocketLock | None = None
        self._listener: Listener | None = None
        self._braked = False  # accepting paused for descriptors (_brake)
        self._poller = zmq.Poller()
        self.on_stop: Callable[[], None] | None = None
        # called on the I/O thread with the key of each client whose connection closed
        # (its queued requests are cancelled, its streams freed)
        self.on_peer_gone: Callable[[bytes], None] | None = None
        self._monitor: zmq.Socket | None = None
        # descriptors the I/O loop watches for others (watch): fd -> (ready, deadline,
        # late); a deadline passed is set to inf once late() was called
        self._watched: dict[int, tuple[Callable[[], None], float, Callable[[], None]]] = {}
        self.stats = {"requests": 0}
        self.undelivered = 0

    # ----------------------------------------------------------------- set-up

    def bind(self) -> None:
        """Claim and bind the endpoint. Raises InferdError if it is taken."""
        path = ipc_path(self.endpoint)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = SocketLock(path)
            self._lock.acquire()
        router = tuned(self._ctx.socket(zmq.ROUTER))
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 1000)
        router.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)
        # Both are per connection on a ROUTER: replies waiting for a client that does not
        # read, and requests libzmq holds before the I/O thread takes them.
        router.setsockopt(zmq.SNDHWM, self._max_replies_queued)
        router.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        # Before the bind: no connection may be accepted unseen.
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

        def undo() -> None:
            router.disable_monitor()
            monitor.close(0)
            router.close(0)
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if self._lock:
                self._lock.release()  # removes the socket file too

        try:
            if path is not None:  # the daemon's own listening socket (mode, group)
                self._listener = Listener(path, self._mode, self._group)
                router.setsockopt(zmq.USE_FD, self._listener.fd)
            router.bind(self.endpoint)
        except zmq.ZMQError as e:
            undo()
            raise InferdError(f"cannot bind {self.endpoint}: {e}",
                              ErrorCode.UNAVAILABLE) from e
        except (OSError, InferdError):
            undo()
            raise
        if self._listener is not None:
            self._listener.adopted()
        self._router = router
        self._handed_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        if path is not None:
            bounds = RegionLimits.derive(self.connections.fd_limit,
                                         self.connections.fd_brake, self.connections.max)
            self.regions = Regions(shm_path(path), self._mode, self._access, bounds,
                                   _open_fds)
            self.regions.bind(self._chgrp if self._group else None)
        self._monitor = monitor
        log.info("requests of up to %d bytes are taken inline (server.max_message_bytes); "
                 "bigger tensors travel in shared memory", self.max_message_bytes)
        limits = self.connections
        if limits.max < limits.configured:
            log.warning("server.max_connections = %d, but the open-files limit leaves room "
                        "for %d connections: at most %d are served (raise LimitNOFILE)",
                        limits.configured, limits.max, limits.max)

    def _access(self) -> Access:
        return self.access

    def _chgrp(self, path: Any) -> None:
        _chgrp(path, self._group)

    # ----------------------------------------------------------------- any thread

    def send_reply(self, ticket: Ticket, reply: Reply) -> None:
        """Answer ``ticket``; callable from any thread. Only its first answer is sent
        (:meth:`Ticket.answer`): a later one is dropped quietly.

        Once the server has closed (the grace period is over and every open request was
        answered UNAVAILABLE), a late reply is dropped: no thread touches a socket that
        is closed or about to be.
        """
        if threading.get_ident() == self._io_ident:
            if ticket.answer(reply):
                self._deliver(ticket.seq, encode_reply(reply, ticket.outputs_into))
            else:
                self._second(ticket)
            return
        frames = encode_reply(reply, ticket.outputs_into)
        with self._send_lock:
            if self._closed:  # answered UNAVAILABLE already: its record stays so
                log.debug("late reply to request %s dropped: the server has closed",
                          ticket.request_id, extra={"REQUEST_ID": ticket.request_id})
                return
            if not ticket.answer(reply):
                self._second(ticket)
                return
            self._handed.append((ticket, frames))
            os.eventfd_write(self._handed_fd, 1)

    @staticmethod
    def _second(ticket: Ticket) -> None:
        log.debug("second reply to request %s dropped (answered %s)", ticket.request_id,
                  ticket.code, extra={"REQUEST_ID": ticket.request_id})

    def open_tickets(self) -> list[Ticket]:
        """The requests received and not answered yet (any thread: a copy); the daemon's
        deadline watch reads it."""
        return list(self._inflight.values())

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread; safe from signal handlers and other threads."""
        self._calls.append(fn)
        self._wake()

    @property
    def wakeup_fd(self) -> int:
        """A non-blocking fd whose writes wake :meth:`run`; give it to
        ``signal.set_wakeup_fd`` so a signal that lands on another thread still wakes
        the I/O loop (which then runs the Python-level handler)."""
        return self._wake_w.fileno()

    def watch(self, fd: int, deadline: float, ready: Callable[[], None],
              late: Callable[[], None]) -> None:
        """Call ``ready()`` on the I/O thread once ``fd`` is readable (then it is watched
        no more), and ``late()`` once if ``deadline`` (monotonic) passes first: a run
        sent to a worker from the I/O thread (daemon/model_threads.py), answered when its
        reply is in. I/O thread only; ``fd`` stays open until ``ready`` is called."""
        self._watched[fd] = (ready, deadline, late)
        self._poller.register(fd, zmq.POLLIN)

    def _watch_due(self, events: dict[Any, int]) -> None:
        """Call the ``ready`` of each watched descriptor that is readable, the ``late`` of
        each whose deadline passed."""
        now = time.monotonic()
        for fd, (ready, deadline, late) in list(self._watched.items()):
            if fd in events:
                del self._watched[fd]
                self._poller.unregister(fd)
                call = ready
            elif deadline <= now:
                self._watched[fd] = (ready, math.inf, late)
                call = late
            else:
                continue
            try:
                call()
            except Exception:  # noqa: BLE001  one run's answer must not end the loop
                log.exception("I/O-thread call %r failed", call)

    def stop(self) -> None:
        """Ask :meth:`run` to stop; safe from signal handlers and other threads."""
        self._stop = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            # BlockingIOError: a wake-up is already pending. Closed: a late signal (a
            # second SIGTERM, a SIGHUP) after close() must not kill the process.
            pass

    # ----------------------------------------------------------------- I/O thread

    def run(self) -> None:
        """Serve until :meth:`stop`, then drain and close. Runs on the calling thread."""
        assert self._router is not None, "bind() first"
        self._io_ident = threading.get_ident()
        if self._cores:
            # Python threads take turns on the GIL anyway: a model's worker that shares
            # this core hands requests over without waking another core.
            try:
                os.sched_setaffinity(threading.get_native_id(), self._cores)
                log.info("I/O thread pinned to cores %s", self._cores)
            except OSError as e:
                log.warning("cannot pin the I/O thread to cores %s (server.cpu_affinity): "
                            "%s", self._cores, e.strerror)
        poller = self._poller
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._handed_fd, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        stopping_since: float | None = None
        while True:
            if self._stop and stopping_since is None:
                stopping_since = time.monotonic()
                log.info("stopping: %d requests in flight", len(self._inflight))
                if self.on_stop:
                    self.on_stop()
            if stopping_since is not None:
                if not self._inflight:
                    break
                left = self._grace_s - (time.monotonic() - stopping_since)
                if left <= 0:
                    break
                timeout: int | None = max(1, int(left * 1000))
            else:
                timeout = None
            trim = self.clients.trim_in()
            if trim is not None:  # sleep no longer than until the idle trim
                timeout = min(timeout or 2**31, max(1, int(trim * 1000) + 1))
            settle = self.clients.settle_in()
            if settle is not None:  # nor than until unread replies are looked at
                timeout = min(timeout or 2**31, max(1, int(settle * 1000) + 1))
            if self._watched:  # nor than until a watched run is late
                due = min(w[1] for w in self._watched.values())
                if due != math.inf:
                    wait = max(0.0, due - time.monotonic())
                    timeout = min(timeout or 2**31, int(wait * 1000) + 1)
            events = dict(poller.poll(timeout))
            if not events or trim == 0.0:
                self.clients.trim_if_due()
            if settle is not None:
                self.clients.settle_if_due()
            if self._watched:
                self._watch_due(events)
            if not events:
                continue
            if self._wake_r.fileno() in events:
                self._drain_wakeups()
            if self._handed_fd in events:
                self._forward_replies()
            if self._monitor in events:
                # Connections first: a closed connection's descriptor may be reused by
                # the client whose message is read next. libzmq queues the event before
                # that client's message, and the poll checks the monitor after the
                # ROUTER (registration order), so the event is seen no later.
                self._connection_events()
            listener = self._listener
            if listener is not None and listener.paused and listener.waiting_fd in events:
                self._release_brake()  # descriptors may have gone without an event
                if listener.paused:
                    self._closed_new(listener.refuse_waiting())
            if self._router in events:
                self._receive_request(refuse=stopping_since is not None)
        self._close()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:
                log.exception("I/O-thread call %r failed", fn)

    def _forward_replies(self) -> None:
        """Send every reply handed over (the eventfd is reset first: one handed over
        meanwhile is either sent now or wakes the next poll)."""
        try:
            os.eventfd_read(self._handed_fd)
        except BlockingIOError:
            pass  # nothing handed over since the last reset
        handed = self._handed
        while handed:
            ticket, frames = handed.popleft()
            self._deliver(ticket.seq, frames)

    def _deliver(self, seq: int, frames: list[Any]) -> None:
        """Send the reply of request #``seq``: every wire reply passes here, once."""
        ticket = self._inflight.pop(seq, None)
        if ticket is None:
            log.warning("dropping a second or late reply for request #%d (already answered)",
                        seq)
            return
        # Big frames go tracked: they count for the client until libzmq lets go of them
        # (a client that does not read would otherwise have them kept here, unbounded).
        tracked, last = 0, None
        for i in range(2, len(frames)):  # the tag and the header are small
            frame = frames[i]
            size = frame.nbytes if type(frame) is not bytes else len(frame)
            if size >= REPLY_TRACK_BYTES:
                frames[i] = last = zmq.Frame(frame, track=True)
                tracked += size
        unread = None
        try:
            send_frames(self._router, [*ticket.envelope, *frames], NOBLOCK)
            if last is not None:  # a message's parts are let go of in order
                unread = (tracked, last.tracker)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client went away; EAGAIN: not reading
            self.undelivered += 1
            if self.undelivered & (self.undelivered - 1) == 0:  # 1, 2, 4, 8...: no flood
                log.info("reply #%d not delivered: client gone or not reading (%s); %d "
                         "replies undelivered since start", seq, e, self.undelivered)
        self.clients.done(ticket, unread)
        if self._observe is not None:
            try:
                self._observe(ticket)
            except Exception:  # noqa: BLE001  counting must not lose the reply
                log.exception("counting the reply to request %s failed", ticket.request_id)

    def _connection_events(self) -> None:
        """Handle the monitor's events: close each accepted connection past the bound;
        for each closed one, tell :attr:`on_peer_gone` about its clients (they may have
        requests in flight, or streams open). The descriptors themselves are looked at before the
        events and between them (:meth:`_brake`, :data:`_BRAKE_EVERY`): the events
        trail libzmq's accepting."""
        assert self._monitor is not None  # called when the poll reports it
        handled = 0
        while True:
            if handled % _BRAKE_EVERY == 0:
                self._brake()
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                self._release_brake()
                return
            handled += 1
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                if not self.connections.accepted(fd):  # accepted before the pause
                    _shut_down(fd)
                    self._closed_new(1)
                self._pace_accepting()
                continue
            self.connections.closed(fd)
            self._pace_accepting()
            self.clients.connection_closed()
            for key in self._peers.gone(fd):
                if self.on_peer_gone is None:
                    continue
                try:
                    self.on_peer_gone(key)
                except Exception:  # noqa: BLE001  a bug there must not stop the I/O loop
                    log.exception("dropping the requests of a disconnected client failed")

    def _pause(self) -> None:
        assert self._listener is not None
        self._listener.pause()
        self._poller.register(self._listener.waiting_fd, zmq.POLLIN)

    def _resume(self) -> None:
        assert self._listener is not None
        self._listener.resume()
        self._poller.unregister(self._listener.waiting_fd)

    def _pace_accepting(self) -> None:
        """Pause libzmq's accepting at the bound; resume it once a few have closed (a
        pause for descriptors, :meth:`_brake`, ends only in :meth:`_release_brake`)."""
        listener, limit = self._listener, self.connections
        if listener is None:
            return
        open_now = limit.count()
        if open_now >= limit.max and not listener.paused:
            self._pause()
            log.warning("%d connections are open, the limit (server.max_connections = %d): "
                        "new connections are closed until some close", open_now, limit.max)
        elif (listener.paused and not self._braked
              and open_now <= limit.max - max(1, limit.max // 16)):
            self._resume()
            log.info("%d connections are open, below the limit (server.max_connections = "
                     "%d): accepting new connections again", open_now, limit.max)

    def _brake(self) -> None:
        """Pause accepting when the process's descriptors near the open-files limit,
        before the monitor's events have counted the connections holding them: libzmq
        aborts the process when its ``accept`` meets the limit (EMFILE)."""
        listener, limit = self._listener, self.connections
        if listener is None or listener.paused:
            return
        fds = _open_fds()
        if fds >= limit.fd_brake:
            self._pause()
            self._braked = True
            log.warning("%d descriptors are open, %d below the open-files limit, while %d "
                        "connections are counted: new connections are closed until some "
                        "close", fds, limit.fd_limit - fds, limit.count())

    def _release_brake(self) -> None:
        """After a batch of events, and when a connection waits while paused: end a
        pause for descriptors once they are 32 below :attr:`Connections.fd_brake`; the
        count's own bound then decides."""
        if not self._braked:
            return
        if _open_fds() > self.connections.fd_brake - 32:
            return
        self._braked = False
        self._pace_accepting()

    def _closed_new(self, n: int) -> None:
        if n:
            log.warning("closed %d new connection(s): %d connections are open, the limit "
                        "(server.max_connections = %d)", n, self.connections.count(),
                        self.connections.max)

    def _receive_request(self, refuse: bool) -> None:
        frames = recv_frames(self._router)
        # ROUTER prefixes the peer identity; a REQ client adds an empty delimiter.
        split = 2 if len(frames) > 1 and len(frames[1]) == 0 else 1
        envelope, body = frames[:split], frames[split:]
        self._seq += 1
        # The request's record from here until its reply leaves (_deliver).
        ticket = Ticket(self._seq, time.monotonic(), peer=frames[0].bytes,
                        envelope=envelope, size=sum(map(len, body)))
        self._inflight[ticket.seq] = ticket
        self.stats["requests"] += 1
        peer = self._peers.lookup(ticket.peer, frames[-1])
        ticket.uid = peer.uid if peer is not None else None
        over = self.clients.admit(ticket, ticket.uid)
        if not self.access.allows(peer):
            self._refuse(ticket, body, peer)
            return
        if over is not None:
            rid = peek_request_id(body)
            log.debug("request %s refused: %s", rid, over,
                      extra={"REQUEST_ID": rid or "", "CODE": "RESOURCE_EXHAUSTED"})
            self._answer_error(ticket, Failure(ErrorCode.RESOURCE_EXHAUSTED, over), rid)
            return
        self._handle(ticket, body, refuse, peer)

    def _refuse(self, ticket: Ticket, body: list[Any], peer: Peer | None) -> None:
        rid = peek_request_id(body)
        message = self._peers.refuse(peer, ticket.peer, rid)
        self._answer_error(ticket, Failure(ErrorCode.PERMISSION_DENIED, message), rid)

    def _handle(self, ticket: Ticket, body: list[Any], refuse: bool,
                peer: Peer | None) -> None:
        """Read the header, price the tensors and hand the request on (I/O thread). The
        work here is per tensor description, never per element: tensors that take time
        to decode go to the ``inferd-decode`` thread, after admission has counted what
        decoding them will make (:meth:`ClientLimits.decoding`)."""
        try:
            if ticket.size > self.max_message_bytes:
                raise ProtocolError(over_inline(ticket.size, self.max_message_bytes),
                                    ErrorCode.RESOURCE_EXHAUSTED,
                                    request_id=peek_request_id(body))
            request = decode_request(body, self.regions.resolver(peer)
                                     if self.regions is not None else None, defer=True)
            ticket.request = request  # its id, model, deadline, slot: read from it
            over = self.clients.decoding(ticket, request.cost.decoded_bytes)
            if over is not None:
                raise InferdError(over, ErrorCode.RESOURCE_EXHAUSTED)
            if refuse:
                raise InferdError("inferd is shutting down", ErrorCode.UNAVAILABLE)
            if request.pending is not None:
                if request.cost.decoded_bytes > INLINE_DECODE_BYTES:
                    self._decoder.submit(ticket)
                    return
                request.decode()
        except Exception as e:
            self._refused(ticket, e)
            return
        self._dispatch(ticket)

    def _dispatch(self, ticket: Ticket) -> None:
        """Give a decoded request's ticket to the handler and send its reply if it has
        one."""
        try:
            reply = self._handler(ticket)
        except Exception as e:
            self._refused(ticket, e)
            return
        if reply is not None:
            self.send_reply(ticket, reply)

    def _refused(self, ticket: Ticket, e: Exception) -> None:
        rid = e.request_id if isinstance(e, ProtocolError) else ticket.request_id
        error = failure(e, "internal error", log, request_id=rid or "")
        if isinstance(e, InferdError):
            log.debug("request %s refused: %s %s", rid, e.code, e.message,
                      extra={"REQUEST_ID": rid or "", "CODE": str(e.code)})
        self._answer_error(ticket, error, rid)

    def _decoded(self, ticket: Ticket, error: Exception | None) -> None:
        """The decode thread's outcome of a request, back to the I/O thread."""
        self.call_soon(partial(self._after_decoding, ticket, error))

    def _after_decoding(self, ticket: Ticket, error: Exception | None) -> None:
        if ticket.code is not None:  # answered meanwhile (the stop)
            return
        if error is None and self._stop:
            error = InferdError("inferd is shutting down", ErrorCode.UNAVAILABLE)
        if error is not None:
            self._refused(ticket, error)
            return
        self._dispatch(ticket)

    def _answer_error(self, ticket: Ticket, error: Failure,
                      request_id: str | None = None) -> None:
        """Answer ``ticket`` with ``error``, addressed to its request id; ``request_id``
        is the id of a message refused before it was decoded (None: unknown, then the
        reply's id is "")."""
        if request_id and not ticket.request_id:  # read without decoding the header
            ticket.unread_id = request_id
        rid = ticket.request_id
        reply = Reply(rid, error=error)
        if not ticket.answer(reply):
            # answered, but that reply never left (the stop, or a failed hand-over to
            # the I/O thread): this one goes, the record keeps the first outcome
            log.debug("request %s answered %s, but its reply was lost: answering %s",
                      rid, ticket.code, error.code)
        self._deliver(ticket.seq, encode_reply(reply))

    def _close(self) -> None:
        self._decoder.stop()
        with self._send_lock:  # from here on, late replies from other threads are dropped
            self._closed = True
        # Replies handed over before that still go out; what is left was never answered.
        self._forward_replies()
        for ticket in list(self._inflight.values()):
            self._answer_error(ticket, Failure(ErrorCode.UNAVAILABLE,
                                               "inferd stopped before this request "
                                               "finished"))
        assert self._router is not None
        if self._monitor is not None:
            self._router.disable_monitor()
            self._monitor.close(0)
        if self._listener is not None:
            self._listener.resume()  # libzmq's descriptor must be the one it watches
        self._router.close(linger=1000)
        if self.regions is not None:
            self.regions.close()
        if self._listener is not None:
            self._listener.close()
        if self._lock:
            self._lock.release()
        log.info("server closed")

    def close(self) -> None:
        """Release the hand-over and the ZeroMQ context (after :meth:`run`).

        Safe while worker threads still run (a grace period that ended with work left):
        they drop whatever they answer later (the lock they hand over under says the
        server has closed). Waits up to the ROUTER's linger (1 s) for the last replies
        to leave.
        """
        # The wake-up pair stays open until here: signals keep arriving while the
        # workers drain (the signal wakeup fd writes to it). Unhook it first, so a
        # late signal is not written to whatever file gets the number next.
        if threading.current_thread() is threading.main_thread():
            old = signal.set_wakeup_fd(-1)
            if old not in (-1, self._wake_w.fileno()):
                signal.set_wakeup_fd(old)
        self._wake_r.close()
        self._wake_w.close()
        with self._send_lock:
            self._closed = True
            if self._handed_fd >= 0:
                os.close(self._handed_fd)
                self._handed_fd = -1
        self._ctx.term()
