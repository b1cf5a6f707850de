"""The two graph executors, and how graph nodes call models.

* **task-parallel** (:class:`TaskExecutor`): per request, a node is submitted to the
  graph's thread pool as soon as all its producers have finished.
* **pipeline-parallel** (:class:`PipelineExecutor`): one thread per node
  (``inferd-<graph>-<node>``), frames flowing through bounded :class:`Edge` s; an edge
  with several consumers keeps each packet until every consumer has taken it; a full
  edge blocks its producer (backpressure).

Model nodes call models in-process through the model manager with a
:class:`~inferd.ipc.replies.LocalTicket`, so they share the models' pipelines,
queues and dynamic batching with wire clients. A pipeline graph stops by
:data:`~inferd.daemon.worker.STOP`'s rule: each node thread passes it on and ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from inferd.daemon.graph import (
    INPUT,
    GraphSpec,
    check_graph_inputs,
    gather,
    graph_outputs,
    run_node,
)
from inferd.daemon.pipeline import Placement, pin_current_thread
from inferd.daemon.worker import STOP
from inferd.ipc.errors import ErrorCode, InferdError, failure
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import LocalTicket, ReplySink

log = logging.getLogger(__name__)

_ids = itertools.count()


class ModelCaller:
    """Calls models in-process: ``caller(model, inputs, deadline) -> outputs``;
    ``caller.start(...)`` returns a wait function, so many calls can be in flight."""

    def __init__(self, submit: Callable[[Request, Any], None]) -> None:
        self._submit = submit

    def start(self, model: str, inputs: dict[str, Any],
              deadline: float | None) -> Callable[[], dict[str, Any]]:
        done = threading.Event()
        box: list[Reply] = []

        def deliver(reply: Reply) -> None:
            box.append(reply)
            done.set()
        rid = f"graph-{next(_ids)}"
        timeout_ms = None if deadline is None else max(1, int((deadline - time.monotonic())
                                                              * 1000))
        request = Request(rid, Op.INFER, model=model, inputs=inputs, timeout_ms=timeout_ms)
        while True:  # a full model queue is backpressure here, not a failure
            try:
                self._submit(request, LocalTicket(rid, deliver, deadline, model=model))
                break
            except InferdError as e:
                if e.code is not ErrorCode.RESOURCE_EXHAUSTED or (
                        deadline is not None and time.monotonic() > deadline):
                    raise
                time.sleep(0.002)

        def wait() -> dict[str, Any]:
            done.wait()
            reply = box[0]
            if reply.error is not None:
                raise InferdError(f"model {model}: {reply.error.message}", reply.error.code)
            return reply.outputs
        return wait

    def __call__(self, model: str, inputs: dict[str, Any],
                 deadline: float | None) -> dict[str, Any]:
        return self.start(model, inputs, deadline)()


def _deadline(ticket: Any) -> float | None:
    return getattr(ticket, "deadline", None)


# --------------------------------------------------------------------------- task-parallel


class TaskExecutor:
    """Per request: nodes run on a shared pool as soon as their producers are done."""

    def __init__(self, spec: GraphSpec, call: ModelCaller, sink: ReplySink) -> None:
        self.spec = spec
        self._call = call
        self._sink = sink
        self.placements: list[Placement] = []
        self._pool = ThreadPoolExecutor(spec.task_threads,
                                        thread_name_prefix=f"inferd-{spec.name}-task",
                                        initializer=self._place)
        self._inflight = 0
        self._cond = threading.Condition()

    def _place(self) -> None:
        placement = Placement(threading.current_thread().name, "task")
        pin_current_thread(placement, self.spec.cpu_affinity, self.spec.name)
        with self._cond:
            self.placements.append(placement)

    def threads(self) -> list[str]:
        with self._cond:
            return [p.thread for p in self.placements]

    def submit(self, request: Request, ticket: Any) -> None:
        check_graph_inputs(self.spec, request)
        with self._cond:
            self._inflight += 1
        run = _TaskRun(self, request, ticket)
        run.start()

    def done(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def stop(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0, timeout)
            ok = self._inflight == 0
        self._pool.shutdown(wait=ok, cancel_futures=not ok)
        return ok


class _TaskRun:
    """One request through a task-parallel graph."""

    def __init__(self, ex: TaskExecutor, request: Request, ticket: Any) -> None:
        self.ex, self.request, self.ticket = ex, request, ticket
        self.packets: dict[str, dict[str, Any]] = {INPUT: dict(request.inputs)}
        self.waiting = {n.name: {p for p in n.producers if p != INPUT} for n in ex.spec.nodes}
        self.lock = threading.Lock()
        self.finished = False

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
            out = run_node(spec, node, gather(spec.name, node, self.packets), self.ex._call,
                           _deadline(self.ticket))
        except Exception as e:
            self._end(graph_failure(self.request, spec.name, e))
            return
        with self.lock:
            self.packets[name] = out
            ready = []
            for n, deps in self.waiting.items():
                deps.discard(name)
                if not deps:
                    ready.append(n)
            for n in ready:
                del self.waiting[n]
            complete = not self.waiting and all(n.name in self.packets for n in spec.nodes)
        if complete:
            try:
                self._end(Reply(self.request.id,
                                outputs=graph_outputs(spec, self.packets, self.request)))
            except Exception as e:
                self._end(graph_failure(self.request, spec.name, e))
            return
        self._launch(ready)

    def _end(self, reply: Reply) -> None:
        with self.lock:
            if self.finished:
                return
            self.finished = True
        self.ex._sink.send(self.ticket, reply)
        self.ex.done()


# --------------------------------------------------------------------------- pipeline


@dataclass
class Packet:
    """One frame's values on an edge, or the error that ended it upstream."""

    request: Request
    ticket: Any
    values: dict[str, Any] | None
    error: Reply | None = None


