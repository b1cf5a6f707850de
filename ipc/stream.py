"""A client's stateful stream (docs/streams.md): :class:`Stream`, made by
:meth:`inferd.ipc.client.Client.stream`.

The daemon keeps the model's state (and input context) between the stream's chunks;
the client sends each chunk and gets the model's outputs, the state left out::

    with client.stream("vad", sr=np.array(16000, np.int64)) as s:
        for chunk in chunks:                       # float32 [1, 512]
            prob = s.infer({"input": chunk})["output"]

The first :meth:`Stream.infer` starts the stream (``"start": true`` with the constant
inputs given here); each later one sends only its chunk; :meth:`Stream.close` (or the
``with`` block's end) ends it (``"end": true``, no chunk), freeing its state in the
daemon; :meth:`Stream.reset` makes the next chunk start it again from its initial
state. A stream's chunks run in the order they are sent, one at a time.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import ErrorCode, RequestError
from inferd.ipc.protocol import STREAM_ID, StreamRef

if TYPE_CHECKING:
    from inferd.ipc.client import Client


class Stream:
    """One stream of ``model`` on ``client`` (see the module's docstring).

    Args:
        client: the connection the stream belongs to (a stream id is per connection).
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

    def __init__(self, client: Client, model: str, constants: dict[str, Any], *,
                 id: str | None = None, version: int | None = None,
                 outputs: list[str] | None = None, timeout: float | None = None) -> None:
        sid = id if id is not None else "s" + uuid.uuid4().hex[:16]
        if not STREAM_ID.fullmatch(sid):
            raise RequestError(f"stream id {sid!r}: 1 to 64 characters of A-Z a-z 0-9 . _ -",
                               ErrorCode.INVALID_ARGUMENT)
        self.client = client
        self.model = model
        self.id = sid
        self.version = version
        self.outputs = outputs
        self.timeout = timeout
        self.constants: dict[str, NDArray[Any]] = {k: np.asarray(v)
                                                   for k, v in constants.items()}
        self.started = False
        self.chunks = 0  # chunks answered since the stream (re)started

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
        start = not self.started
        send = {**self.constants, **inputs} if start else inputs
        try:
            out = self.client.infer(self.model, send, self.outputs, version=self.version,
                                    timeout=self.timeout,
                                    stream=StreamRef(self.id, start=start))
        except RequestError as e:
            # a refused start left no stream: the next chunk starts again, as after a
            # loss (which the caller sees here first)
            if e.code is ErrorCode.FAILED_PRECONDITION:
                self.started = False
            raise
        self.started = True
        self.chunks = 1 if start else self.chunks + 1
        return out

    def reset(self) -> None:
        """Make the next chunk start the stream again (the daemon resets its state to
        the initial one then)."""
        self.started = False
        self.chunks = 0

    def close(self) -> None:
        """End the stream: the daemon frees its state (nothing is sent if it never
        started). Ending a stream the daemon has lost is not an error."""
        if not self.started:
            return
        self.started = False
        try:
            self.client.infer(self.model, {}, version=self.version, timeout=self.timeout,
                              stream=StreamRef(self.id, end=True))
        except RequestError as e:
            if e.code is not ErrorCode.FAILED_PRECONDITION:  # not started: nothing to free
                raise
