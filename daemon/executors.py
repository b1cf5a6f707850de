"""The two graph executors, and how graph nodes call models.

* **task-parallel** (:class:`TaskExecutor`): per request, a node is submitted to the
  graph's thread pool as soon as all its producers have finished.
* **pipeline-parallel** (:class:`PipelineExecutor`): one thread per node
  (``inferd-<graph>-<node>``), frames flowing through bounded :class:`Edge` s; an edge
  with several consumers keeps each packet until every consumer has taken it; a full
  edge blocks its producer (backpressure).

Model nodes call models in-process through :class:`ModelCaller`: each call is a
:class:`~inferd.ipc.replies.LocalTicket` in the model's own queue (its turns, its
batching, the request's deadline), answered into a ``concurrent.futures.Future``. A
model queue that is full makes the call wait for room, no longer than the deadline.

A node that never returns cannot hold the daemon: each thread notes the call it is in
(:class:`~inferd.daemon.model_threads.Busy`), ``stop`` gives up once one is inside a call past
``stuck_after`` seconds, and ``abandon`` leaves the stuck threads behind, answering the
frames they held. A pipeline graph stops by :data:`~inferd.daemon.model_threads.STOP`'s rule:
each node thread passes it on and ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.daemon.graph import (
    INPUT,
    GraphSpec,
    Node,
    check_graph_inputs,
    gather,
    graph_outputs,
    run_node,
)
from inferd.daemon.pipeline import Pinning, pin_current_thread
from inferd.daemon.stages import STOP, Busy, join_stages
from inferd.daemon.workers.pool import died_in_step
from inferd.daemon.workers.quarantine import Quarantine
from inferd.ipc.errors import ErrorCode, Failure, InferdError, failure
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import AnyTicket, LocalTicket, ReplySink

log = logging.getLogger(__name__)

_ids = itertools.count()


class ModelQueues(Protocol):
    """What a graph needs of the model manager: queue a request (refusing it with an
    InferdError), wait until a model's queue has room, and who keeps killing a worker
    (a processor node's deaths are charged there as a model's steps' are)."""

    quarantine: Quarantine

    def submit(self, ticket: AnyTicket) -> None: ...

    def wait_for_room(self, request: Request, timeout: float | None) -> bool: ...


class ModelCaller:
    """Calls models in-process: :meth:`submit` returns the call's future at once (many
    calls can be in flight), :meth:`result` waits for it within the deadline; and keeps
    the model manager's quarantine for the graph's own steps (:meth:`charge`,
    :meth:`check`)."""

    def __init__(self, models: ModelQueues) -> None:
        self._models = models
        self._quarantine = models.quarantine

    def charge(self, graph: str, ticket: AnyTicket, died: str) -> None:
        """A request of ``graph`` that a processor node's death ended (``died``, of
        :func:`died_of`) is charged to its client in the model manager's quarantine, as
        a model's pre/post step's death is (``ModelThreads._charge``): a client whose
        requests keep killing the processors worker is refused for the graph
        (:meth:`check`), a graph whose nodes kill it for several clients is set aside.
        Once per request: two of its nodes in the worker when it died are one death."""
        self._quarantine.death(graph, [ticket.uid], died)

    def check(self, graph: str, ticket: AnyTicket) -> None:
        """Raise the quarantine's refusal of ``ticket``'s client for ``graph``, if any."""
        self._quarantine.check(graph, ticket.uid)

    def set_aside(self, graph: str) -> str | None:
        """Why ``graph`` is set aside (its processor nodes killed the processors worker
        for several clients), or None."""
        return self._quarantine.set_aside.get(graph)

    def submit(self, model: str, inputs: dict[str, Any], deadline: float | None,
               peer: bytes = b"", uid: int | None = None) -> Future[dict[str, Any]]:
        """Queue one call of ``model`` as client ``peer``'s, of uid ``uid`` (monotonic
        ``deadline``).

        Raises:
            InferdError: the model refused it (unknown, failed to load), or its queue
                stayed full until the deadline (DEADLINE_EXCEEDED).
        """
        future: Future[dict[str, Any]] = Future()

        def deliver(reply: Reply) -> None:
            if reply.error is None:
                future.set_result(reply.outputs)
            else:
                future.set_exception(InferdError(f"model {model}: {reply.error.message}",
                                                 reply.error.code))
        now = time.monotonic()  # the call's deadline counts from here (its ticket's)
        timeout_ms = None if deadline is None else max(1, int((deadline - now) * 1000))
        request = Request(f"graph-{next(_ids)}", Op.INFER, model=model, inputs=inputs,
                          timeout_ms=timeout_ms)
        ticket = LocalTicket(request, deliver, now, peer=peer, uid=uid)
        while True:  # a full model queue is backpressure here, not a failure
            try:
                self._models.submit(ticket)
                return future
            except InferdError as e:
                if e.code is not ErrorCode.RESOURCE_EXHAUSTED:
                    raise
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self._models.wait_for_room(request,
                                                                                 left):
                raise InferdError(f"model {model}: deadline passed while its queue was full",
                                  ErrorCode.DEADLINE_EXCEEDED)

    @staticmethod
    def result(future: Future[dict[str, Any]], model: str,
               deadline: float | None) -> dict[str, Any]:
        """The call's outputs; raises its InferdError, or DEADLINE_EXCEEDED once the
        deadline passes (the model, whatever it is doing, is not waited for longer)."""
        try:
            return future.result(None if deadline is None
                                 else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise InferdError(f"model {model}: deadline passed before it answered",
                              ErrorCode.DEADLINE_EXCEEDED) from None


def died_of(node: Node, e: Exception) -> str | None:
    """What ended ``node``'s call, if it is a processor node whose step's processors
    worker died (:func:`run_node` raises from the WorkerDied of
    daemon/workers/steps.py); None for any other failure (a model node's death is the
    model's to charge)."""
    return died_in_step(e) if node.step is not None else None


RELEASED = object()
"""What a frame's value becomes once every node that reads it has it (task-parallel:
once they have all run; pipeline: once they have all taken it from the edge), so that
its array is not held until the frame's last node: the OCR detector's 18 MiB input is
let go when the detector has it, not when the last node reads the image's size."""


# --------------------------------------------------------------------------- task-parallel


class TaskExecutor:
    """Per request: nodes run on a shared pool as soon as their producers are done."""

    def __init__(self, spec: GraphSpec, call: ModelCaller, sink: ReplySink) -> None:
        self.spec = spec
        self._call = call
        self._sink = sink
        self.pinnings: list[Pinning] = []
        self.busy = Busy()
        self._pool = ThreadPoolExecutor(spec.task_threads,
                                        thread_name_prefix=f"inferd-{spec.name}-task",
                                        initializer=self._pin)
        self._runs: set[_TaskRun] = set()  # requests in flight
        self._cond = threading.Condition()

    def _pin(self) -> None:
        pinning = Pinning(threading.current_thread().name, "task")
        pin_current_thread(pinning, self.spec.cpu_affinity, self.spec.name)
        with self._cond:
            self.pinnings.append(pinning)

    def threads(self) -> list[str]:
        with self._cond:
            return [p.thread for p in self.pinnings]

    def submit(self, ticket: AnyTicket) -> None:
        check_graph_inputs(self.spec, ticket.request)
        run = _TaskRun(self, ticket)
        with self._cond:
            self._runs.add(run)
        run.start()

    def done(self, run: _TaskRun) -> None:
        with self._cond:
            self._runs.discard(run)
            self._cond.notify_all()

    def stop(self, timeout: float | None = None, stuck_after: float | None = None) -> bool:
        """Wait for the requests in flight (at most ``timeout`` s, and no longer than
        it takes a node to be inside one call for ``stuck_after`` s), then end the pool;
        True if every request finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._runs:
                now = time.monotonic()
                oldest = self.busy.oldest()
                if (deadline is not None and now >= deadline) or (
                        stuck_after is not None and oldest is not None
                        and now - oldest > stuck_after):
                    break
                waits = [t - now for t in (deadline, None if stuck_after is None else
                                           (oldest or now) + stuck_after) if t is not None]
                self._cond.wait(max(0.01, min(waits)) if waits else None)
            ok = not self._runs
        self._pool.shutdown(wait=ok, cancel_futures=not ok)
        return ok

    def stuck(self, after_s: float = 0.0) -> list[str]:
        """The pool threads inside one node's call for longer than ``after_s`` s."""
        return self.busy.stuck(after_s)

    def abandon(self) -> None:
        """Answer UNAVAILABLE every request still in flight (a stuck node holds them);
        the stuck threads end when their call returns."""
        with self._cond:
            runs, self._runs = list(self._runs), set()
        why = "; ".join(self.stuck()) or "a node did not end"
        for run in runs:
            run.end(Reply(run.request.id, error=Failure(
                ErrorCode.UNAVAILABLE, f"graph {self.spec.name} was stopped while a node "
                f"was stuck: {why}")))


class _TaskRun:
    """One request through a task-parallel graph."""

    def __init__(self, ex: TaskExecutor, ticket: AnyTicket) -> None:
        self.ex, self.ticket = ex, ticket
        self.packets: dict[str, dict[str, Any]] = {INPUT: dict(ticket.request.inputs)}
        self.waiting = {n.name: {p for p in n.producers if p != INPUT} for n in ex.spec.nodes}
        # the nodes still to read each value (the graph's outputs, read at the end, are
        # not counted): a value is released once they have all run
        outputs = set(ex.spec.outputs.values())
        self.readers: dict[tuple[str, str], int] = {}
        for n in ex.spec.nodes:
            for ref in set(n.inputs.values()) - outputs:
                self.readers[ref] = self.readers.get(ref, 0) + 1
        self.ran = 0  # nodes that finished
        self.lock = threading.Lock()
        self.finished = False

    @property
    def request(self) -> Request:
        return self.ticket.request

    def start(self) -> None:
        with self.lock:
            ready = [n for n, deps in self.waiting.items() if not deps]
            for n in ready:
                del self.waiting[n]
        self._launch(ready)

    def _launch(self, names: list[str]) -> None:
        for n in names:
            self.ex._pool.submit(self._run, n)

    def _run(self, name: str) -> None:
        spec = self.ex.spec
        node = spec.node(name)
        try:
            if self.finished:
                return
            if self.ticket.expired():
                raise InferdError(f"graph {spec.name}: deadline passed before node {name}",
                                  ErrorCode.DEADLINE_EXCEEDED)
            self.ex.busy.begin("task", f"node {name}, request {self.request.id}")
            try:
                out = run_node(spec, node, gather(spec.name, node, self.packets),
                               self.ex._call, self.ticket.deadline, self.ticket.peer,
                               self.ticket.uid)
            finally:
                self.ex.busy.end()
        except Exception as e:
            self.end(graph_failure(self.request, spec.name, e), died_of(node, e))
            return
        with self.lock:
            self.packets[name] = out
            for ref in set(node.inputs.values()):
                if ref in self.readers:
                    self.readers[ref] -= 1
                    if self.readers[ref] == 0:
                        src, value = ref
                        values = self.packets[src]
                        if value in values.keys():  # not an EmptyLists' any key
                            self.packets[src] = {**values, value: RELEASED}
            ready = []
            for n, deps in self.waiting.items():
                deps.discard(name)
                if not deps:
                    ready.append(n)
            for n in ready:
                del self.waiting[n]
            self.ran += 1
            complete = self.ran == len(spec.nodes)
        if complete:
            try:
                self.end(Reply(self.request.id,
                               outputs=graph_outputs(spec, self.packets, self.request)))
            except Exception as e:
                self.end(graph_failure(self.request, spec.name, e))
            return
        self._launch(ready)

    def end(self, reply: Reply, died: str | None = None) -> None:
        """Answer the request (once: the first reply wins); ``died``: the processor
        node's death that ended it, charged to its client."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
        if died is not None:
            self.ex._call.charge(self.ex.spec.name, self.ticket, died)
        self.ex._sink.send(self.ticket, reply)
        self.ex.done(self)


# --------------------------------------------------------------------------- pipeline


@dataclass
class Packet:
    """One frame's values on an edge, or the error that ended it upstream."""

    ticket: AnyTicket
    values: dict[str, Any] | None
    error: Reply | None = None
    died: str | None = None
    """With ``error``: the processor node's death that ended the frame (charged to its
    client once, by the sink)."""

    @property
    def request(self) -> Request:
        """The frame's request (its ticket's)."""
        return self.ticket.request


class EdgeClosed(Exception):
    """A packet put on an edge that :meth:`Edge.close` closed."""


class Edge:
    """A bounded multi-consumer queue: each consumer sees every packet in order; a packet
    is dropped once every consumer has taken it; ``put`` blocks while ``capacity`` packets
    are still held (:data:`STOP` never waits for room).

    ``reads`` (consumer -> the values it reads; a consumer not named reads all): a
    consumer is given a :class:`Packet` with only the values it reads (the others
    :data:`RELEASED`: it may hold the packet while it waits on its other edges), and
    once the consumers that read a value have taken the packet, the copy the edge still
    holds for the others lets it go too."""

    def __init__(self, name: str, consumers: list[str], capacity: int,
                 reads: dict[str, frozenset[str]] | None = None) -> None:
        self.name = name
        self.capacity = capacity
        self._buf: deque[Any] = deque()
        self._base = 0
        self._next = dict.fromkeys(consumers, 0)
        self._reads = reads or {}
        self._cond = threading.Condition()
        self._closed = False

    def put(self, packet: Any, block: bool = True, timeout: float | None = None) -> bool:
        """Append ``packet``, waiting for room up to ``timeout`` s (None: as long as it
        takes); False if there was none (not ``block``, or the time passed).

        Raises:
            EdgeClosed: the edge was closed (before or while waiting).
        """
        with self._cond:
            if packet is not STOP:
                if not self._cond.wait_for(lambda: self._closed or len(self._buf) <
                                           self.capacity, timeout if block else 0):
                    return False
                if self._closed:
                    raise EdgeClosed(self.name)
            elif self._closed:
                return True  # its readers end anyway
            self._buf.append(packet)
            self._cond.notify_all()
            return True

    def wait_for_room(self) -> None:
        """Wait until a put would not block (or the edge is closed): a producer asks
        before it takes its next frame, so that it never holds a finished one it cannot
        put (with ``capacity`` 1, one frame waits for the consumer, not two)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._buf) < self.capacity)

    def get(self, consumer: str) -> Any:
        """The consumer's next packet; :data:`STOP` once the edge is closed."""
        with self._cond:
            while not self._closed and self._next[consumer] - self._base >= len(self._buf):
                self._cond.wait()
            if self._closed:
                return STOP
            at = self._next[consumer] - self._base
            packet = self._buf[at]
            self._next[consumer] += 1
            if self._reads and isinstance(packet, Packet) and packet.values:
                self._buf[at] = self._keeping(packet, self._waiting(at + self._base))
                packet = self._keeping(packet, [consumer])
            low = min(self._next.values())
            while self._base < low:
                self._buf.popleft()
                self._base += 1
            self._cond.notify_all()
            return packet

    def _waiting(self, index: int) -> list[str]:
        """The consumers that have not taken packet ``index`` yet."""
        return [c for c, n in self._next.items() if n <= index]

    def _keeping(self, packet: Packet, consumers: list[str]) -> Packet:
        """``packet`` with only the values ``consumers`` read (the others
        :data:`RELEASED`); the same packet if they read all it holds."""
        if any(c not in self._reads for c in consumers):
            return packet
        keep = frozenset().union(*(self._reads[c] for c in consumers))
        values = packet.values or {}
        if all(k in keep or v is RELEASED for k, v in values.items()):
            return packet
        return Packet(packet.ticket,
                      {k: v if k in keep else RELEASED for k, v in values.items()},
                      packet.error, packet.died)

    def close(self) -> list[Any]:
        """Close the edge: every packet still held is returned (for the caller to
        answer), puts raise :class:`EdgeClosed`, and gets return :data:`STOP`."""
        with self._cond:
            self._closed = True
            held = [p for p in self._buf if p is not STOP]
            self._buf.clear()
            self._cond.notify_all()
            return held

    def held(self) -> int:
        with self._cond:
            return len(self._buf)


SINK = "<output>"


class PipelineExecutor:
    """One thread per node; a sink thread answers each frame in order."""

    def __init__(self, spec: GraphSpec, call: ModelCaller, sink: ReplySink) -> None:
        self.spec = spec
        self._call = call
        self._sink = sink
        sinks = {src for src, _ in spec.outputs.values()}
        self.edges: dict[str, Edge] = {}
        for producer in [INPUT, *[n.name for n in spec.nodes]]:
            consumers = spec.consumers(producer) + ([SINK] if producer in sinks else [])
            reads = {n.name: frozenset(v for src, v in n.inputs.values() if src == producer)
                     for n in spec.nodes if producer in n.producers}
            reads[SINK] = frozenset(v for src, v in spec.outputs.values() if src == producer)
            self.edges[producer] = Edge(producer, consumers, spec.input_queue_size
                                        if producer == INPUT else spec.queue_size, reads)
        self._sink_sources = sorted(sinks)
        self.busy = Busy()
        self._threads = [threading.Thread(target=self._placed, args=(self._node_loop, n.name),
                                          name=f"inferd-{spec.name}-{n.name}", daemon=True)
                         for n in spec.nodes]
        self._threads.append(threading.Thread(target=self._placed, args=(self._sink_loop,),
                                              name=f"inferd-{spec.name}-output", daemon=True))
        self.pinnings = [Pinning(t.name, "node") for t in self._threads]
        self.pinnings[-1].stage = "output"
        self._lock = threading.Lock()
        self._stopping = False
        self._why = ""  # what abandon() found stuck
        for t in self._threads:
            t.start()

    def threads(self) -> list[str]:
        return [t.name for t in self._threads]

    def _placed(self, loop: Callable[..., None], *args: Any) -> None:
        me = threading.current_thread().name
        pin_current_thread(next(p for p in self.pinnings if p.thread == me),
                           self.spec.cpu_affinity, self.spec.name)
        loop(*args)

    def submit(self, ticket: AnyTicket) -> None:
        request = ticket.request
        check_graph_inputs(self.spec, request)
        with self._lock:
            if self._stopping:
                raise InferdError(f"graph {self.spec.name} is stopping", ErrorCode.UNAVAILABLE)
            if not self.edges[INPUT].put(Packet(ticket, dict(request.inputs)),
                                         block=False):
                raise InferdError(f"graph {self.spec.name}: queue is full "
                                  f"({self.spec.input_queue_size} frames waiting)",
                                  ErrorCode.RESOURCE_EXHAUSTED)

    def stop(self, timeout: float | None = None, stuck_after: float | None = None) -> bool:
        """Send :data:`STOP` through the nodes (never blocking) and wait for the threads
        to end: at most ``timeout`` s, and no longer than it takes a node to be inside
        one call for ``stuck_after`` s. True if every thread ended."""
        with self._lock:
            self._stopping = True
        self.edges[INPUT].put(STOP)
        return join_stages(self._threads, self.busy, timeout, stuck_after)

    def stuck(self, after_s: float = 0.0) -> list[str]:
        """The node threads inside one call for longer than ``after_s`` s."""
        return self.busy.stuck(after_s)

    def abandon(self) -> None:
        """Give up on node threads that :meth:`stop` could not end: every edge is closed
        and the frames it held are answered UNAVAILABLE naming the stuck node; threads
        waiting on an edge end, a stuck one when its call returns."""
        self._why = "; ".join(self.stuck()) or "a node did not end"
        held = self.busy.held()
        for edge in self.edges.values():
            held += edge.close()
        self._give_up(held)

    def _give_up(self, packets: list[Any]) -> None:
        """Answer the frames of ``packets`` UNAVAILABLE (a frame already answered, as
        most are when several edges held it, is dropped by the sink)."""
        for p in packets:
            if isinstance(p, Packet):
                self._sink.send(p.ticket, Reply(p.request.id, error=Failure(
                    ErrorCode.UNAVAILABLE, f"graph {self.spec.name} was stopped while a "
                    f"node was stuck: {self._why}")))

    def _node_loop(self, name: str) -> None:
        node = self.spec.node(name)
        sources = sorted(node.producers)
        out = self.edges[name]
        while True:
            out.wait_for_room()
            packets = [self.edges[s].get(name) for s in sources]
            if any(p is STOP for p in packets):
                self._give_up(packets)  # taken from an edge closed meanwhile: answered
                out.put(STOP)
                return
            result = self._step(name, node, sources, packets)
            del packets  # not held while this node waits for its next frame
            try:
                out.put(result)
            except EdgeClosed:  # abandoned while this node ran (see abandon)
                self._give_up([result])
                return
            del result

    def _step(self, name: str, node: Node, sources: list[str], packets: list[Packet]
              ) -> Packet:
        """One frame through one node: its result packet, or the error that ends it."""
        first = packets[0]
        failed = next((p for p in packets if p.error is not None), None)
        if failed is not None:
            return Packet(first.ticket, None, failed.error, failed.died)
        try:
            if first.ticket.expired():
                raise InferdError(f"graph {self.spec.name}: deadline passed before node "
                                  f"{name}", ErrorCode.DEADLINE_EXCEEDED)
            values = gather(self.spec.name, node, {s: p.values for s, p in zip(sources,
                                                                                packets)})
            self.busy.begin("node", f"request {first.request.id}", (first,))
            try:
                result = run_node(self.spec, node, values, self._call,
                                  first.ticket.deadline, first.ticket.peer,
                                  first.ticket.uid)
            finally:
                self.busy.end()
            return Packet(first.ticket, result)
        except Exception as e:
            return Packet(first.ticket, None,
                          graph_failure(first.request, self.spec.name, e), died_of(node, e))

    def _sink_loop(self) -> None:
        while True:
            packets = [self.edges[s].get(SINK) for s in self._sink_sources]
            if any(p is STOP for p in packets):
                return
            first = packets[0]
            reply = next((p.error for p in packets if p.error is not None), None)
            died = next((p.died for p in packets if p.died is not None), None)
            if died is not None:  # once per frame, however many of its nodes it ended
                self._call.charge(self.spec.name, first.ticket, died)
            if reply is None:
                try:
                    reply = Reply(first.request.id, outputs=graph_outputs(
                        self.spec, {s: p.values for s, p in
                                    zip(self._sink_sources, packets)}, first.request))
                except Exception as e:
                    reply = graph_failure(first.request, self.spec.name, e)
            self._sink.send(first.ticket, reply)
            del packets, first, reply  # not held while the next frame is awaited


def graph_failure(request: Request, graph: str, e: Exception) -> Reply:
    """The error reply for ``request`` of graph ``graph`` (see :func:`failure`)."""
    return Reply(request.id, error=failure(e, f"graph {graph}", log, named=False,
                                           model=graph))