class Edge:
    """A bounded multi-consumer queue: each consumer sees every packet in order; a packet
    is dropped once every consumer has taken it; ``put`` blocks while ``capacity`` packets
    are still held."""

    def __init__(self, name: str, consumers: list[str], capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._buf: deque[Any] = deque()
        self._base = 0
        self._next = dict.fromkeys(consumers, 0)
        self._cond = threading.Condition()

    def put(self, packet: Any, block: bool = True) -> bool:
        with self._cond:
            while len(self._buf) >= self.capacity:
                if not block:
                    return False
                self._cond.wait()
            self._buf.append(packet)
            self._cond.notify_all()
            return True

    def get(self, consumer: str) -> Any:
        with self._cond:
            while self._next[consumer] - self._base >= len(self._buf):
                self._cond.wait()
            packet = self._buf[self._next[consumer] - self._base]
            self._next[consumer] += 1
            low = min(self._next.values())
            while self._base < low:
                self._buf.popleft()
                self._base += 1
            self._cond.notify_all()
            return packet

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
            self.edges[producer] = Edge(producer, consumers, spec.input_queue_size
                                        if producer == INPUT else spec.queue_size)
        self._sink_sources = sorted(sinks)
        self._threads = [threading.Thread(target=self._placed, args=(self._node_loop, n.name),
                                          name=f"inferd-{spec.name}-{n.name}", daemon=True)
                         for n in spec.nodes]
        self._threads.append(threading.Thread(target=self._placed, args=(self._sink_loop,),
                                              name=f"inferd-{spec.name}-output", daemon=True))
        self.placements = [Placement(t.name, "node") for t in self._threads]
        self.placements[-1].stage = "output"
        self._lock = threading.Lock()
        self._stopping = False
        for t in self._threads:
            t.start()

    def threads(self) -> list[str]:
        return [t.name for t in self._threads]

    def _placed(self, loop: Callable[..., None], *args: Any) -> None:
        me = threading.current_thread().name
        pin_current_thread(next(p for p in self.placements if p.thread == me),
                           self.spec.cpu_affinity, self.spec.name)
        loop(*args)

    def submit(self, request: Request, ticket: Any) -> None:
        check_graph_inputs(self.spec, request)
        with self._lock:
            if self._stopping:
                raise InferdError(f"graph {self.spec.name} is stopping", ErrorCode.UNAVAILABLE)
            if not self.edges[INPUT].put(Packet(request, ticket, dict(request.inputs)),
                                         block=False):
                raise InferdError(f"graph {self.spec.name}: queue is full "
                                  f"({self.spec.input_queue_size} frames waiting)",
                                  ErrorCode.RESOURCE_EXHAUSTED)

    def stop(self, timeout: float) -> bool:
        with self._lock:
            self._stopping = True
        self.edges[INPUT].put(STOP)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _node_loop(self, name: str) -> None:
        node = self.spec.node(name)
        sources = sorted(node.producers)
        out = self.edges[name]
        try:
            while True:
                packets = [self.edges[s].get(name) for s in sources]
                if any(p is STOP for p in packets):
                    out.put(STOP)
                    return
                first = packets[0]
                failed = next((p.error for p in packets if p.error is not None), None)
                if failed is not None:
                    out.put(Packet(first.request, first.ticket, None, failed))
                    continue
                try:
                    if first.ticket.expired():
                        raise InferdError(f"graph {self.spec.name}: deadline passed before "
                                          f"node {name}", ErrorCode.DEADLINE_EXCEEDED)
                    values = gather(self.spec.name, node,
                                    {s: p.values for s, p in zip(sources, packets)})
                    result = run_node(self.spec, node, values, self._call,
                                      _deadline(first.ticket))
                    out.put(Packet(first.request, first.ticket, result))
                except Exception as e:
                    out.put(Packet(first.request, first.ticket, None,
                                   graph_failure(first.request, self.spec.name, e)))
        finally:
            self._sink.release_thread()

    def _sink_loop(self) -> None:
        try:
            while True:
                packets = [self.edges[s].get(SINK) for s in self._sink_sources]
                if any(p is STOP for p in packets):
                    return
                first = packets[0]
                reply = next((p.error for p in packets if p.error is not None), None)
                if reply is None:
                    try:
                        reply = Reply(first.request.id, outputs=graph_outputs(
                            self.spec, {s: p.values for s, p in
                                        zip(self._sink_sources, packets)}, first.request))
                    except Exception as e:
                        reply = graph_failure(first.request, self.spec.name, e)
                self._sink.send(first.ticket, reply)
        finally:
            self._sink.release_thread()


def graph_failure(request: Request, graph: str, e: Exception) -> Reply:
    """The error reply for ``request`` of graph ``graph`` (see :func:`failure`)."""
    return Reply(request.id, error=failure(e, f"graph {graph}", log, named=False,
                                           model=graph))
