"""Clients for applications: :class:`Client` (blocking, thread-safe) and
:class:`AsyncClient` (asyncio). Both speak protocol v1 over a DEALER socket, so many
requests can be in flight on one connection."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from numpy.typing import NDArray

from inferd.ipc import defs
from inferd.ipc.errors import ErrorCode, InferdError, ProtocolError, RequestError
from inferd.ipc.protocol import Op, Reply, Request, StreamRef, decode_reply, encode_request
from inferd.ipc.shm import Region, Registration, shm_path
from inferd.ipc.staging import INLINE_BYTES, Lease, Staging, frame_bytes
from inferd.ipc.stream import AsyncStream, Stream
from inferd.ipc.transport import ipc_path, recv_frames, send_frames, tuned

DEFAULT_ENDPOINT = defs.SOCKET
DEFAULT_TIMEOUT = 30.0
REPLY_GRACE_S = 1.0
"""Extra wait past a request's deadline for the daemon's own DEADLINE_EXCEEDED reply."""
DEFAULT_MAX_IN_FLIGHT = 64
"""Requests one client keeps in flight before a new one waits for a reply (flow
control); the daemon's own limit per client is ``server.max_requests_per_client``."""
BACKOFF_FIRST_S = 0.005
BACKOFF_MAX_S = 0.5


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based) of a RESOURCE_EXHAUSTED
    request: exponential from 5 ms to 0.5 s, with jitter so clients do not retry in step."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**attempt) * random.uniform(0.5, 1.0)


def default_endpoint() -> str:
    """``$INFERD_SOCKET``, else the system socket."""
    return os.environ.get(defs.SOCKET_ENV) or DEFAULT_ENDPOINT


def _check_reachable(endpoint: str) -> None:
    # libzmq queues silently on a missing or forbidden ipc path; say why instead.
    path = ipc_path(endpoint)
    if path is None:
        return
    try:
        exists = path.exists()
    except PermissionError:  # /run/inferd is 0750: outsiders cannot even look inside
        exists = True
    if not exists:
        raise RequestError(f"no inferd socket at {path}: is the daemon running? "
                           f"(set $INFERD_SOCKET or --socket for another endpoint)",
                           ErrorCode.UNAVAILABLE)
    if not os.access(path, os.R_OK | os.W_OK):
        raise RequestError(f"permission denied on {path}: the user needs to be in the "
                           f"socket's group (usually 'inferd')", ErrorCode.UNAVAILABLE)


