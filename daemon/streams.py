"""Stateful streams: a model's state carried in the daemon between a client's requests
(docs/streams.md).

A model declares its state in model.toml's ``[stream]`` table (:class:`StreamSpec`):
which outputs feed which inputs at the next step (``stateN`` -> ``state``), each with
its initial value and batch axis; the inputs that stay constant for a stream (``sr``);
the input context carried from one chunk to the next (the last 64 samples of Silero's
``input``). Bound to a loaded model it becomes a :class:`StreamModel` (initial values
made, names checked against the model).

Each cache entry owns one :class:`StreamTable`: its streams by (client connection, user
id, stream id). The state lives here, in the daemon process, and goes to the engine as
ordinary inputs with each chunk; the state outputs come back and are kept. So a worker
process that dies *between* two chunks loses nothing, while a chunk whose run did not
end in a reply the client got leaves the state unknown: the stream is marked lost with
the reason and its next request is answered FAILED_PRECONDITION, never silently
continued from a guess or reset to zeros. Unloading the model (unload, reload,
eviction) loses its streams the same way; an idle stream is freed.

One stream's chunks run one at a time in the order they arrived: a chunk that arrives
while an earlier one of its stream is queued or running is held by its stream (not
refused) and queued when the earlier one is answered (:meth:`StreamTable.admit`,
:meth:`StreamTable.finished`). So a stream never has two chunks in one batch; chunks of
different streams may share one (:func:`merge` and :func:`split`: states stacked along
their batch axis, constants equal).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.dtypes import dtype_name, numpy_dtype
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.protocol import Reply, StreamRef

log = logging.getLogger(__name__)

DEFAULT_MAX_STREAMS = 64
DEFAULT_IDLE_TIMEOUT_S = 60.0
LOST_KEPT = 4096
"""Most lost streams remembered per model (to answer their next request with why);
the oldest are forgotten first (their next request is then "not started")."""


# --------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class StateSpec:
    """One state input fed by an output at the next step."""

    input: str
    output: str
    axis: int
    init: str  # "zeros" or a .npy file in the version folder


@dataclass(frozen=True)
class ContextSpec:
    """The last ``size`` elements along ``axis`` of ``input`` (as the model got it,
    context included) carried in front of the next chunk's ``input``."""

    input: str
    axis: int
    size: int


