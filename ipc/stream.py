"""A client's stateful stream (docs/streams.md): :class:`Stream`, made by
:meth:`inferd.ipc.client.Client.stream`, and :class:`AsyncStream`, made by
:meth:`inferd.ipc.client.AsyncClient.stream` (the same, awaited).

The daemon keeps the model's state (and input context) between the stream's chunks;
the client sends each chunk and gets the model's outputs, the state left out::

    with client.stream("vad", sr=np.array(16000, np.int64)) as s:
        for chunk in chunks:                       # float32 [1, 512]
            prob = s.infer({"input": chunk})["output"]

The first :meth:`Stream.infer` starts the stream (``"start": true`` with the constant
inputs given here); each later one sends only its chunk; :meth:`Stream.close` (or the
``with`` block's end) ends it (``"end": true``, no chunk), freeing its state in the
daemon; :meth:`Stream.reset` makes the next chunk start it again from its initial
state. A stream's chunks run in the order they are sent, one at a time::

    async with client.stream("vad", sr=16000) as s:   # an AsyncClient
        prob = (await s.infer({"input": chunk}))["output"]
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import ErrorCode, RequestError
from inferd.ipc.protocol import STREAM_ID, StreamRef

if TYPE_CHECKING:
    from inferd.ipc.client import AsyncClient, Client


class _StreamState:
    """What a stream's client side keeps (its id, constants, whether it started) and
    decides (what each request sends, what an answer changes), for both clients.

    Args:
        model: the model (its model.toml has a ``[stream]`` table).
        constants: the inputs that stay constant for the stream (Silero's ``sr``), sent
            with its start; a Python number becomes a 0-d array of numpy's default
            type for it (int64, float64).
        id: the stream's id: 1 to 64 characters of ``A-Za-z0-9._-`` (default: a new
            random one).
        version: the model version (default: the one the daemon serves).
        outputs: the outputs wanted of each chunk (default: all but the state).
        timeout: seconds per chunk (default: the client's).
    """

    def __init__(self, model: str, constants: dict[str, Any], *, id: str | None = None,
                 version: int | None = None, outputs: list[str] | None = None,
                 timeout: float | None = None) -> None:
        sid = id if id is not None else "s" + uuid.uuid4().hex[:16]
        if not STREAM_ID.fullmatch(sid):
            raise RequestError(f"stream id {sid!r}: 1 to 64 characters of A-Z a-z 0-9 . _ -",
                               ErrorCode.INVALID_ARGUMENT)
        self.model = model
        self.id = sid
        self.version = version
        self.outputs = outputs
        self.timeout = timeout
        self.constants: dict[str, NDArray[Any]] = {k: np.asarray(v)
                                                   for k, v in constants.items()}
        self.started = False
        self.chunks = 0  # chunks answered since the stream (re)started

    def _chunk(self, inputs: dict[str, NDArray[Any]]) -> tuple[dict[str, NDArray[Any]],
                                                                StreamRef]:
        """What the next chunk sends: its inputs (the constants with a start) and ref."""
        start = not self.started
        return ({**self.constants, **inputs} if start else inputs,
                StreamRef(self.id, start=start))

    def _answered(self, ref: StreamRef) -> None:
        self.started = True
        self.chunks = 1 if ref.start else self.chunks + 1

    def _refused(self, e: RequestError) -> None:
        # a refused start left no stream: the next chunk starts again, as after a loss
        # (which the caller sees here first)
        if e.code is ErrorCode.FAILED_PRECONDITION:
            self.started = False

    def _ending(self) -> StreamRef | None:
        """The end to send, or None if the stream never started (nothing to free)."""
        if not self.started:
            return None
        self.started = False
        return StreamRef(self.id, end=True)

    @staticmethod
    def _end_refused(e: RequestError) -> None:
        if e.code is not ErrorCode.FAILED_PRECONDITION:  # not started: nothing to free
            raise e

    def reset(self) -> None:
        """Make the next chunk start the stream again (the daemon resets its state to
        the initial one then)."""
        self.started = False
        self.chunks = 0


class Stream(_StreamState):
    """One stream of ``model`` on ``client`` (see the module's docstring; the other
    arguments are :class:`_StreamState`'s).

    Args:
        client: the connection the stream belongs to (a stream id is per connection).
    """

    def __init__(self, client: Client, model: str, constants: dict[str, Any],
                 **kw: Any) -> None:
        super().__init__(model, constants, **kw)
        self.client = client

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(self, inputs: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """Run the next chunk; returns the model's outputs (its state kept in the
        daemon). The first chunk (and the first after :meth:`reset`) starts the stream.

        Raises:
            RequestError: the daemon's code and message; FAILED_PRECONDITION when the
                stream's state was lost (the message says why): :meth:`reset` and send
                again to start over.
        """
        send, ref = self._chunk(inputs)
        try:
            out = self.client.infer(self.model, send, self.outputs, version=self.version,
                                    timeout=self.timeout, stream=ref)
        except RequestError as e:
            self._refused(e)
            raise
        self._answered(ref)
        return out

    def close(self) -> None:
        """End the stream: the daemon frees its state (nothing is sent if it never
        started). Ending a stream the daemon has lost is not an error."""
        ref = self._ending()
        if ref is None:
            return
        try:
            self.client.infer(self.model, {}, version=self.version, timeout=self.timeout,
                              stream=ref)
        except RequestError as e:
            self._end_refused(e)


class AsyncStream(_StreamState):
    """:class:`Stream` for an :class:`~inferd.ipc.client.AsyncClient`: ``async with``,
    ``await s.infer(...)``, ``await s.close()``; the same semantics.

    Args:
        client: the connection the stream belongs to (a stream id is per connection).
    """

    def __init__(self, client: AsyncClient, model: str, constants: dict[str, Any],
                 **kw: Any) -> None:
        super().__init__(model, constants, **kw)
        self.client = client

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def infer(self, inputs: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """As :meth:`Stream.infer`, awaited. One chunk at a time: await each before
        sending the next (chunks sent at once from several tasks still run in the
        order they reach the daemon, but this object's count would not follow)."""
        send, ref = self._chunk(inputs)
        try:
            out = await self.client.infer(self.model, send, self.outputs,
                                          version=self.version, timeout=self.timeout,
                                          stream=ref)
        except RequestError as e:
            self._refused(e)
            raise
        self._answered(ref)
        return out

    async def close(self) -> None:
        """As :meth:`Stream.close`, awaited."""
        ref = self._ending()
        if ref is None:
            return
        try:
            await self.client.infer(self.model, {}, version=self.version,
                                    timeout=self.timeout, stream=ref)
        except RequestError as e:
            self._end_refused(e)
