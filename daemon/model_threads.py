"""The per-model pipeline: pre-process -> infer -> post-process, each stage its own
named thread, stages joined by bounded fair queues, so that while request N is
post-processed, N+1 is inferred and N+2 pre-processed.

The inference stage has ``instances`` threads and batches dynamically: a thread takes a
fair batch from its queue (:meth:`~inferd.daemon.fairqueue.FairQueue.get_batch`: requests
round-robin across clients, each client's rows capped at its share, up to the limit
that :class:`~inferd.daemon.batching.BatchSizer` measured to pay, waiting up to
``max_delay_ms`` for company), merges those whose tensors agree (names, dtypes, all
dimensions but the first) into one run and splits the outputs back, each reply to its
own request. A request that the model refuses is answered alone; a failing batch is
re-run request by request, so a failure reaches only the request that caused it.

Replies go through the runtime's :class:`~inferd.ipc.replies.ReplySink` to a wire
:class:`~inferd.ipc.replies.Ticket` or to a :class:`~inferd.ipc.replies.LocalTicket` (a
graph node calling the model in-process).

Shutdown follows one rule, :data:`STOP`'s (graphs keep it too): ``stop`` puts one STOP in
the model's queue; a thread that takes it puts it back for the next thread of its stage
and ends, and the last thread of a stage to end passes it on to the next stage instead.
So every request queued before the STOP is served, and no STOP is left in a queue.

A stage that never returns (a hung processor or driver) cannot hold the daemon: each
thread notes when it began its current call (:meth:`ModelThreads.stuck` names those past a
time), :meth:`ModelThreads.stop` gives up once one is stuck, and :meth:`ModelThreads.abandon`
leaves the stuck threads behind, answering what they held and withdrawing their STOP so
that a new load's workers can serve the model's queue.

**Runs in a worker from the I/O thread.** A request that finds its model idle (nothing
queued or running) need not be handed to the model's threads, each hand-over a wake-up
of another thread (30-130 us here, and CPU to the waker). A model in the daemon runs it
on the I/O thread itself once its runs are known to be short
(:meth:`ModelThreads.may_run_on_io_thread`). A model in a worker process has its run
*sent* from the I/O thread and not waited for (:meth:`ModelThreads.run_on_io_thread`):
the I/O loop watches the worker's channel (:meth:`inferd.ipc.server.Server.watch`) and
answers the request when the reply is in, so a run of any length costs the I/O thread
only the send and the reply, and two wake-ups are saved: the client's request wakes the
worker, the worker's reply wakes the I/O thread. Such a run is admitted, counted, noted
as busy (the stuck watch names it, ``inferd-MODEL-io``), measured and answered as a
thread's run is; a run the cache must measure, or one whose worker is gone (it is loaded
again by a run that waits) goes to the model's threads instead. A request that comes
while such a run is in flight goes to the model's threads, and may run beside it. The
I/O loop kills the worker of a run past ``[workers] kill_after_s``; a worker that died is
answered from a short thread of its own, which waits for the zygote's word on how it
ended.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from inferd.daemon.batching import BatchSizer
from inferd.daemon.fairqueue import FairQueue, QueueClosed
from inferd.daemon.memory import Estimate, WorkingMemory
from inferd.daemon.merging import ChunkBatch, PlainBatch, batchable, plain_batch_inputs
from inferd.daemon.pipeline import PipelineSpec, Pinning, pin_current_thread
from inferd.daemon.stages import STOP, Busy, join_stages
from inferd.daemon import streams as stream_batch
from inferd.daemon.streams import Chunk, StreamModel, StreamTable
from inferd.daemon.workers.pool import (
    ENGINE_TIME, OUTPUTS_INTO, WorkerDied, WorkerModel, died_in_step,
)
from inferd.daemon.workers.quarantine import Quarantine
from inferd.daemon.processors import run_steps
from inferd.ipc.errors import ErrorCode, Failure, InferdError, ModelError, failure
from inferd.ipc.protocol import Reply, Request
from inferd.ipc.replies import OK, AnyTicket, ReplySink
from inferd.libbackends.contract import LoadedModel, check_inputs, check_outputs

log = logging.getLogger(__name__)

IO_RUN_AFTER = 32
"""Runs in a row, each shorter than ``[models] io_run_max_us``, after which a model's
request may run on the I/O thread (:meth:`ModelThreads.may_run_on_io_thread`)."""
IO_RUN_MAX_BYTES = 64 * 2**10
"""The largest request (bytes of its message) that may run on the I/O thread."""
IO_START_MAX_BYTES = 2**20
"""The largest request (bytes of its tensors) whose run may be sent to a worker from
the I/O thread: the tensors not in shared memory are copied into the channel's arena
there (1 MiB: ~0.1 ms, less than the two wake-ups it saves)."""

Watch: TypeAlias = Callable[[int, float, Callable[[], None], Callable[[], None]], None]
"""The I/O loop's watch of a descriptor (:meth:`inferd.ipc.server.Server.watch`):
``watch(fd, deadline, ready, late)``."""


@dataclass(slots=True)
class Queued:
    """A request in a model's queue: its ticket (which holds the request), and its
    part in a stream."""

    ticket: AnyTicket
    chunk: Chunk | None = None
    """Its part in a stream (daemon/streams.py), if the request names one."""

    @property
    def request(self) -> Request:
        """The queued request (its ticket's)."""
        return self.ticket.request


@dataclass(frozen=True, slots=True)
class RunAdmission:
    """The cache's admission step, taken before every run of the engine
    (:meth:`~inferd.daemon.models.ModelManager.admit`): ``admit(inputs)`` estimates the
    run's working memory and makes room for it or refuses it (RESOURCE_EXHAUSTED);
    ``working`` measures the runs whose shape class asks for it; ``grew()`` is told
    when a run needed more than the model counted."""

    admit: Callable[[dict[str, Any]], Estimate]
    working: WorkingMemory
    grew: Callable[[], None]

    def start(self, inputs: dict[str, Any]) -> int | None:
        """Admit a run that no thread will wait in (sent to a worker from the I/O
        thread), counted as running until :meth:`ended` is given what this returns (the
        process it is counted in); None if it is one the cache measures (then it must
        run the waiting way, and nothing is counted)."""
        if self.admit(inputs).measure:  # may refuse it
            return None
        return self.working.begin()

    def ended(self, where: int) -> None:
        """The run :meth:`start` admitted (counted in ``where``) has ended."""
        self.working.end(where)

    def run(self, inputs: dict[str, Any], call: Callable[[], dict[str, Any]]
            ) -> dict[str, Any]:
        """Admit, then ``call()`` the engine (measured when the estimate says so)."""
        estimate = self.admit(inputs)  # may refuse it, before it runs
        if not estimate.measure:
            return self.working.run(call)  # type: ignore[no-any-return]
        outputs, changed = self.working.measure(estimate.key, inputs, call)
        if changed:
            self.grew()
        return outputs  # type: ignore[no-any-return]


WorkQueue: TypeAlias = FairQueue
"""A model's request queue (one per model version, kept across loads): it takes turns
between clients (see :mod:`inferd.daemon.fairqueue`)."""


@dataclass(slots=True)
class Passage:
    """One request's passage through the stages: its inputs as the stage before left
    them, its outputs once run."""

    item: Queued
    values: dict[str, Any]
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def ticket(self) -> AnyTicket:
        """The request's ticket (the stage queues take turns by its peer)."""
        return self.item.ticket


class ModelThreads:
    """The pipeline threads of one loaded model.

    Args:
        name: model name, used in thread names and logs.
        model: the loaded model.
        work: the model's request queue (shared with the model entry).
        sink: where replies go (any thread).
        instances: number of inference threads.
        on_done: called after each request with whether it succeeded.
        spec: pre/post steps, batching and CPU affinity (defaults: none, off, any core).
        backend: the backend id, shown in the placement.
        observe: called after each run of the model with the requests' tickets, when
            the run started and how long it took (monotonic seconds): metrics.
        io_run_max_s: a request may run on the I/O thread once the model's last
            :data:`IO_RUN_AFTER` runs each took less than this (0: never; see
            :meth:`may_run_on_io_thread`).
        quarantine: who is charged a worker's death (daemon/workers/quarantine.py).
        streams: the model's stream table (its entry's): a chunk of a stream runs on
            the state kept there (daemon/streams.py).
        stream_model: the model's [stream] table bound to it (None: it has none): chunks
            of different streams may then share a batch (states stacked along their
            batch axis) even where the model's own inputs could not.
        admission: the cache's admission step before each run (None: none, runs are
            neither admitted nor measured).
        watch: the I/O loop's watch of a descriptor (None: a run is never sent from the
            I/O thread without waiting; the module's "Runs in a worker from the I/O
            thread").
    """

    def __init__(self, name: str, model: LoadedModel, work: WorkQueue, sink: ReplySink,
                 instances: int = 1, on_done: Callable[[bool], None] | None = None,
                 spec: PipelineSpec | None = None, backend: str | None = None,
                 observe: Callable[[list[Any], float, float], None] | None = None,
                 io_run_max_s: float = 0.0, quarantine: Quarantine | None = None,
                 streams: StreamTable | None = None,
                 stream_model: StreamModel | None = None,
                 admission: RunAdmission | None = None, watch: Watch | None = None
                 ) -> None:
        self.name = name
        self._watch = watch
        self._io_name = f"inferd-{name}-io"
        self._io_idle = threading.Event()  # no run sent from the I/O thread in flight
        self._io_idle.set()
        self._runs = 0  # runs ended, of any length
        self._admission = admission
        self._streams = streams
        self._stream_model = stream_model
        self.model = model
        self.spec = spec or PipelineSpec()
        self._work = work
        self._sink = sink
        self._on_done = on_done
        self._observe = observe
        self._quarantine = quarantine
        self._left = {"pre": 1, "infer": instances, "post": 1}  # threads not yet ended
        self._left_lock = threading.Lock()
        self._plain_batches = batchable(model)  # requests without a stream
        # how jobs merge into one run and split back: plain, or a stream's chunks
        self._plain = PlainBatch(name)
        self._chunks = ChunkBatch(stream_model) if stream_model is not None else None
        self.max_batch = self.spec.max_batch if self._plain_batches or (
            stream_model is not None and stream_batch.batchable(stream_model, model.inputs)
        ) else 1
        if self.spec.max_batch > 1 and self.max_batch == 1:
            log.warning("model %s: max_batch = %d ignored: its inputs have a fixed first "
                        "dimension", name, self.spec.max_batch, extra={"MODEL": name})
        self.sizer = BatchSizer(name, self.max_batch, self.spec.batching, model)
        size = self.spec.stage_queue_size
        self._infer_q: FairQueue = FairQueue(size) if self.spec.pre else work
        self._post_q: FairQueue | None = FairQueue(size) if self.spec.post else None
        self.busy = Busy()
        self._abandoned = False
        self._given_up: set[int] = set()  # ids of the items abandon() answered
        self._waiting = False  # whether more was queued when the last batch formed
        self.pinnings: list[Pinning] = []
        self._placed = threading.Semaphore(0)
        self.threads: list[threading.Thread] = []
        if self.spec.pre:
            self._add("pre", f"inferd-{name}-pre", self._pre_loop)
        for i in range(instances):
            self._add("infer", f"inferd-{name}-infer-{i}", self._infer_loop, backend)
        if self.spec.post:
            self._add("post", f"inferd-{name}-post", self._post_loop)
        self.batches = 0
        self.batched_requests = 0
        # Only a model whose requests go straight to the infer stage alone, without
        # waiting for company, may run on the I/O thread; a pinned one only where the
        # I/O thread's cores are among the model's (known at its first request there).
        spec = self.spec
        self._io_run_max_s = io_run_max_s if (
            not spec.pre and not spec.post
            and (self.max_batch == 1 or spec.max_delay_ms == 0)) else 0.0
        self._io_cores: bool | None = None if spec.cpu_affinity else True
        self._short_runs = 0  # runs in a row shorter than _io_run_max_s
        self.io_thread_runs = 0
        """Requests run on the I/O thread (``inferctl models``: ``io_thread_runs``)."""

    def warm_up(self) -> None:
        """Before the first requests come (the model loaded, its graph known to the
        cache): size the working memory of the batches it may run, one shape class per
        batch size of the batcher's ladder: batches of stream chunks (daemon/streams.py
        :func:`~inferd.daemon.streams.batch_inputs`), or plain batches of a model whose
        inputs are known but for the batch axis (daemon/merging.py
        :func:`~inferd.daemon.merging.plain_batch_inputs`). Otherwise the first run of
        each class reads the model's graph on the inference thread while every request
        of the model waits behind it (30 to 60 ms a class for vad here: the slow chunks
        of the first seconds). Only the graph is read: nothing runs, nothing is admitted
        or counted (``WorkingMemory.size`` in daemon/memory.py); a model whose batches'
        shapes are not all known is left to its first runs."""
        if self._admission is None or (self._stream_model is None and self.max_batch <= 1):
            return
        began = time.monotonic()
        sizes = self.sizer.sizes() if self.max_batch > 1 else [1]
        kind = "stream" if self._stream_model is not None else "plain"
        try:
            batches = (stream_batch.batch_inputs(self._stream_model, self.model.inputs, sizes)
                       if self._stream_model is not None
                       else plain_batch_inputs(self.model, sizes, self.spec.warmup_shapes))
            for inputs in batches.values():
                self._admission.working.size(inputs)
        except Exception as e:  # noqa: BLE001  never fails the load: the first runs size
            log.info("model %s: the working memory of its %s batches is sized by their "
                     "first runs: %s", self.name, kind, e, extra={"MODEL": self.name})
            return
        if batches:
            log.debug("model %s: working memory of %s batches of %s rows sized in %.0f ms",
                      self.name, kind, ", ".join(map(str, batches)),
                      (time.monotonic() - began) * 1000, extra={"MODEL": self.name})

    def _add(self, stage: str, thread_name: str, target: Callable[[Pinning], None],
             backend: str | None = None) -> None:
        pinning = Pinning(thread_name, stage, backend=backend)
        self.pinnings.append(pinning)

        def run() -> None:
            pin_current_thread(pinning, self.spec.cpu_affinity, self.name)
            self._placed.release()
            target(pinning)
        self.threads.append(threading.Thread(target=run, name=thread_name, daemon=True))

    def pinning(self) -> list[dict[str, Any]]:
        """Every thread's name, stage, native id, affinity and backend."""
        return [p.to_json() for p in self.pinnings]

    def engine_pinning(self) -> list[dict[str, Any]]:
        """For a model in a worker process, the worker's threads whose last run was this
        model's, as :meth:`pinning` shows a thread (stage ``engine``, with the worker's
        ``pid``: where the engine's work is done); a call to the worker, so never made
        under a lock."""
        engine = getattr(self.model, "engine", self.model)
        if not isinstance(engine, WorkerModel):
            return []
        return [{"thread": f"worker {engine.pid}", "stage": "engine", "native_id": tid,
                 "affinity": cores, "backend": engine.call.backend, "error": None,
                 "pid": engine.pid} for tid, cores in engine.threads()]

    def batching(self) -> dict[str, Any]:
        """The ``batching`` field of the models listing: mode, bounds, the limit chosen
        and why (see :class:`~inferd.daemon.batching.BatchSizer`)."""
        return {**self.sizer.describe(), "max_delay_ms": self.spec.max_delay_ms}

    def start(self) -> None:
        """Start every thread and return once each has applied its pinning."""
        for t in self.threads:
            t.start()
        for _ in self.threads:
            self._placed.acquire(timeout=10)

    def stop(self, timeout: float | None = None, stuck_after: float | None = None) -> bool:
        """Send :data:`STOP` through the stages (never blocking) and wait for the
        threads to end: at most ``timeout`` seconds, and no longer than it takes one
        stage to be inside one call for ``stuck_after`` seconds (it would not end in
        time). True if every thread ended."""
        began = time.monotonic()
        self._work.put(STOP)
        if not join_stages(self.threads, self.busy, timeout, stuck_after):
            return False
        if self._io_idle.is_set():
            return True
        # a run sent from the I/O thread (its worker is killed past kill_after_s)
        limits = [x for x in (timeout, stuck_after) if x is not None]
        left = max(0.0, min(limits) - (time.monotonic() - began)) if limits else None
        return self._io_idle.wait(left)

    def stuck(self, after_s: float = 0.0) -> list[str]:
        """Each thread inside one call (a step or a run) for longer than ``after_s``
        seconds, named with its stage, request and time (see :meth:`Busy.stuck`)."""
        return self.busy.stuck(after_s)

    def all_stuck(self, after_s: float) -> bool:
        """Whether every inference thread is inside one run for longer than ``after_s``
        seconds (the model can serve nothing until one returns)."""
        stuck = {c[0] for c in self.busy.calls(after_s) if c[1] == "infer"}
        return all(p.thread in stuck for p in self.pinnings if p.stage == "infer")

    def abandon(self) -> None:
        """Give up on threads that :meth:`stop` could not end: they end when their call
        returns and take nothing more from the model's queue, whose STOP is withdrawn
        (the next load's workers serve it). Requests held between the stages are
        answered UNAVAILABLE naming the stuck stage."""
        self._abandoned = True
        self._work.withdraw()
        why = "; ".join(self.stuck()) or "a stage did not end"
        for item in self.busy.held():  # inside the stuck calls: answered now, and once
            self._finish(item, Reply(item.request.id, error=Failure(
                ErrorCode.UNAVAILABLE, f"model {self.name}: its workers were given up while "
                f"the request was inside a stuck call: {why}")))
            self._given_up.add(id(item))
        for q in (self._infer_q if self._infer_q is not self._work else None, self._post_q):
            if q is None:
                continue
            for job in q.close():
                self._finish(job.item, Reply(job.item.request.id, error=Failure(
                    ErrorCode.UNAVAILABLE, f"model {self.name}: its workers were given up "
                    f"while the request waited between stages: {why}")))
            q.put(STOP)  # wakes its readers; they end by STOP's rule

    # ----------------------------------------------------------------- on the I/O thread

    def may_run_on_io_thread(self, size: int) -> bool:
        """Whether a request whose tensors are ``size`` bytes (wherever they travel:
        ``Ticket.tensor_bytes``) may run on the calling thread (the I/O thread) instead
        of being handed to this model's threads: two thread hand-overs cost more than
        such a run. Only a model whose last :data:`IO_RUN_AFTER` runs
        were all short (a first run that hangs never gets here), and never a pinned
        model on a thread outside its cores. The caller makes sure that nothing of this
        model is queued or running (:meth:`ModelEntry.begin_io_run`).

        A model in a worker has its run sent from the I/O thread and not waited for
        (:meth:`run_on_io_thread`): any model whose first :data:`IO_RUN_AFTER` runs
        ended, whatever their length, with tensors up to :data:`IO_START_MAX_BYTES`."""
        if self._abandoned or not self._io_run_max_s:
            return False
        if self._startable():
            return self._runs >= IO_RUN_AFTER and size <= IO_START_MAX_BYTES
        if self._short_runs < IO_RUN_AFTER or size > IO_RUN_MAX_BYTES:
            return False
        if self._io_cores is None:  # asked on the I/O thread, whose cores stay
            cores = set(self.spec.cpu_affinity or ())
            self._io_cores = os.sched_getaffinity(0) <= cores
        return bool(self._io_cores)

    def _startable(self) -> bool:
        """Whether the engine serving now can take a run without a thread waiting in it
        (one in a worker: :meth:`inferd.daemon.workers.pool.WorkerModel.start`)."""
        return self._watch is not None and hasattr(getattr(self.model, "engine",
                                                           self.model), "start")

    def run_on_io_thread(self, item: Queued) -> None:
        """Serve ``item`` from the calling thread (the I/O thread) as an inference thread
        would: its deadline and inputs checked, the run noted as busy (the stuck watch
        names it) and measured, the reply sent through the sink. A model in a worker
        has its run sent there and answered once the reply is in, without waiting
        (:meth:`_start`); a model in the daemon runs it here."""
        self.io_thread_runs += 1
        job = Passage(item, item.request.inputs)
        if not self._check(job):
            return
        if self._startable():
            self._start(job)
        else:
            self._run_single(job, 1)

    def _start(self, job: Passage) -> None:
        """Send ``job``'s run to its worker and have the I/O loop answer it once the
        reply is in (:meth:`_started_ready`); one the cache must measure, or whose
        worker is gone, goes to the model's threads instead (it is counted in flight
        already)."""
        assert self._watch is not None
        item = job.item
        chunk = item.chunk
        wanted = item.request.outputs
        if chunk is not None and self._streams is not None:
            wanted = self._streams.wanted(wanted)
            chunk.ran = True  # from here the stream's state is this run's
        # a stream's state outputs are the daemon's: never written into a client's slot
        into = None if chunk is not None else item.ticket.outputs_into
        admission = self._admission
        counted: int | None = None  # the process the run is counted in, once admitted
        began = time.monotonic()
        try:
            if admission is not None:
                counted = admission.start(job.values)  # may refuse it
            if admission is None or counted is not None:
                started = self.model.start(job.values, wanted, into)  # type: ignore[attr-defined]
            else:
                started = None
        except Exception as e:
            if counted is not None:
                admission.ended(counted)  # type: ignore[union-attr]
            if chunk is not None:
                chunk.reason = _lost_reason(e, chunk.number)
            self._fail(item, e)
            return
        if started is None:  # to be measured, or its worker is gone: a thread runs it
            if counted is not None:
                admission.ended(counted)  # type: ignore[union-attr]
            if chunk is not None:
                chunk.ran = False
            self._work.put(item)
            return
        self._io_idle.clear()
        self.busy.begin_as(self._io_name, "infer", "running request %s", (item,),
                           item.request.id)
        self._watch(started.fileno(), started.deadline,
                    lambda: self._started_ready(job, started, began, counted), started.late)

    def _started_ready(self, job: Passage, started: Any, began: float,
                       counted: int | None) -> None:
        """The worker's channel is readable (the I/O loop): the reply is in, or the
        worker is gone, whose end is waited for on a thread of its own."""
        if started.receive():
            self._started_done(job, started, began, counted)
        else:
            threading.Thread(target=self._started_done,
                             args=(job, started, began, counted),
                             name=f"inferd-{self.name}-ended", daemon=True).start()

    def _started_done(self, job: Passage, started: Any, began: float,
                      counted: int | None) -> None:
        """Answer a run sent from the I/O thread, as :meth:`_run_single` answers one
        (``counted``: the process its admission counted it in)."""
        item = job.item
        chunk = item.chunk
        try:
            try:
                outputs, engine_s = started.outputs()
            finally:
                seconds = time.monotonic() - began
                self.busy.end(self._io_name)
                if counted is not None:
                    self._admission.ended(counted)  # type: ignore[union-attr]
            self._ran(seconds, engine_s)
            if self._observe is not None:
                self._observe([item.ticket], began, seconds)
            job.outputs = outputs
            if chunk is not None and self._streams is not None:
                job.outputs = self._streams.commit(item, job.values, outputs)
        except Exception as e:
            if isinstance(e, WorkerDied) and self._quarantine is not None:
                self._quarantine.death(self.name, [item.ticket.uid], e.message)
            if chunk is not None:
                chunk.reason = _lost_reason(e, chunk.number)
            self._fail(item, e)
        else:
            self._hand_on(job)
            self.sizer.observe(_rows(job), 1, time.monotonic() - began, False)
        finally:
            self._io_idle.set()

    # ----------------------------------------------------------------- stages

    def _stage_ended(self, stage: str, inbox: Any, outbox: Any) -> None:
        """:data:`STOP`'s rule for a thread of ``stage`` that took it from ``inbox``."""
        with self._left_lock:
            self._left[stage] -= 1
            last = self._left[stage] == 0
        if not last:
            inbox.put(STOP)
        elif outbox is not None:
            outbox.put(STOP)

    def _finish(self, item: Queued, reply: Reply) -> None:
        self._sink.send(item.ticket, reply)  # a second answer is dropped there
        if id(item) in self._given_up:  # abandon answered and counted it already
            self._given_up.discard(id(item))
            return
        if self._on_done:
            self._on_done(reply.ok)
        if item.chunk is not None and self._streams is not None:
            # its stream settles (lost unless the client got this run's outputs) and
            # its next chunk takes its turn
            ok = reply.ok and item.ticket.code == OK
            if not ok and item.chunk.ran and item.chunk.reason is None:
                item.chunk.reason = (f"chunk {item.chunk.number} was answered "
                                     f"{item.ticket.code} while it ran")
            for nxt, answer in self._streams.finished(item, ok):
                if answer is None:
                    self._work.put(nxt)  # counted in flight when it was held
                else:
                    self._finish(nxt, answer)

    def _fail(self, item: Queued, e: Exception) -> None:
        rid = item.request.id
        self._finish(item, Reply(rid, error=failure(e, f"model {self.name}", log,
                                                    model=self.name, request_id=rid)))

    def _expired(self, item: Queued) -> bool:
        if item.ticket.expired():
            self._finish(item, Reply(item.request.id, error=Failure(
                ErrorCode.DEADLINE_EXCEEDED, f"model {self.name}: deadline of "
                f"{item.request.timeout_ms} ms passed while the request was queued")))
            return True
        return False

    def _pass(self, job: Passage, outbox: FairQueue) -> None:
        """Hand ``job`` to the next stage; a stage queue closed by :meth:`abandon`
        answers it instead."""
        try:
            outbox.put(job)
        except QueueClosed:
            self._finish(job.item, Reply(job.item.request.id, error=Failure(
                ErrorCode.UNAVAILABLE, f"model {self.name}: its workers were given up "
                f"(a stage was stuck) while the request was in flight")))

    def _pre_loop(self, pinning: Pinning) -> None:
        while not self._abandoned:
            item = self._work.get()
            if item is STOP:
                self._stage_ended("pre", self._work, self._infer_q)
                return
            if self._expired(item):
                continue
            self.busy.begin("pre", "pre-processing request %s", (item,), item.request.id)
            try:
                values = run_steps(self.spec.pre, dict(item.request.inputs),
                                   f"model {self.name}")
            except Exception as e:
                self._charge(e, item)
                self._fail(item, e)
                continue
            finally:
                self.busy.end()
            self._pass(Passage(item, values), self._infer_q)

    def _post_loop(self, pinning: Pinning) -> None:
        assert self._post_q is not None
        while True:
            job = self._post_q.get()
            if job is STOP:
                self._stage_ended("post", self._post_q, None)
                return
            self.busy.begin("post", "post-processing request %s", (job.item,),
                            job.item.request.id)
            try:
                out = run_steps(self.spec.post, job.outputs, f"model {self.name}")
                self._finish(job.item, Reply(job.item.request.id,
                                             outputs=self._select(job.item, out)))
            except Exception as e:
                self._charge(e, job.item)
                self._fail(job.item, e)
            finally:
                self.busy.end()

    def _charge(self, e: Exception, item: Queued) -> None:
        """A step whose processors worker died (daemon/workers/steps.py) is charged to
        the request's client as a run's death is: a client whose requests keep killing it
        is refused, a model whose steps kill it for several clients is set aside."""
        died = died_in_step(e)
        if died is not None and self._quarantine is not None:
            self._quarantine.death(self.name, [item.ticket.uid], died)

    def _infer_loop(self, pinning: Pinning) -> None:
        delay = self.spec.max_delay_ms / 1000
        first_stage = self._infer_q is self._work
        while not (first_stage and self._abandoned):
            limit = self.sizer.limit() if self.max_batch > 1 else 1
            batch = self._infer_q.get_batch(limit, _rows, delay, self.sizer.allowed)
            if batch[0] is STOP:
                self._stage_ended("infer", self._infer_q, self._post_q)
                return
            self._waiting = not self._infer_q.empty()
            self._run_batch([x if isinstance(x, Passage) else Passage(x, x.request.inputs)
                             for x in batch], limit)
            # not held while waiting for the next: a request's inputs may be views of a
            # client's shared-memory region, whose mapping and descriptor go with the
            # last of them once the client releases it
            del batch
        with self._left_lock:  # abandoned: the last one lets the post stage end
            self._left["infer"] -= 1
            last = self._left["infer"] == 0
        if last and self._post_q is not None:
            self._post_q.put(STOP)

    # ----------------------------------------------------------------- inference

    def _check(self, job: Passage) -> bool:
        """Refuse a job the model cannot take (answered alone); True if it may run. A
        stream's chunk gets its state, context and constants here."""
        if self._expired(job.item):
            return False
        try:
            if job.item.chunk is not None and self._streams is not None:
                job.values = self._streams.bind(job.item, job.values)
            check_inputs(self.name, self.model.inputs, job.values)
            if not self.spec.post:
                check_outputs(self.name, self.model.outputs, job.item.request.outputs)
        except InferdError as e:
            self._fail(job.item, e)
            return False
        return True

    def _run_batch(self, batch: list[Passage], limit: int) -> None:
        if len(batch) == 1:
            if self._check(batch[0]):
                self._run_single(batch[0], limit)
            return
        ready = [j for j in batch if self._check(j)]
        groups: dict[tuple[Any, ...], list[Passage]] = {}
        for job in ready:
            how = self._how(job)
            if how is self._plain and not self._plain_batches:
                self._run_single(job, limit)
                continue
            # chunks of different streams (one each: their turns) only with equal
            # constants; plain requests of equal shapes but the batch axis
            groups.setdefault((how.kind, how.signature(job.values)), []).append(job)
        for jobs in groups.values():
            how = self._how(jobs[0])
            part: list[Passage] = []
            rows = 0
            for job in jobs:
                n = how.rows(job.values)
                if part and rows + n > limit:
                    self._run_group(part, limit, how)
                    part, rows = [], 0
                part.append(job)
                rows += n
            self._run_group(part, limit, how)

    def _how(self, job: Passage) -> PlainBatch | ChunkBatch:
        """How ``job`` merges with others: as a stream's chunk, or plainly."""
        if job.item.chunk is not None and self._chunks is not None:
            return self._chunks
        return self._plain

    def _timed_run(self, jobs: list[Passage], inputs: dict[str, Any],
                   wanted: list[str] | None) -> dict[str, Any]:
        """One run of the model on ``inputs`` for ``jobs``: noted as busy, measured for
        the metrics."""
        first = jobs[0].item
        if len(jobs) == 1:
            self.busy.begin("infer", "running request %s", (first,), first.request.id)
        else:
            self.busy.begin("infer", "running a batch of %d requests (%s, ...)",
                            tuple(j.item for j in jobs), len(jobs), first.request.id)
        try:
            started = time.monotonic()
            if self._admission is None:
                outputs = self.model.run(inputs, wanted)
            else:
                outputs = self._admission.run(inputs, lambda: self.model.run(inputs, wanted))
            seconds = time.monotonic() - started
        except WorkerDied as e:  # charged to the clients whose requests were running
            if self._quarantine is not None:
                self._quarantine.death(self.name, [j.item.ticket.uid for j in jobs],
                                       e.message)
            raise
        finally:
            self.busy.end()
        engine = ENGINE_TIME.seconds
        if engine is not None:
            ENGINE_TIME.seconds = None
        self._ran(seconds, engine)
        if self._observe is not None:
            self._observe([j.item.ticket for j in jobs], started, seconds)
        return outputs

    def _ran(self, seconds: float, engine: float | None) -> None:
        """Count a run that took ``seconds`` (``engine``: its engine's own time, for a run
        in a worker: the hop is paid by the thread hand-overs too, and more): a long one
        sends the model's requests to its threads (:meth:`may_run_on_io_thread`)."""
        self._runs += 1
        if self._io_run_max_s:
            short = (seconds if engine is None else engine) < self._io_run_max_s
            self._short_runs = self._short_runs + 1 if short else 0

    def _run_group(self, jobs: list[Passage], limit: int, how: PlainBatch | ChunkBatch) -> None:
        """``jobs`` as one run: their inputs merged (``how``), the outputs split back;
        a stream's chunk keeps its state from its own rows (only a run that answers
        commits one). A failed batch runs its jobs one by one, so that a failure
        reaches only its own request (the states are still those before the batch)."""
        if len(jobs) == 1:
            self._run_single(jobs[0], limit)
            return
        began = time.monotonic()
        counts = [how.rows(j.values) for j in jobs]
        try:
            merged = how.merge([j.values for j in jobs])
            outputs = self._timed_run(jobs, merged, None)
            parts = how.split(outputs, counts)
        except Exception as e:
            log.info("model %s: batch of %d %s failed (%s); running them one by one",
                     self.name, len(jobs), how.kind, e, extra={"MODEL": self.name})
            for job in jobs:
                self._run_single(job, limit)
            return
        self.batches += 1
        self.batched_requests += len(jobs)
        for job, out in zip(jobs, parts):
            chunk = job.item.chunk
            if chunk is not None and self._streams is not None:
                chunk.ran = True
                try:
                    out = self._streams.commit(job.item, job.values, out)
                except Exception as e:
                    self._fail(job.item, e)
                    continue
            job.outputs = out
            self._hand_on(job)
        # what the batch cost this thread, merging and replies included
        self.sizer.observe(sum(counts), limit, time.monotonic() - began, self._waiting)

    def _run_single(self, job: Passage, limit: int) -> None:
        wanted = None if self.spec.post else job.item.request.outputs
        chunk = job.item.chunk
        if chunk is not None and self._streams is not None:
            wanted = self._streams.wanted(wanted)
            chunk.ran = True  # from here the stream's state is this run's
        # outputs that go straight to the reply: a worker writes them into the client's
        # slot itself (daemon/workers/pool.py, "Shared memory"); never a stream's, whose
        # state outputs the daemon keeps
        into = None if self.spec.post or chunk is not None else job.item.ticket.outputs_into
        began = time.monotonic()
        try:
            if into is not None:
                OUTPUTS_INTO.slot = into
            job.outputs = self._timed_run([job], job.values, wanted)
            if chunk is not None and self._streams is not None:
                job.outputs = self._streams.commit(job.item, job.values, job.outputs)
        except Exception as e:
            if chunk is not None:
                chunk.reason = _lost_reason(e, chunk.number)
            self._fail(job.item, e)
            return
        finally:
            if into is not None:
                OUTPUTS_INTO.slot = None
        self._hand_on(job)
        self.sizer.observe(_rows(job), limit, time.monotonic() - began, self._waiting)

    def _hand_on(self, job: Passage) -> None:
        if self._post_q is not None:
            self._pass(job, self._post_q)
            return
        try:
            outputs = self._select(job.item, job.outputs)
        except Exception as e:
            self._fail(job.item, e)
            return
        self._finish(job.item, Reply(job.item.request.id, outputs=outputs))

    def _select(self, item: Queued, outputs: dict[str, Any]) -> dict[str, Any]:
        wanted = item.request.outputs
        if wanted:
            missing = [w for w in wanted if w not in outputs]
            if missing:
                raise ModelError(f"model {self.name}: no outputs {missing}; it gives "
                                 f"{sorted(outputs)}")
            outputs = {w: outputs[w] for w in wanted}
        return {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in outputs.items()}


def _lost_reason(e: Exception, number: int) -> str:
    """Why a stream's state is unknown after chunk ``number``'s run raised ``e``."""
    if isinstance(e, WorkerDied):
        return f"worker died while running chunk {number}"
    message = e.message if isinstance(e, InferdError) else str(e)
    return f"chunk {number} failed: {message[:200]}"


def _rows(job: Any) -> int:
    """The rows of a job or a queued request: the first dimension of its first input."""
    return PlainBatch.rows(job.values if isinstance(job, Passage) else job.request.inputs)