class _Base:
    def __init__(self, endpoint: str | None, timeout: float, max_in_flight: int,
                 retry_exhausted: bool, max_inline_bytes: int | None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.endpoint = endpoint or default_endpoint()
        self.max_inline_bytes = max_inline_bytes
        path = ipc_path(self.endpoint)
        # big inputs into shared memory of our own (ipc:// only: tcp:// has none)
        self._staging = Staging(shm_path(path)) if (
            path is not None and max_inline_bytes is not None) else None
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.retry_exhausted = retry_exhausted
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        _check_reachable(self.endpoint)

    def _request(self, op: Op, model: str | None = None,
                 inputs: dict[str, NDArray[Any]] | None = None, **fields: Any) -> Request:
        """A request of ``op``; ``fields``: timeout, outputs, version and header keys
        (those that are None are left out)."""
        timeout = fields.pop("timeout", None)
        outputs = fields.pop("outputs", None)
        version = fields.pop("version", None)
        return self._make(op, model, inputs, timeout, outputs, version,
                          {k: v for k, v in fields.items() if v is not None})

    def _make(self, op: Op, model: str | None, inputs: dict[str, NDArray[Any]] | None,
              timeout: float | None, outputs: list[str] | None, version: int | None,
              params: dict[str, Any]) -> Request:
        return Request(id=f"{self._prefix}-{next(self._ids)}", op=op, model=model,
                       version=version, inputs={k: np.asarray(v) for k, v in
                                                (inputs or {}).items()},
                       outputs=list(outputs) if outputs is not None else None,
                       timeout_ms=int((timeout or self.timeout) * 1000), params=params)

    def _stage(self, req: Request, frames: list[Any],
               placed: Any = None) -> tuple[Request, list[Any], Lease | None]:
        """``req`` and its frames, with its largest inputs moved into a region of the
        client's own when its frames pass ``max_inline_bytes`` (and the lease to give
        back once its reply came)."""
        if self._staging is None or self.max_inline_bytes is None:
            return req, frames, None
        over = frame_bytes(frames) - self.max_inline_bytes
        if over <= 0:
            return req, frames, None
        lease = self._staging.stage(req.inputs, over, placed)
        if lease is None:
            return req, frames, None
        req = replace(req, inputs=lease.inputs)

        def locate(array: NDArray[Any]) -> tuple[str, int] | None:
            return lease.locate(array) or (placed(array) if placed is not None else None)
        return req, encode_request(req, locate), lease

    def _retry_pause(self, reply: Reply, attempt: int, give_up: float) -> float | None:
        """How long to wait before sending ``reply``'s request again, or None to keep
        the reply (not RESOURCE_EXHAUSTED, retries off, or no time left)."""
        if not self.retry_exhausted or reply.error is None or \
                reply.error.code is not ErrorCode.RESOURCE_EXHAUSTED:
            return None
        pause = backoff(attempt)
        return pause if time.monotonic() + pause < give_up else None

    @staticmethod
    def _unwrap(reply: Reply) -> Reply:
        if reply.error is not None:
            raise RequestError(reply.error.message, reply.error.code)
        return reply


class Pending:
    """A request in flight; :meth:`result` waits for its reply."""

    def __init__(self, client: Client, request_id: str, deadline: float) -> None:
        self._client = client
        self.id = request_id
        self.deadline = deadline

    def reply(self, timeout: float | None = None) -> Reply:
        """The raw reply (raises RequestError only on a timeout)."""
        deadline = self.deadline if timeout is None else time.monotonic() + timeout
        return self._client._wait(self.id, deadline)

    def result(self, timeout: float | None = None) -> dict[str, NDArray[Any]]:
        """The output tensors; raises RequestError with the daemon's code on failure."""
        return Client._unwrap(self.reply(timeout)).outputs


class Client(_Base):
    """Blocking client; safe to share between threads.

    Args:
        endpoint: daemon endpoint; default ``$INFERD_SOCKET`` or
            ``ipc:///run/inferd/inferd.sock``.
        timeout: seconds to wait for each reply; also sent as the request deadline.
        max_in_flight: requests in flight at once on this client (all threads together);
            one more waits (receiving replies meanwhile) until a reply arrives or its
            timeout passes (then DEADLINE_EXCEEDED), instead of being refused.
        retry_exhausted: :meth:`infer` sends a request again when the daemon answers
            RESOURCE_EXHAUSTED (a full queue, a per-client limit), after an exponential
            backoff (:func:`backoff`), until its timeout. Off by default.
        max_inline_bytes: a request whose frames would pass this many bytes has its
            largest numeric inputs copied into shared memory of the client's own and
            sent by reference (docs/protocol.md, "Inline limit"); the default is the
            least the daemon takes inline. None: always frames (the daemon refuses a
            request over its ``server.max_message_bytes``). ``ipc://`` only.

    Raises:
        RequestError: UNAVAILABLE at once if the ipc socket file is missing or not
            accessible.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 context: zmq.Context | None = None, *,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 retry_exhausted: bool = False,
                 max_inline_bytes: int | None = INLINE_BYTES) -> None:
        super().__init__(endpoint, timeout, max_in_flight, retry_exhausted, max_inline_bytes)
        self._ctx = context or zmq.Context.instance()
        self._sock = tuned(self._ctx.socket(zmq.DEALER))
        self._sock.setsockopt(zmq.LINGER, 0)
        # Receive in short slices so threads sharing the client take turns; a blocking
        # recv with a timeout costs less per reply than a poll before each recv.
        self._sock.setsockopt(zmq.RCVTIMEO, 50)
        self._sock.connect(self.endpoint)
        self._lock = threading.Lock()
        self._replies: dict[str, Reply] = {}
        # Ids sent and not answered yet whose caller still waits: len() is what is in
        # flight, for flow control. A received reply leaves it (into _replies).
        self._waiting: set[str] = set()
        self._registration: Registration | None = None
        self._regions: dict[str, Region] = {}
        self._leases: dict[str, Lease] = {}  # request id -> its inputs' staging region

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._sock.close(0)
            if self._registration is not None:  # the daemon forgets our regions
                self._registration.close()
                self._registration = None
            self._regions.clear()
            self._leases.clear()
            if self._staging is not None:
                self._staging.close()

    # ----------------------------------------------------------------- shared memory

    def register(self, region: Region) -> Region:
        """Hand ``region`` (a sealed memfd) to the daemon once; then arrays made with
        ``region.ndarray(...)`` travel by reference, and ``infer(...,
        outputs_into=region)`` has the outputs written there (docs/protocol.md, "Shared
        memory"). The daemon forgets it at :meth:`unregister` or when this client
        closes.

        Raises:
            RequestError: the daemon refused it (its code and reason), or the endpoint
                has no registration socket (not ``ipc://``).
        """
        path = ipc_path(self.endpoint)
        if path is None:
            raise RequestError(f"shared memory needs an ipc:// endpoint, not "
                               f"{self.endpoint}", ErrorCode.UNSUPPORTED)
        with self._lock:
            try:
                if self._registration is None:
                    self._registration = Registration(shm_path(path))
                token = self._registration.register(region)
            except InferdError as e:
                raise RequestError(e.message, e.code) from None
            except OSError as e:
                raise RequestError(f"cannot register a region with the daemon at "
                                   f"{shm_path(path)}: {e.strerror or e}",
                                   ErrorCode.UNAVAILABLE) from None
            self._regions[token] = region
        return region

    def unregister(self, region: Region) -> None:
        """Tell the daemon to forget ``region`` (after its last request's reply)."""
        with self._lock:
            if self._registration is None or region.token not in self._regions:
                return
            self._regions.pop(region.token, None)
            try:
                self._registration.unregister(region)
            except InferdError as e:
                raise RequestError(e.message, e.code) from None

    def _locate(self, array: NDArray[Any]) -> tuple[str, int] | None:
        for token, region in self._regions.items():
            offset = region.locate(array)
            if offset is not None:
                return token, offset
        return None

    def _resolve(self, token: str) -> memoryview:
        region = self._regions.get(token)
        if region is None:
            raise ProtocolError(f"the reply names region {token[:40]!r}, which this client "
                                f"has not registered")
        return region.buffer

    # ----------------------------------------------------------------- core

    def submit(self, op: Op | str, model: str | None = None,
               inputs: dict[str, NDArray[Any]] | None = None, **fields: Any) -> Pending:
        """Send a request without waiting; collect it with :meth:`Pending.result`."""
        req = self._request(Op(op), model, inputs, **fields)
        return Pending(self, req.id, self._send(req))

    def _send(self, req: Request) -> float:
        """Send ``req`` once fewer than ``max_in_flight`` requests are in flight; returns
        the monotonic time after which its reply is given up."""
        placed = self._locate if self._regions else None
        req, frames, lease = self._stage(req, encode_request(req, placed), placed)
        give_up = time.monotonic() + (req.timeout_ms or 0) / 1000 + REPLY_GRACE_S
        while True:
            with self._lock:
                if len(self._waiting) < self.max_in_flight:
                    self._waiting.add(req.id)
                    if lease is not None:
                        self._leases[req.id] = lease
                    send_frames(self._sock, frames)
                    return give_up
                if time.monotonic() >= give_up:
                    if lease is not None and self._staging is not None:
                        self._staging.give_back(lease, reusable=True)  # never sent
                    raise RequestError(f"no reply from {self.endpoint} within the client "
                                       f"timeout: {len(self._waiting)} requests in flight "
                                       f"(max_in_flight) left no room to send",
                                       ErrorCode.DEADLINE_EXCEEDED)
                self._receive_one(None)  # a slot frees when some reply arrives

    def _receive_one(self, request_id: str | None) -> Reply | None:
        """Receive one reply for up to the socket's 50 ms (caller holds ``_lock``): it if
        it answers ``request_id``, else None (another caller's reply is kept for it)."""
        try:
            frames = recv_frames(self._sock)
        except zmq.Again:
            return None
        got = decode_reply(frames, self._resolve if self._regions else None)
        if got.id not in self._waiting:
            return None  # a late reply to a request whose caller gave up
        self._waiting.discard(got.id)
        self._release(got.id, reusable=True)
        if got.id == request_id:
            return got
        self._replies[got.id] = got
        return None

    def _wait(self, request_id: str, deadline: float) -> Reply:
        while True:
            with self._lock:
                reply = self._replies.pop(request_id, None)
                if reply is not None:
                    return reply
                if request_id not in self._waiting or deadline - time.monotonic() <= 0:
                    self._waiting.discard(request_id)
                    self._release(request_id, reusable=False)  # the daemon may read it yet
                    raise RequestError(f"no reply from {self.endpoint} within the "
                                       f"client timeout", ErrorCode.DEADLINE_EXCEEDED)
                got = self._receive_one(request_id)
                if got is not None:
                    return got

    def _release(self, request_id: str, reusable: bool) -> None:
        """Give back the staging region of request ``request_id`` (caller holds
        ``_lock``)."""
        lease = self._leases.pop(request_id, None)
        if lease is not None and self._staging is not None:
            self._staging.give_back(lease, reusable)

    def call(self, op: Op | str, model: str | None = None, **fields: Any) -> Any:
        """Send a control op and return its ``result``."""
        return self._unwrap(self.submit(op, model, **fields).reply()).result

    # ----------------------------------------------------------------- API

    def infer(self, model: str, inputs: dict[str, NDArray[Any]],
              outputs: list[str] | None = None, *, version: int | None = None,
              timeout: float | None = None,
              outputs_into: Region | tuple[Region, int, int] | None = None,
              stream: StreamRef | None = None) -> dict[str, NDArray[Any]]:
        """Run ``model`` on ``inputs``; returns the output tensors by name.

        Inputs made with ``region.ndarray(...)`` of a registered region travel by
        reference. ``outputs_into`` (a registered region: its free tail; or ``(region,
        offset, size)``) has the daemon write the numeric outputs there: they come back
        as views of the region, valid until the region is written again. ``stream``
        names one of this connection's streams (the wire's ``stream`` field; see
        :meth:`stream`, which keeps it for you).

        Raises:
            RequestError: with ``.code`` the wire code and the daemon's message.
        """
        params: dict[str, Any] = {}
        if outputs_into is not None:
            region, offset, size = (outputs_into if isinstance(outputs_into, tuple)
                                    else (outputs_into, *outputs_into.free()))
            if region.token not in self._regions:
                raise RequestError("outputs_into: the region is not registered with this "
                                   "client (Client.register)", ErrorCode.INVALID_ARGUMENT)
            params["outputs_into"] = {"region": region.token, "offset": offset,
                                      "size": size}
        # submit(...).result() without the Pending: this is the hot path of most clients.
        timeout = timeout or self.timeout
        give_up = time.monotonic() + timeout
        attempt = 0
        while True:
            req = self._make(Op.INFER, model, inputs, timeout, outputs, version, params)
            req.stream = stream
            reply = self._wait(req.id, self._send(req))
            pause = self._retry_pause(reply, attempt, give_up)
            if pause is None:
                break
            time.sleep(pause)
            attempt += 1
            timeout = max(0.001, give_up - time.monotonic())
        if reply.error is not None:
            raise RequestError(reply.error.message, reply.error.code)
        return reply.outputs

    def stream(self, model: str, *, id: str | None = None, version: int | None = None,
               outputs: list[str] | None = None, timeout: float | None = None,
               **constants: Any) -> Stream:
        """A stateful stream of ``model`` on this connection (docs/streams.md):
        ``with client.stream("vad", sr=16000) as s: out = s.infer({"input": chunk})``.
        ``constants`` are the model's constant stream inputs, sent with the start (a
        Python int becomes int64, a float float64: pass numpy values for others)."""
        return Stream(self, model, constants, id=id, version=version, outputs=outputs,
                      timeout=timeout)

    def ping(self) -> dict[str, Any]:
        return self.call(Op.PING)

    def status(self) -> dict[str, Any]:
        return self.call(Op.STATUS)

    def models(self, **fields: Any) -> list[dict[str, Any]]:
        return self.call(Op.MODELS, **fields)["models"]

    def backends(self) -> dict[str, Any]:
        return self.call(Op.BACKENDS)

    def load(self, model: str, version: int | None = None) -> dict[str, Any]:
        return self.call(Op.LOAD, model, version=version)

    def unload(self, model: str) -> dict[str, Any]:
        return self.call(Op.UNLOAD, model)


class AsyncClient(_Base):
    """asyncio client with the same methods as :class:`Client` (awaitable).

    One receiver task routes replies to the awaiting coroutines by request id. At most
    ``max_in_flight`` requests are in flight; more wait for a slot (``asyncio.gather``
    of 200 calls sends 64 at a time by default). ``retry_exhausted`` as for
    :class:`Client`.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 context: zmq.asyncio.Context | None = None, *,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 retry_exhausted: bool = False,
                 max_inline_bytes: int | None = INLINE_BYTES) -> None:
        super().__init__(endpoint, timeout, max_in_flight, retry_exhausted, max_inline_bytes)
        self._slots: asyncio.Semaphore | None = None  # made on first use, in its loop
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = tuned(self._ctx.socket(zmq.DEALER))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        self._futures: dict[str, asyncio.Future[Reply]] = {}
        self._receiver: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except asyncio.CancelledError:
                pass
        self._sock.close(0)
        if self._staging is not None:
            self._staging.close()

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            reply = decode_reply(frames)
            future = self._futures.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def submit(self, op: Op | str, model: str | None = None,
                     inputs: dict[str, NDArray[Any]] | None = None, *,
                     stream: StreamRef | None = None, **fields: Any) -> Reply:
        """Send a request and await its reply (``stream``: one of this connection's
        streams, as :meth:`Client.infer`'s)."""
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive())
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        req = self._request(Op(op), model, inputs, **fields)
        req.stream = stream
        limit = (req.timeout_ms or 0) / 1000 + REPLY_GRACE_S
        give_up = time.monotonic() + limit
        try:
            await asyncio.wait_for(self._slots.acquire(), limit)
        except asyncio.TimeoutError:
            raise RequestError(f"no reply from {self.endpoint} within the client timeout: "
                               f"{self.max_in_flight} requests in flight (max_in_flight) "
                               f"left no room to send", ErrorCode.DEADLINE_EXCEEDED) from None
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._futures[req.id] = future
        lease = None
        try:
            req, frames, lease = self._stage(req, encode_request(req))
            await self._sock.send_multipart(frames, copy=False)
            return await asyncio.wait_for(future, max(0.001, give_up - time.monotonic()))
        except asyncio.TimeoutError:
            raise RequestError(f"no reply from {self.endpoint} within the client timeout",
                               ErrorCode.DEADLINE_EXCEEDED) from None
        finally:
            self._futures.pop(req.id, None)
            self._slots.release()
            if lease is not None and self._staging is not None:
                # reusable once answered; else the daemon may still read it
                self._staging.give_back(lease, reusable=future.done())

    async def call(self, op: Op | str, model: str | None = None, **fields: Any) -> Any:
        return self._unwrap(await self.submit(op, model, **fields)).result

    async def infer(self, model: str, inputs: dict[str, NDArray[Any]],
                    outputs: list[str] | None = None, *, version: int | None = None,
                    timeout: float | None = None,
                    stream: StreamRef | None = None) -> dict[str, NDArray[Any]]:
        """As :meth:`Client.infer` (without ``outputs_into``), awaited."""
        timeout = timeout or self.timeout
        give_up = time.monotonic() + timeout
        attempt = 0
        while True:
            reply = await self.submit(Op.INFER, model, inputs, outputs=outputs,
                                      version=version, timeout=timeout, stream=stream)
            pause = self._retry_pause(reply, attempt, give_up)
            if pause is None:
                return self._unwrap(reply).outputs
            await asyncio.sleep(pause)
            attempt += 1
            timeout = max(0.001, give_up - time.monotonic())

    def stream(self, model: str, *, id: str | None = None, version: int | None = None,
               outputs: list[str] | None = None, timeout: float | None = None,
               **constants: Any) -> AsyncStream:
        """A stateful stream of ``model`` on this connection, as :meth:`Client.stream`:
        ``async with client.stream("vad", sr=16000) as s: out = await s.infer({...})``."""
        return AsyncStream(self, model, constants, id=id, version=version,
                           outputs=outputs, timeout=timeout)

    async def ping(self) -> dict[str, Any]:
        return await self.call(Op.PING)

    async def status(self) -> dict[str, Any]:
        return await self.call(Op.STATUS)

    async def models(self, **fields: Any) -> list[dict[str, Any]]:
        return (await self.call(Op.MODELS, **fields))["models"]

    async def backends(self) -> dict[str, Any]:
        return await self.call(Op.BACKENDS)

    async def load(self, model: str, version: int | None = None) -> dict[str, Any]:
        return await self.call(Op.LOAD, model, version=version)

    async def unload(self, model: str) -> dict[str, Any]:
        return await self.call(Op.UNLOAD, model)