@dataclass(frozen=True)
class StreamSpec:
    """A model.toml ``[stream]`` table, checked (docs/model-toml.md)."""

    states: tuple[StateSpec, ...] = ()
    constants: tuple[tuple[str, tuple[Any, ...] | None], ...] = ()
    """(input name, the values allowed or None for any)."""
    contexts: tuple[ContextSpec, ...] = ()
    chunk: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(input name, the shape every chunk of it must have) for the inputs declared."""
    max_streams: int = DEFAULT_MAX_STREAMS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    @property
    def constant_names(self) -> list[str]:
        return [n for n, _ in self.constants]

    def to_json(self) -> dict[str, Any]:
        return {"state": {s.input: {"from": s.output, "axis": s.axis, "init": s.init}
                          for s in self.states},
                "constant": self.constant_names,
                "context": {c.input: {"axis": c.axis, "size": c.size} for c in self.contexts},
                "max_streams": self.max_streams, "idle_timeout_s": self.idle_timeout_s}


_KEYS = ("state", "constant", "context", "chunk", "max_streams", "idle_timeout_s")


def _int(v: Any, what: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {v!r}")
    return v


def parse_stream(value: Any) -> StreamSpec:
    """Check a ``[stream]`` table (model.toml's schema calls it).

    Raises:
        ValueError: what is wrong, naming the key.
    """
    if not isinstance(value, dict):
        raise ValueError("[stream] must be a table")
    unknown = [k for k in value if k not in _KEYS]
    if unknown:
        raise ValueError(f"unknown keys {unknown}; [stream] takes {', '.join(_KEYS)}")
    raw_states = value.get("state", {})
    if not isinstance(raw_states, dict) or not raw_states:
        raise ValueError("state must be a table of input = { from = output, axis = n, "
                         "init = \"zeros\" or \"file.npy\" }, at least one")
    states = []
    for name, s in raw_states.items():
        if not isinstance(s, dict) or not isinstance(s.get("from"), str) or set(s) - {
                "from", "axis", "init"}:
            raise ValueError(f"state.{name} must be {{ from = \"output\", axis = n, "
                             f"init = \"zeros\" or \"file.npy\" }}")
        init = s.get("init", "zeros")
        if not isinstance(init, str) or not (init == "zeros" or (
                init.endswith(".npy") and "/" not in init and not init.startswith("."))):
            raise ValueError(f"state.{name}.init must be \"zeros\" or the name of a .npy "
                             f"file in the version folder, got {init!r}")
        states.append(StateSpec(name, s["from"], _int(s.get("axis", 0),
                                                      f"state.{name}.axis", 0), init))
    raw_const = value.get("constant", [])
    constants: list[tuple[str, tuple[Any, ...] | None]] = []
    if isinstance(raw_const, list) and all(isinstance(c, str) for c in raw_const):
        constants = [(c, None) for c in raw_const]
    elif isinstance(raw_const, dict) and all(
            isinstance(v, list) and v and all(isinstance(x, int | float) for x in v)
            for v in raw_const.values()):
        constants = [(k, tuple(v)) for k, v in raw_const.items()]
    else:
        raise ValueError("constant must be a list of input names, or a table of input "
                         "name = list of the values allowed")
    raw_ctx = value.get("context", {})
    if not isinstance(raw_ctx, dict):
        raise ValueError("context must be a table of input = { axis = n, size = n }")
    contexts = []
    for name, c in raw_ctx.items():
        if not isinstance(c, dict) or set(c) != {"axis", "size"}:
            raise ValueError(f"context.{name} must be {{ axis = n, size = n }}")
        contexts.append(ContextSpec(name, _int(c["axis"], f"context.{name}.axis", 0),
                                    _int(c["size"], f"context.{name}.size", 1)))
    raw_chunk = value.get("chunk", {})
    if not isinstance(raw_chunk, dict) or not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                        and d >= 0 for d in s)
            for s in raw_chunk.values()):
        raise ValueError("chunk must be a table of input = [shape], e.g. "
                         "{ input = [1, 512] }")
    chunk = tuple((k, tuple(v)) for k, v in raw_chunk.items())
    names = [s.input for s in states] + [c for c, _ in constants]
    if len(set(names)) != len(names):
        raise ValueError("an input is named twice among state and constant")
    for c in contexts:
        if c.input in names:
            raise ValueError(f"context.{c.input}: a state or constant input has no context")
    timeout = value.get("idle_timeout_s", DEFAULT_IDLE_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout < math.inf):
        raise ValueError(f"idle_timeout_s must be a positive number, got {timeout!r}")
    return StreamSpec(tuple(states), tuple(constants), tuple(contexts), chunk,
                      _int(value.get("max_streams", DEFAULT_MAX_STREAMS), "max_streams", 1),
                      float(timeout))


# --------------------------------------------------------------------------- bound

class StreamModel:
    """A :class:`StreamSpec` checked against a loaded model, with each state's initial
    value made (zeros of the input's shape, its batch axis 1, or the .npy file).

    Raises (from :meth:`prepare`):
        ModelError (INTERNAL): a name that is not an input or output of the model, an
            axis past its rank, a state whose shape the model leaves free beyond its
            batch axis and no file gives, an unreadable or mismatched .npy file.
    """

    def __init__(self, label: str, spec: StreamSpec, init: dict[str, NDArray[Any]],
                 dtypes: dict[str, str]) -> None:
        self.label = label
        self.spec = spec
        self.init = init
        self.dtypes = dtypes  # input name -> wire dtype
        self.state_inputs = {s.input for s in spec.states}
        self.state_outputs = {s.output for s in spec.states}
        self.constant_names = spec.constant_names
        self.allowed = dict(spec.constants)
        self.chunk = dict(spec.chunk)
        self.inputs = list(dtypes)
        self.chunk_inputs = [n for n in dtypes if n not in self.state_inputs
                             and n not in self.constant_names]
        # looked up with every chunk (bind, commit, merge, split): made once
        self.state_axes = {s.input: s.axis for s in spec.states}
        self.output_axes = {s.output: s.axis for s in spec.states}
        self.context_dtypes = {c.input: _numpy_or_none(dtypes[c.input])
                               for c in spec.contexts}

    @classmethod
    def prepare(cls, label: str, spec: StreamSpec, inputs: Any, outputs: Any,
                folder: Path) -> StreamModel:
        where = f"model {label}: model.toml [stream]"
        by_name = {t.name: t for t in inputs}
        out_names = [t.name for t in outputs]

        def need_input(name: str, key: str) -> Any:
            if name not in by_name:
                raise ModelError(f"{where}: {key} names {name!r}, which is not an input of "
                                 f"the model; its inputs: {list(by_name)}", ErrorCode.INTERNAL)
            return by_name[name]
        init: dict[str, NDArray[Any]] = {}
        for s in spec.states:
            t = need_input(s.input, f"state.{s.input}")
            if s.output not in out_names:
                raise ModelError(f"{where}: state.{s.input}.from names {s.output!r}, which is "
                                 f"not an output of the model; its outputs: {out_names}",
                                 ErrorCode.INTERNAL)
            if s.axis >= len(t.shape):
                raise ModelError(f"{where}: state.{s.input}.axis = {s.axis}, but input "
                                 f"{s.input!r} has rank {len(t.shape)}", ErrorCode.INTERNAL)
            dtype = numpy_dtype(t.dtype)
            if s.init == "zeros":
                shape = []
                for axis, d in enumerate(t.shape):
                    if axis == s.axis:
                        shape.append(1)
                    elif isinstance(d, int) and d >= 0:
                        shape.append(d)
                    else:
                        raise ModelError(f"{where}: state.{s.input}: the model leaves axis "
                                         f"{axis} of {s.input!r} free ({list(t.shape)}), so "
                                         f"zeros have no shape; give init = \"file.npy\"",
                                         ErrorCode.INTERNAL)
                value = np.zeros(shape, dtype)
            else:
                path = folder / s.init
                try:
                    value = np.load(path, allow_pickle=False)
                except (OSError, ValueError) as e:
                    raise ModelError(f"{where}: state.{s.input}.init: cannot read {path}: "
                                     f"{e}", ErrorCode.INTERNAL) from None
                if value.dtype != dtype or value.ndim != len(t.shape) or \
                        value.shape[s.axis] != 1:
                    raise ModelError(f"{where}: state.{s.input}.init: {path} holds "
                                     f"{value.dtype}{list(value.shape)}; expected "
                                     f"{t.dtype} of rank {len(t.shape)} with size 1 on axis "
                                     f"{s.axis}", ErrorCode.INTERNAL)
            value.setflags(write=False)
            init[s.input] = value
        for name in spec.constant_names:
            need_input(name, "constant")
        for c in spec.contexts:
            t = need_input(c.input, f"context.{c.input}")
            if c.axis >= len(t.shape):
                raise ModelError(f"{where}: context.{c.input}.axis = {c.axis}, but input "
                                 f"{c.input!r} has rank {len(t.shape)}", ErrorCode.INTERNAL)
        for name, _ in spec.chunk:
            need_input(name, f"chunk.{name}")
        return cls(label, spec, init, {t.name: t.dtype for t in inputs})

    def state_bytes(self) -> int:
        """Bytes one stream holds: its states (as made at start); the contexts are
        counted when a stream has one (:meth:`Stream.nbytes`)."""
        return sum(v.nbytes for v in self.init.values())


# --------------------------------------------------------------------------- streams

StreamKey = tuple[bytes, int | None, str]
"""(client connection, its user id, stream id): a stream id is per client."""


@dataclass(eq=False)
class Stream:
    """One client's stream of one model version. Its state, context and constants are
    changed only by the chunk that holds it (``busy``), in :meth:`StreamTable.commit`."""

    key: StreamKey
    name: str  # "stream s17 of vad", for messages
    state: dict[str, NDArray[Any]] = field(default_factory=dict)
    context: dict[str, NDArray[Any]] = field(default_factory=dict)
    constants: dict[str, NDArray[Any]] = field(default_factory=dict)
    chunk_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    started: bool = False
    lost: str | None = None
    chunks: int = 0  # chunks run
    busy: bool = False  # a chunk of it is queued or running
    held: deque[Any] = field(default_factory=deque)  # later chunks waiting their turn
    used_at: float = field(default_factory=time.monotonic)

    def nbytes(self) -> int:
        return (sum(v.nbytes for v in self.state.values())
                + sum(v.nbytes for v in self.context.values()))


@dataclass(eq=False)
class Chunk:
    """A request's part in its stream (on its Queued): the stream, what the request
    said, and how its run went."""

    stream: Stream
    ref: StreamRef
    number: int = 0  # 1 for a stream's first chunk
    ran: bool = False  # its inputs went to the engine: the state is the run's now
    committed: bool = False  # the run's state outputs are the stream's
    reason: str | None = None  # why the run failed, when it did
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # its chunk's, bound


class Admission(Enum):
    RUN = "run"  # queue it now
    HELD = "held"  # an earlier chunk of its stream is in flight: it waits its turn


def not_started(sid: str, model: str) -> InferdError:
    return InferdError(f"stream {sid} of {model}: not started; send start=true first",
                       ErrorCode.FAILED_PRECONDITION)


def lost_error(sid: str, model: str, reason: str) -> InferdError:
    return InferdError(f"stream {sid} of {model}: state lost ({reason}); start the stream "
                       f"again", ErrorCode.FAILED_PRECONDITION)


def no_stream_table(model: str) -> InferdError:
    return InferdError(f"model {model} has no [stream] table in its model.toml",
                       ErrorCode.INVALID_ARGUMENT)


class StreamTable:
    """The streams of one model version (owned by its cache entry). The table's methods
    take its lock, except :meth:`bind` and :meth:`commit`, which only the chunk that
    holds a stream (its turn) calls. Where both are held, the entry's lock is taken
    first (:meth:`admit` is called under it; the entry's transitions call
    :meth:`lose_all` under it).

    Args:
        model: the model's name, for messages.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.lock = threading.Lock()  # the table and each stream's turn (busy, held)
        self.closing: str | None = None  # set while the model drains: why its streams go
        self._streams: dict[StreamKey, Stream] = {}
        self._lost: dict[StreamKey, tuple[str, float]] = {}  # key -> (reason, when)
        self.bound: StreamModel | None = None  # set while the model is loaded
        self.expired = 0  # streams freed for idleness
        self.lost_count = 0

    # ----------------------------------------------------------------- counts

    def open(self) -> int:
        return len(self._streams)

    def open_for(self, peer: bytes, uid: int | None) -> int:
        return sum(1 for k in self._streams if k[0] == peer and k[1] == uid)

    def nbytes(self) -> int:
        """Bytes the open streams hold (state and context): counted in the cache budget
        as the model's (daemon/budget.py)."""
        with self.lock:
            streams = list(self._streams.values())
        return sum(s.nbytes() for s in streams)

    # ----------------------------------------------------------------- admission

    def admit(self, item: Any, spec: StreamSpec, per_client: int,
              on_hold: Callable[[], None],
              room: tuple[int, int] | None = None) -> Admission | Reply:
        """Take a stream request (I/O thread, under the entry's lock): RUN (its stream is
        now busy with it), HELD (it waits behind an earlier chunk of its stream), or the
        reply to send now (an end without a chunk on an idle stream).

        Args:
            item: the request's Queued (its ``chunk`` is set here).
            spec: the model's [stream] table.
            per_client: the most streams one client may have open on this model.
            on_hold: called (under the table's lock) when the request is held, before
                anything can hand it on: the entry counts it in flight.
            room: (the cache budget, the bytes it counts in use now) for a start, or
                None (no budget): a new stream whose state does not fit is refused.

        Raises:
            InferdError: FAILED_PRECONDITION (not started, or lost: why),
                RESOURCE_EXHAUSTED (a limit on open streams, no room in the budget).
        """
        with self.lock:
            return self._admit(item, spec, per_client, on_hold, room)

    def _admit(self, item: Any, spec: StreamSpec, per_client: int,
               on_hold: Callable[[], None],
               room: tuple[int, int] | None) -> Admission | Reply:
        ref: StreamRef = item.request.stream
        ticket = item.ticket
        key: StreamKey = (ticket.peer, ticket.uid, ref.id)
        stream = self._streams.get(key)
        if stream is None:
            lost = self._lost.get(key)
            if not ref.start:
                if lost is not None:
                    if ref.end and not item.request.inputs and not item.request.pending:
                        del self._lost[key]  # ending a lost stream: nothing left to free
                        return Reply(item.request.id)
                    raise lost_error(ref.id, self.model, lost[0])
                raise not_started(ref.id, self.model)
            if len(self._streams) >= spec.max_streams:
                raise InferdError(f"model {self.model}: {len(self._streams)} streams are "
                                  f"open, its limit (max_streams = {spec.max_streams} in its "
                                  f"model.toml [stream])", ErrorCode.RESOURCE_EXHAUSTED)
            mine = self.open_for(key[0], key[1])
            if mine >= per_client:
                raise InferdError(f"model {self.model}: this client has {mine} streams "
                                  f"open, the limit per client ([streams] max_per_client = "
                                  f"{per_client} in inferd.toml)",
                                  ErrorCode.RESOURCE_EXHAUSTED)
            self._check_room(room)
            self._lost.pop(key, None)
            stream = Stream(key, f"stream {ref.id} of {self.model}")
            self._streams[key] = stream
        item.chunk = Chunk(stream, ref)
        stream.used_at = time.monotonic()
        if stream.busy:
            stream.held.append(item)
            on_hold()
            return Admission.HELD
        return self._take(stream, item)

    def _check_room(self, room: tuple[int, int] | None) -> None:
        """Refuse a new stream whose state does not fit in the cache budget beside what
        it counts now (``room``). Unchecked while the model is not loaded (its state's
        size is not known yet): the start that loads it is counted once it runs."""
        if room is None or self.bound is None:
            return
        budget, used = room
        need = self.bound.state_bytes()
        if used + need > budget:
            raise InferdError(f"model {self.model}: no room for a new stream's state "
                              f"({need} bytes) in the cache budget ([cache] max_memory = "
                              f"{budget} bytes, {used} in use); end streams, unload "
                              f"models or raise the budget", ErrorCode.RESOURCE_EXHAUSTED)

    def _take(self, stream: Stream, item: Any) -> Admission | Reply:
        """``item`` is its stream's next request: RUN, or the reply of an end without a
        chunk (the stream is freed). Raises for a lost stream (freed from the table)."""
        ref = item.chunk.ref
        if stream.lost is not None and not ref.start:
            self._forget(stream, stream.lost)
            if ref.end and not item.request.inputs and not item.request.pending:
                self._lost.pop(stream.key, None)
                return Reply(item.request.id)
            raise lost_error(ref.id, self.model, stream.lost)
        if ref.end and not item.request.inputs and not item.request.pending:
            self._free(stream)
            return Reply(item.request.id)
        stream.busy = True
        return Admission.RUN

    def finished(self, item: Any, ok: bool) -> list[tuple[Any, Reply | None]]:
        """``item``'s reply was sent (``ok``: the client got its outputs). Settles its
        stream (lost if its run did not end in that reply; freed if it was its end) and
        hands over the stream's next held request: [(item, None)] to queue it, or
        (item, reply) to answer it now (it may be followed by more)."""
        with self.lock:
            return self._finished(item, ok)

    def _finished(self, item: Any, ok: bool) -> list[tuple[Any, Reply | None]]:
        chunk: Chunk = item.chunk
        stream = chunk.stream
        mine = self._streams.get(stream.key) is stream
        if chunk.ran and not (ok and chunk.committed):
            stream.lost = chunk.reason or f"chunk {chunk.number} failed"
            self.lost_count += 1
            log.info("%s: state lost (%s)", stream.name, stream.lost,
                     extra={"MODEL": self.model})
        elif not chunk.ran and chunk.ref.start and not stream.started and mine:
            # a start refused before it ran: the stream never began
            self._streams.pop(stream.key, None)
        if mine and stream.lost is not None:
            self._forget(stream, stream.lost)  # its next request is told why
        elif mine and ok and chunk.ref.end:
            self._free(stream)
        stream.busy = False
        stream.used_at = time.monotonic()
        out: list[tuple[Any, Reply | None]] = []
        if self.closing is not None and stream.held:  # the model is going: nothing runs
            if self._streams.get(stream.key) is stream:
                self._forget(stream, self.closing)
            reason = self._lost.get(stream.key, (self.closing, 0.0))[0]
            while stream.held:
                nxt = stream.held.popleft()
                out.append((nxt, Reply(nxt.request.id, error=_failure(
                    lost_error(nxt.chunk.ref.id, self.model, reason)))))
            return out
        while stream.held:
            nxt = stream.held.popleft()
            if self._streams.get(stream.key) is not stream:
                # ended, lost or never begun: the held request finds what a new one
                # would; a start makes a new stream, which holds the rest
                answer = self._orphan(nxt)
                out.append((nxt, answer))
                if answer is None:
                    nxt.chunk.stream.held.extend(stream.held)
                    stream.held.clear()
                    break
                continue
            try:
                taken = self._take(stream, nxt)
            except InferdError as e:
                out.append((nxt, Reply(nxt.request.id, error=_failure(e))))
                continue
            if isinstance(taken, Reply):
                out.append((nxt, taken))
                continue
            out.append((nxt, None))
            break
        return out

    def _orphan(self, item: Any) -> Reply | None:
        """A held request whose stream ended meanwhile: it starts a new one (None: it
        runs; its stream is the new one), or gets what an unknown id gets."""
        ref = item.chunk.ref
        if ref.start:
            stream = Stream(item.chunk.stream.key, f"stream {ref.id} of {self.model}")
            self._streams[stream.key] = stream
            item.chunk = Chunk(stream, ref)
            stream.busy = True
            return None
        if ref.end and not item.request.inputs:
            return Reply(item.request.id, error=_failure(not_started(ref.id, self.model)))
        lost = self._lost.get(item.chunk.stream.key)
        return Reply(item.request.id, error=_failure(
            lost_error(ref.id, self.model, lost[0]) if lost else not_started(ref.id,
                                                                              self.model)))

    def release(self, item: Any) -> None:
        """``item`` was admitted RUN but could not be queued (a full queue, a stop): its
        stream is free again and nothing was lost."""
        with self.lock:
            self._release(item)

    def _release(self, item: Any) -> None:
        chunk: Chunk = item.chunk
        chunk.stream.busy = False
        if chunk.ref.start and not chunk.stream.started:
            self._streams.pop(chunk.stream.key, None)

    def _free(self, stream: Stream) -> None:
        self._streams.pop(stream.key, None)
        stream.state, stream.context = {}, {}

    def _forget(self, stream: Stream, reason: str, now: float | None = None) -> None:
        """A lost stream leaves the table; its key remembers why (since ``now``)."""
        self._free(stream)
        self._lost[stream.key] = (reason, time.monotonic() if now is None else now)
        while len(self._lost) > LOST_KEPT:
            del self._lost[next(iter(self._lost))]

    # ----------------------------------------------------------------- loss and idleness

    def adopt_lost(self, retired: StreamTable) -> None:
        """Remember the streams lost with ``retired`` (a version this table's replaced):
        their next request, which comes here, is told why they were lost."""
        with retired.lock:
            lost = dict(retired._lost)
        with self.lock:
            for key, why in lost.items():
                if key not in self._streams:
                    self._lost.setdefault(key, why)
            while len(self._lost) > LOST_KEPT:
                del self._lost[next(iter(self._lost))]

    def lose_all(self, reason: str) -> int:
        """Every open stream's state is gone (the model was unloaded): each is answered
        ``reason`` at its next request. Returns how many were open."""
        with self.lock:
            self.closing = None
            return self._lose_all(reason)

    def _lose_all(self, reason: str) -> int:
        count = 0
        for stream in list(self._streams.values()):
            count += 1
            if stream.busy:  # its chunk is still answered; the loss waits for it
                stream.lost = stream.lost or reason
                stream.state, stream.context = {}, {}
                # known now, for the version that replaces this one (adopt_lost)
                self._lost[stream.key] = (stream.lost, time.monotonic())
                continue
            self._forget(stream, stream.lost or reason)
        if count:
            self.lost_count += count
            log.info("model %s: %d open streams lost (%s)", self.model, count, reason,
                     extra={"MODEL": self.model})
        return count

    def expire(self, now: float, idle_timeout_s: float) -> list[str]:
        """Free the streams idle (nothing queued or running) longer than
        ``idle_timeout_s``; the names of those freed (each logged once)."""
        with self.lock:
            return self._expire(now, idle_timeout_s)

    def _expire(self, now: float, idle_timeout_s: float) -> list[str]:
        gone = []
        for stream in list(self._streams.values()):
            if stream.busy or now - stream.used_at < idle_timeout_s:
                continue
            idle = now - stream.used_at
            if stream.lost is None:
                self.expired += 1
                log.info("%s freed: idle for %.1f s (idle_timeout_s = %g in its model.toml "
                         "[stream])", stream.name, idle, idle_timeout_s,
                         extra={"MODEL": self.model})
            self._forget(stream, stream.lost or f"idle for {idle_timeout_s:g} s", now)
            gone.append(stream.name)
        horizon = now - max(idle_timeout_s, 60.0)
        for key, (_, when) in list(self._lost.items()):
            if when < horizon:
                del self._lost[key]
        return gone

    # ----------------------------------------------------------------- a chunk's run

    def bind(self, item: Any, values: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """The model's inputs for ``item``'s chunk (``values``: the request's inputs, pre
        steps applied): its chunk with the context in front, the stream's state and
        constants. Changes nothing.

        Raises:
            InferdError: INVALID_ARGUMENT (a wrong chunk, a missing or changed constant;
                nothing is lost), FAILED_PRECONDITION (the stream was lost meanwhile).
        """
        chunk: Chunk = item.chunk
        stream = chunk.stream
        bound = self.bound
        if bound is None:  # the model went away between admission and run
            raise lost_error(chunk.ref.id, self.model, "model unloaded")
        if stream.lost is not None and not chunk.ref.start:
            raise lost_error(chunk.ref.id, self.model, stream.lost)
        start = chunk.ref.start
        where = stream.name
        out: dict[str, NDArray[Any]] = {}
        if not bound.state_inputs.isdisjoint(values):
            for name in bound.state_inputs:
                if name in values:
                    raise InferdError(f"{where}: input {name!r} is the stream's state, "
                                      f"which the daemon keeps; do not send it",
                                      ErrorCode.INVALID_ARGUMENT)
        for name in bound.constant_names:
            given = values.get(name)
            if given is not None:
                allowed = bound.allowed.get(name)
                want = bound.dtypes[name]
                if dtype_name(given) != want:
                    raise InferdError(f"{where}: constant {name!r} is {dtype_name(given)}"
                                      f"{list(given.shape)}, expected {want}",
                                      ErrorCode.INVALID_ARGUMENT)
                if allowed is not None and not (given.size == 1 and given.reshape(-1)[0]
                                                in allowed):
                    raise InferdError(f"{where}: constant {name!r} = {_show(given)}; this "
                                      f"model's streams take {list(allowed)}",
                                      ErrorCode.INVALID_ARGUMENT)
                if not start:
                    kept = stream.constants[name]
                    if kept.shape != given.shape or not np.array_equal(kept, given):
                        raise InferdError(f"{where}: constant {name!r} = {_show(given)} "
                                          f"differs from the {_show(kept)} given at its "
                                          f"start; a constant cannot change within a "
                                          f"stream (start it again)",
                                          ErrorCode.INVALID_ARGUMENT)
                out[name] = given
            elif start:
                raise InferdError(f"{where}: constant input {name!r} missing at its start "
                                  f"(constants: {bound.constant_names})",
                                  ErrorCode.INVALID_ARGUMENT)
            else:
                out[name] = stream.constants[name]
        shapes = chunk.shapes
        for name, value in values.items():
            if name in out:
                continue
            if name not in bound.dtypes:
                raise InferdError(f"{where}: unknown input {name!r}; a chunk takes "
                                  f"{bound.chunk_inputs}", ErrorCode.INVALID_ARGUMENT)
            got = value.shape
            if type(got) is not tuple:
                got = tuple(got)
            want_shape = bound.chunk.get(name) or (
                None if start else stream.chunk_shapes.get(name))
            if want_shape is not None and got != want_shape:
                said = ("in its model.toml [stream] chunk" if name in bound.chunk
                        else "by its start")
                raise InferdError(f"{where}: chunk input {name!r} is {dtype_name(value)}"
                                  f"{list(got)}; this stream's chunks are "
                                  f"{bound.dtypes[name]}{list(want_shape)} (set {said})",
                                  ErrorCode.INVALID_ARGUMENT)
            out[name] = value
            shapes[name] = got
        for c in bound.spec.contexts:
            fresh = out.get(c.input)
            if fresh is None:
                continue  # check_inputs names what is missing
            if (fresh.dtype != bound.context_dtypes[c.input]
                    and dtype_name(fresh) != bound.dtypes[c.input]) or fresh.ndim <= c.axis:
                continue  # likewise for a wrong dtype or rank
            ctx = None if start else stream.context.get(c.input)
            if ctx is None:
                zeros = list(fresh.shape)
                zeros[c.axis] = c.size
                ctx = np.zeros(zeros, fresh.dtype)
            out[c.input] = np.concatenate([ctx, fresh], axis=c.axis)
        for name, init in bound.init.items():
            state = None if start else stream.state.get(name)
            out[name] = init if state is None else state
        chunk.number = 1 if start else stream.chunks + 1
        return out

    def commit(self, item: Any, inputs: dict[str, NDArray[Any]],
               outputs: dict[str, Any]) -> dict[str, Any]:
        """Keep the state outputs of ``item``'s chunk (run on ``inputs``) and the new
        context; the outputs the client gets (the state outputs taken out)."""
        chunk: Chunk = item.chunk
        stream = chunk.stream
        bound = self.bound
        if bound is None:  # a run given up by the drain ended after the unload
            raise lost_error(chunk.ref.id, self.model, "model unloaded")
        state = {}
        for s in bound.spec.states:
            value = outputs.get(s.output)
            if value is None:
                raise ModelError(f"{stream.name}: the model gave no state output "
                                 f"{s.output!r}")
            state[s.input] = np.array(value, copy=True)  # ours, not the engine's buffer
        context = {}
        for c in bound.spec.contexts:
            full = inputs[c.input]  # the context and the chunk, as bind made it
            n = full.shape[c.axis]
            # its last c.size along the axis: a copy (not a view that keeps all of it)
            context[c.input] = full[(slice(None),) * c.axis + (slice(n - c.size, n),)].copy()
        if chunk.ref.start:
            stream.constants = {n: np.array(inputs[n], copy=True)
                                for n in bound.constant_names}
            stream.chunk_shapes = dict(chunk.shapes)
            stream.chunks = 0
            stream.lost = None
            stream.started = True
        stream.state, stream.context = state, context
        stream.chunks += 1
        chunk.committed = True
        return {k: v for k, v in outputs.items() if k not in bound.state_outputs}

    def wanted(self, wanted: list[str] | None) -> list[str] | None:
        """The outputs to ask the engine for a chunk: the client's and the states'."""
        if wanted is None or self.bound is None:
            return wanted
        return list(wanted) + [o for o in self.bound.state_outputs if o not in wanted]

    def drop_peer(self, peer: bytes) -> list[Any]:
        """A client disconnected: free its streams (one log line); the requests they
        held (to be answered CANCELLED by the caller, as its queued ones are). A chunk
        of one that is running finishes; its reply finds no client."""
        with self.lock:
            held: list[Any] = []
            mine = [s for k, s in self._streams.items() if k[0] == peer]
            freed = sum(s.nbytes() for s in mine)
            for stream in mine:
                held += stream.held
                stream.held.clear()
                self._free(stream)
            for key in [k for k in self._lost if k[0] == peer]:
                del self._lost[key]
        if mine:
            log.info("model %s: %d streams of a client that disconnected freed (%d bytes)",
                     self.model, len(mine), freed, extra={"MODEL": self.model})
        return held

    def describe(self) -> dict[str, Any]:
        return {"open": len(self._streams), "bytes": self.nbytes(),
                "expired": self.expired, "lost": self.lost_count}


# --------------------------------------------------------------------------- batching

def batchable(bound: StreamModel, inputs: Any) -> bool:
    """Whether chunks of different streams can run as one batch: every chunk input's
    first dimension and every state input's batch axis are free in the model."""
    def free(shape: tuple[Any, ...], axis: int) -> bool:
        return len(shape) > axis and not (isinstance(shape[axis], int) and shape[axis] >= 0)
    by_name = {t.name: t for t in inputs}
    return (all(free(by_name[n].shape, 0) for n in bound.chunk_inputs)
            and all(free(by_name[s.input].shape, s.axis) for s in bound.spec.states))


def signature(bound: StreamModel, values: dict[str, NDArray[Any]]) -> tuple[Any, ...]:
    """What chunks must share to run in one batch: every tensor's dtype and shape but
    its batch axis, and the constants' values."""
    axes = bound.state_axes
    out: list[Any] = []
    for name in sorted(values):
        v = values[name]
        if name in bound.allowed:
            out.append((name, v.dtype, v.shape, v.tobytes()))
        else:
            axis = axes.get(name, 0)
            out.append((name, v.dtype, v.shape[:axis] + v.shape[axis + 1:]))
    return tuple(out)


def rows(bound: StreamModel, values: dict[str, NDArray[Any]]) -> int:
    """The batch rows of one chunk's inputs (its first chunk input's first dimension)."""
    for name in bound.chunk_inputs:
        v = values.get(name)
        if v is not None and v.ndim:
            return int(v.shape[0])
    return 1


def merge(bound: StreamModel, parts: list[dict[str, NDArray[Any]]]) -> dict[str, NDArray[Any]]:
    """One batch's inputs from chunks of different streams (each bound: context in
    front, its own state): chunk inputs stacked on axis 0, states on their batch axis,
    constants (equal: :func:`signature`) once."""
    axes = bound.state_axes
    merged = {}
    for name, first in parts[0].items():
        if name in bound.allowed:
            merged[name] = first
        else:
            merged[name] = np.concatenate([p[name] for p in parts], axis=axes.get(name, 0))
    return merged


def split(bound: StreamModel, outputs: dict[str, Any], counts: list[int]
          ) -> list[dict[str, Any]]:
    """Each chunk's outputs of a merged run: state outputs cut along their batch axis,
    the others along axis 0.

    Raises:
        ModelError: an output that does not keep the batch on its axis.
    """
    axes = bound.output_axes
    total = sum(counts)
    for name, v in outputs.items():
        axis = axes.get(name, 0)
        if v.ndim <= axis or v.shape[axis] != total:
            raise ModelError(f"model {bound.label}: output {name!r} is {list(v.shape)}, "
                             f"not {total} rows on axis {axis}")
    cut = [(k, v, (slice(None),) * axes.get(k, 0)) for k, v in outputs.items()]
    out: list[dict[str, Any]] = []
    start = 0
    for n in counts:
        part = slice(start, start + n)
        out.append({k: v[lead + (part,)] for k, v, lead in cut})
        start += n
    return out


def batch_inputs(bound: StreamModel, inputs: Any, sizes: list[int]
                 ) -> dict[int, dict[str, NDArray[Any]]]:
    """The inputs of a merged batch of stream chunks for each of ``sizes`` (rows), as
    that many streams' first chunks would make them: zeros with the context in front,
    the initial states, each constant's first allowed value; for sizing each batch's
    working memory before chunks come (:meth:`ModelThreads.warm_up`). Empty where a
    chunk's shapes are not all known: a chunk input that the ``[stream]`` table's
    ``chunk`` does not give, a constant whose shape the model leaves free, or an integer
    constant without its allowed values (a value may choose a branch of the graph).
    A size that is not a whole number of chunks is left out.

    Args:
        bound: the model's [stream] table bound to it.
        inputs: the model's input specs (name, dtype, shape).
        sizes: the batch sizes, in rows.
    """
    by_name = {t.name: t for t in inputs}
    row: dict[str, NDArray[Any]] = {}
    contexts = {c.input: c for c in bound.spec.contexts}
    try:
        for name in bound.chunk_inputs:
            shape = bound.chunk.get(name)
            if shape is None:
                return {}
            full = list(shape)
            c = contexts.get(name)
            if c is not None:
                if c.axis >= len(full):
                    return {}
                full[c.axis] += c.size
            row[name] = np.zeros(full, numpy_dtype(bound.dtypes[name]))
        for name in bound.constant_names:
            dims = by_name[name].shape
            if not all(isinstance(d, int) and d >= 0 for d in dims):
                return {}
            dtype = numpy_dtype(bound.dtypes[name])
            allowed = bound.allowed.get(name)
            if allowed is None and dtype.kind in "iub":
                return {}
            row[name] = np.full(dims, allowed[0] if allowed else 0, dtype)
    except (InferdError, KeyError, TypeError, ValueError):
        return {}  # a dtype without numbers (strings), a shape numpy cannot make
    row.update(bound.init)
    per = rows(bound, row)
    if per < 1:  # a chunk of no rows: nothing to batch
        return {}
    return {n: merge(bound, [row] * (n // per)) for n in sizes if n >= per and n % per == 0}


def stream_loss(reason: str) -> str:
    """What a stream's next request is told when its model is unloaded for
    ``reason`` (the cache's words: daemon/models.py, daemon/reload.py)."""
    if reason.startswith("evicted"):
        return "evicted"
    if reason == "unload requested":
        return "model unloaded"
    if reason.startswith("idle for"):
        return f"model unloaded: {reason}"
    if reason == "daemon stopping":
        return "daemon stopping"
    return f"model reloaded: {reason}"


def _numpy_or_none(name: str) -> Any:
    """The numpy dtype of wire dtype ``name``, or None where it has none (strings)."""
    try:
        return numpy_dtype(name)
    except InferdError:
        return None


def _show(value: NDArray[Any]) -> str:
    return str(value.reshape(-1)[0]) if value.size == 1 else f"{value.dtype}{list(value.shape)}"


def _failure(e: InferdError) -> Any:
    from inferd.ipc.errors import Failure

    return Failure(e.code, e.message)
