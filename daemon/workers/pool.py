"""The daemon's side of the worker processes: which worker a model loads in, starting
them through the zygote, watching them, and the :class:`WorkerModel` that the cache runs
like any loaded model.

**Which worker.** ``[workers] isolation = "backend"``: the models of one backend share
one worker (the engine's memory is paid once); a model with its own ``customops/``
folder gets a worker of its own. ``"model"``: every model version its own.
``"in-process"``: no worker (the engines run in the daemon, as before). Every processor
step runs in one more worker, keyed ``processors`` (:mod:`inferd.daemon.workers.steps`).

**Watching.** Nothing polls: a call waiting on a worker that dies gets an empty read on
its channel at once (the kernel closes the worker's end), and the zygote, the worker's
parent, reports the wait status on SIGCHLD (a worker that dies between calls is known
the same way). A worker is killed through its pidfd. Every call the worker held fails
``UNAVAILABLE``, naming the engine, the worker's pid, how it ended and what it was
running (``engine onnxruntime (worker 4711) died of SIGABRT while running vad version
1``); one ERROR line says the same with journal fields, and
``inferd_worker_restarts_total{backend,reason}`` counts it.
A call that runs past ``[workers] kill_after_s`` has its worker killed (SIGKILL).

**Shared memory.** A tensor that lies in a client's registered region
(:mod:`inferd.ipc.shm`) goes to a worker by reference: the region's descriptor is passed
on the channel (``SCM_RIGHTS``) the first time a call on that worker needs it, then the
tensor is named by (region id, offset, dtype, shape) and the worker maps the region (read
only unless outputs go there) and reads it in place. Outputs a client asked into its
region (``outputs_into``) are written there by the worker, at the offsets the daemon's
rule gives (:meth:`inferd.ipc.protocol.Slot.place`, checked again here and claimed
without a copy by :meth:`~inferd.ipc.protocol.Slot.claim`). A region released by its
client is unmapped in every worker it was handed to once no call in flight uses it
(``forget``); a worker started again gets the descriptor again. Each region costs a
worker one descriptor and one mapping; a worker holds at most :data:`REGION_SHARE` of
its open-files limit in them, past which a region's tensors are copied through the
channel's arena as before.

**Outputs without a copy.** A run's outputs that come back through the worker's arena
(those of :data:`~inferd.daemon.workers.channel.INLINE_BYTES` or more) are views of it,
not copies: the reply frames libzmq sends point into the arena. The channel is *lent*
to them (:meth:`Channel.lent <inferd.daemon.workers.channel.Channel.lent>`) and carries
no call until the last view is gone (libzmq let go of the frame, every array made from
them dropped); the worker writes its arena only to answer a call on that channel, so no
reply is overwritten while it is sent. A caller meanwhile takes another channel. A
worker has at most :data:`LENT_MAX` channels lent; past that a run's outputs are copied
out as before.

**Channels.** A call takes a free channel to its worker, or opens one (the control
channel carries its end): as many channels as calls were ever in flight at once, each
with an arena at each end as large as the largest message it carried. The most recently
freed is taken first; one unused for ``[workers] channel_idle_s`` is closed (its arenas
with it, and the worker's thread that served it).

**Again.** A model whose worker died loads again, in a new worker, on its next run; a
worker that died is started again no sooner than ``restart_backoff_s`` after the
previous start (doubling while deaths follow each other within a minute).
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.daemon.activations import Peak
from inferd.daemon.workers.channel import (
    Channel, Gone, Unreadable, dtype_code, dtype_of, pair,
)
from inferd.daemon.workers.process import decode_error
from inferd.daemon.workers.steps import PROCESSORS, InWorker
from inferd.daemon.workers.zygote import Zygote, describe_status
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.ipc.protocol import Slot
from inferd.ipc.shm import Shared, shared_of
from inferd.libbackends.contract import BatchSizes, LoadedModel, LoadOptions, TensorSpec

log = logging.getLogger(__name__)


# Thread-locals with a class default: reading one a thread never set is a lookup, not an
# AttributeError raised and caught on every run.
class _EngineTime(threading.local):
    seconds: float | None = None


class _OutputsInto(threading.local):
    slot: Slot | None = None


ENGINE_TIME = _EngineTime()
"""``ENGINE_TIME.seconds``: the engine's own time of the calling thread's last run in a
worker (the hop not counted): whether a model's runs are short enough for the I/O thread
is decided on it (daemon/model_threads.py)."""

STATUS_WAIT_S = 2.0
"""How long a failed call waits for the zygote's word on how its worker ended."""

OUTPUTS_INTO = _OutputsInto()
"""``OUTPUTS_INTO.slot``: the shared-memory slot the calling thread's next run writes its
outputs into (set by daemon/model_threads.py for a request with ``outputs_into`` whose outputs
go straight to its reply; the first :meth:`WorkerModel.run` takes it)."""

LENT_MAX = 8
"""Channels of one worker lent to reply tensors at most (each holds its arena, the
size of its biggest reply); past that a run's outputs are copied out of the arena."""

REGION_SHARE = 2
"""A worker holds at most 1/REGION_SHARE of its open-files limit in regions' descriptors
(one each); the rest is its engines' and channels'."""


@dataclass
class _Plan:
    """What one call sends: the tensors through the channel, the regions' descriptors
    passed with it, and the regions it uses (counted until the call ends)."""

    tensors: dict[str, NDArray[Any]] | None
    fds: list[int] = field(default_factory=list)
    maps: list[tuple[int, int, bool]] = field(default_factory=list)
    used: list[Shared] = field(default_factory=list)


class WorkerDied(InferdError):
    """A call's worker ended while it ran (``UNAVAILABLE``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.UNAVAILABLE)


def died_in_step(e: BaseException) -> str | None:
    """How the processors worker ended, if that is what failed a processor step: the
    steps' runners (daemon/processors: ``run_steps``, ``run_node``) raise a step's error
    again ``from`` it, and a step whose worker died raised :class:`WorkerDied`
    (daemon/workers/steps.py). None for any other failure."""
    cause = e.__cause__
    return cause.message if isinstance(cause, WorkerDied) else None


class Call:
    """One call sent to a worker (:meth:`WorkerPool.begin`) and not answered yet.

    Taken either by :meth:`wait` (the calling thread blocks, at most the call's limit),
    or in two steps by a thread that polls :meth:`fileno`: :meth:`receive` once it is
    readable (never blocks), then :meth:`result`, which blocks only when the worker is
    gone (up to ``STATUS_WAIT_S`` for the zygote's word on how it ended: the I/O thread
    leaves that to another thread). :meth:`late` kills the worker of a call past its
    limit that nobody waits on (its channel then reads as gone).
    """

    __slots__ = ("pool", "w", "channel", "plan", "op", "what", "limit", "key", "into",
                 "lend", "deadline", "_reply", "_gone", "_done")

    def __init__(self, pool: WorkerPool, w: Worker, channel: Channel, plan: _Plan,
                 op: str | None, what: str, limit: float, key: str, into: Slot | None,
                 lend: bool) -> None:
        self.pool, self.w, self.channel, self.plan = pool, w, channel, plan
        self.op, self.what, self.limit, self.key = op, what, limit, key
        self.into, self.lend = into, lend
        self.deadline = time.monotonic() + limit
        """When :meth:`late` is due (monotonic)."""
        self._reply: tuple[dict[str, Any], dict[str, NDArray[Any]]] | None = None
        self._gone = False
        self._done = False

    def fileno(self) -> int:
        """The channel's descriptor: readable once the reply is in (or the worker gone)."""
        return self.channel.fileno()

    def wait(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """Block for the reply, at most the call's limit (then the worker is killed)."""
        self.channel.settimeout(self.limit)
        self.receive()
        return self.result()

    def receive(self) -> bool:
        """Read the reply (the channel is readable, or the caller blocks); True if it
        came, False if the worker is gone (:meth:`result` then waits to say how)."""
        try:
            self._reply = self.channel.receive(copy=not self.lend, lend=self.lend)[:2]
        except TimeoutError:
            self.channel.close()
            self.late()
            self._gone = True
        except Unreadable as e:  # the worker's words are not inferd's: it is not trusted
            self.channel.close()
            self.pool.kill(self.w, f"was killed for {e}")
            self._gone = True
        except (Gone, OSError):
            self.channel.close()
            self._gone = True
        else:  # a call of a worker that died stays among its calls until the zygote's
            # word is in (the death is logged naming what it ran): result() takes it out
            self.w.running.pop(id(self), None)
        return not self._gone

    def result(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """The reply :meth:`receive` read, as :meth:`WorkerPool.call` returns it.

        Raises:
            WorkerDied: the worker ended (or was killed) during the call.
            InferdError: the call's own failure, as the worker raised it.
        """
        assert not self._done, "a call's result is taken once"
        self._done = True
        try:
            if self._gone:
                if not self.w.ended.wait(STATUS_WAIT_S):
                    self.pool.kill(self.w, "was killed: its channel broke")  # state unknown
                raise self.pool.death(self.w, self.what) from None
            assert self._reply is not None
            return self.pool._answered(self, *self._reply)
        finally:
            self.w.running.pop(id(self), None)
            if self.plan.used:
                self.pool._unuse(self.plan.used)

    def outputs(self) -> tuple[dict[str, NDArray[Any]], float]:
        """A run's outputs (:meth:`result`'s tensors) and its engine's own seconds."""
        reply, out = self.result()
        return out, float(reply["took"])

    def late(self) -> None:
        """The call ran past its limit: kill its worker (the channel then reads as gone,
        and :meth:`result` says why). :meth:`wait` calls it on its receive's timeout;
        the I/O loop, at the call's deadline, for a call nobody blocks on."""
        self.pool.kill(self.w, f"was killed after {self.limit:g} s in one call ({self.key})")


@dataclass
class Worker:
    """One worker process, as the daemon sees it."""

    name: str
    backend: str
    pid: int
    control: Channel
    started: float = field(default_factory=time.monotonic)
    pidfd: int = -1
    """Open from its start until its end is reported (``pidfd_lock``): the only way it
    is signalled. Its pid alone is never used for that: once the zygote has reaped it,
    the number may be another process's (pids wrap at 32,768 by default)."""
    pidfd_lock: threading.Lock = field(default_factory=threading.Lock)
    status: int | None = None
    reason: str = ""
    """How it ended (``died of SIGABRT``), once it has."""
    running: dict[int, str] = field(default_factory=dict)
    """Calls in progress, by thread id: what each runs (``vad version 1``)."""
    idle: list[Channel] = field(default_factory=list)
    lent: list[Channel] = field(default_factory=list)
    """Channels whose last reply's tensors are (or were) views of the worker's arena
    (``lock``); each goes back to use once they are gone."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: threading.Event = field(default_factory=threading.Event)
    killed_for: str = ""
    models: int = 0
    """Models loaded in it; ``pending``: loads on their way (both under the pool's lock)."""
    pending: int = 0
    regions: dict[int, bool] = field(default_factory=dict)
    """Shared-memory regions mapped in it: id -> mapped writable (the pool's lock)."""
    on_end: list[Callable[[], None]] = field(default_factory=list)
    """Called once it ended (the zygote's report), whatever the reason."""
    shedding: bool = False
    """A timer will look for channels idle too long (``lock``; :meth:`WorkerPool._shed`)."""

    @property
    def alive(self) -> bool:
        return not self.ended.is_set()

    def take_unlent(self) -> list[Channel]:
        """The channels of :attr:`lent` whose reply's tensors are gone, taken out of it
        (``lock`` held). One look at each: a view let go of meanwhile leaves its channel
        in :attr:`lent` for the next call, never out of both lists."""
        back: list[Channel] = []
        still: list[Channel] = []
        for c in self.lent:
            (still if c.lent() else back).append(c)
        self.lent = still
        return back

    def send_kill(self) -> None:
        """SIGKILL it, through its pidfd; nothing once its end was reported."""
        with self.pidfd_lock:
            if self.pidfd < 0:
                return
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass  # ended, not reaped yet: its report is on the way

    def close_pidfd(self) -> None:
        with self.pidfd_lock:
            if self.pidfd >= 0:
                os.close(self.pidfd)
                self.pidfd = -1

    @property
    def label(self) -> str:
        """What it runs, for messages: ``engine onnxruntime``, or ``processors``."""
        return PROCESSORS if self.backend == PROCESSORS else f"engine {self.backend}"


class WorkerPool:
    """Starts, finds and watches the worker processes.

    Args:
        registry: the registered backends (inherited by every worker).
        customops: the daemon-wide custom ops (inherited by every worker).
        kill_after_s: a call running longer has its worker killed.
        restart_backoff_s: the least time between two starts of a worker that died.
        idle_exit_s: a worker with no model left ends after this long.
        channel_idle_s: a channel unused this long is closed (:meth:`_shed`).
        on_restart: called with ``(backend, reason)`` for every worker that died.
    """

    def __init__(self, registry: Any, customops: Any, kill_after_s: float,
                 restart_backoff_s: float = 0.5, max_memory: int | None = None,
                 idle_exit_s: float = 10.0, channel_idle_s: float = 30.0,
                 on_restart: Callable[[str, str], None] | None = None) -> None:
        self.registry = registry
        self.customops = customops
        self.kill_after_s = kill_after_s
        self.restart_backoff_s = restart_backoff_s
        self.max_memory = max_memory
        self.idle_exit_s = idle_exit_s
        self.channel_idle_s = channel_idle_s
        self._on_restart = on_restart
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}
        self._by_pid: dict[int, Worker] = {}
        self._statuses: dict[int, int] = {}
        self._deaths: dict[str, collections.deque[float]] = {}
        self._last_start: dict[str, float] = {}
        self._spawn_lock = threading.Lock()  # not _lock: the zygote's reader takes that
        self._timers: set[threading.Timer] = set()  # _later's timers, cancelled at close
        self.restarts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.zygote: Zygote | None = None
        self._closed = False
        # shared-memory regions handed to workers (the pool's lock)
        self.region_limit = max(16, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                                // REGION_SHARE)
        self.by_reference = 0
        """Bytes of tensors that went to a worker by reference to a region."""
        self._shared: dict[int, Shared] = {}  # regions this pool listens to
        self._uses: collections.Counter[int] = collections.Counter()  # calls in flight
        self._forgets: dict[int, tuple[Worker, list[int]]] = {}  # id(worker) -> regions
        self._forgetting = False

    def start(self) -> None:
        """Fork the zygote: call it while the daemon has one thread, once the backends
        and custom ops are registered (every worker inherits them)."""
        from inferd.daemon.workers.process import worker_main

        registry, customops = self.registry, self.customops

        def main(sock: socket.socket, name: str) -> int:
            return worker_main(sock, name, registry, customops)

        t0 = time.monotonic()
        self.zygote = Zygote(main, self._exited)
        self.zygote.start()
        log.info("worker zygote started: pid %d in %.1f ms", self.zygote.pid,
                 (time.monotonic() - t0) * 1e3)

    # ----------------------------------------------------------------- workers

    def worker(self, key: str, backend: str) -> Worker:
        """The live worker for ``key``, started if there is none, with one load pending
        on it (see :meth:`loaded`)."""
        while True:
            with self._lock:
                w = self._live_worker(key)
                if w is not None:
                    return w
                wait = self._backoff(key)
            if wait <= 0:
                break
            time.sleep(wait)  # a worker that keeps dying is not restarted in a tight loop
        with self._spawn_lock:  # one start at a time: the zygote answers in order
            with self._lock:
                w = self._live_worker(key)
                if w is not None:
                    return w
            ours, theirs = pair()
            t0 = time.monotonic()
            try:
                if self.zygote is None:
                    raise OSError("worker processes are not started")
                pid = self.zygote.spawn(theirs, key)
            except OSError as e:
                ours.close()
                raise InferdError(f"cannot start a worker for {key}: {e}",
                                  ErrorCode.UNAVAILABLE) from e
            w = Worker(key, backend, pid, Channel(ours, writable_peer=True))
            try:
                w.pidfd = os.pidfd_open(pid)
            except OSError:
                w.pidfd = -1  # reaped already: the zygote's report ends it
            with self._lock:
                w.pending = 1
                self._workers[key] = w
                self._by_pid[pid] = w
                self._last_start[key] = time.monotonic()
                status = self._statuses.pop(pid, None)
        log.info("worker %s started: pid %d in %.1f ms", key, pid,
                 (time.monotonic() - t0) * 1e3,
                 extra={"BACKEND": backend, "WORKER_PID": pid})
        if status is not None:
            self._exited(pid, status)
        return w

    def _live_worker(self, key: str) -> Worker | None:
        """``key``'s live worker with one more load pending on it (the pool's lock held);
        raises while the daemon stops."""
        if self._closed:
            raise InferdError("the daemon is stopping", ErrorCode.UNAVAILABLE)
        w = self._workers.get(key)
        if w is not None and w.alive:
            w.pending += 1
            return w
        return None

    def _prestart(self, key: str, backend: str) -> None:
        """Start ``key``'s worker again at once and import its engine, so that the next
        request pays only its model's load (a worker nobody loads in ends after
        ``idle_exit_s``)."""
        try:
            w = self.worker(key, backend)
        except InferdError:
            return  # stopping, or the zygote is gone: the next request says so
        try:
            self.call(w, {"op": "engine", "backend": backend}, f"the import of {backend}",
                      timeout=self.kill_after_s)
        except InferdError as e:
            log.warning("worker %s: importing %s ahead of the next request failed: %s", key,
                        backend, e.message, extra={"BACKEND": backend})
        finally:
            self.loaded(w, False)

    def _backoff(self, key: str) -> float:
        deaths = self._deaths.get(key)
        if not deaths:
            return 0.0
        now = time.monotonic()
        while deaths and now - deaths[0] > 60:
            deaths.popleft()
        if not deaths:
            return 0.0
        delay = min(30.0, self.restart_backoff_s * 2 ** (len(deaths) - 1))
        return max(0.0, self._last_start.get(key, 0.0) + delay - now)

    def _exited(self, pid: int, status: int) -> None:
        """The zygote's report: worker ``pid`` ended with wait status ``status``."""
        with self._lock:
            w = self._by_pid.pop(pid, None)
            if w is None:
                self._statuses[pid] = status
                return
            w.status = status
            w.reason = w.killed_for or describe_status(status)
            if self._workers.get(w.name) is w:
                del self._workers[w.name]
            expected = self._closed or w.killed_for == "unloaded"
            if not expected:
                self._deaths.setdefault(w.name, collections.deque()).append(
                    time.monotonic())
            running = list(w.running.values())
            w.ended.set()
        w.close_pidfd()
        for then in w.on_end:
            then()
        if expected:
            return
        what = f" while running {', '.join(sorted(set(running)))}" if running else ""
        reason = "killed" if w.killed_for else (
            "signal" if os.WIFSIGNALED(status) else "exit")
        self.restarts[(w.backend, reason)] += 1
        rival = w.name.endswith(MEASURING)  # nothing loads there again: the placer
        log.error("%s (worker %d) %s%s; %s", w.label, pid, w.reason, what,
                  "it held a candidate being measured for placement, which is not chosen"
                  if rival else "its steps are built again in a new worker on their next "
                  "call" if w.backend == PROCESSORS else "its models load again in a new "
                  "worker on their next request", extra={"BACKEND": w.backend, "WORKER_PID": pid,
                                    "REASON": reason})
        if self._on_restart is not None:
            self._on_restart(w.backend, reason)
        if rival:
            return
        threading.Thread(target=self._prestart, args=(w.name, w.backend),
                         name="inferd-worker-restart", daemon=True).start()

    def death(self, w: Worker, what: str) -> WorkerDied:
        """The error for a call on ``w`` (running ``what``) that found it gone."""
        w.ended.wait(STATUS_WAIT_S)  # the zygote's word on how it ended
        how = w.reason or "ended"
        return WorkerDied(f"{w.label} (worker {w.pid}) {how} while running "
                          f"{what}")

    def kill(self, w: Worker, why: str) -> None:
        w.killed_for = w.killed_for or why
        w.send_kill()

    # ----------------------------------------------------------------- calls

    def call(self, w: Worker, header: dict[str, Any], what: str,
             tensors: dict[str, NDArray[Any]] | None = None, timeout: float | None = None,
             key: str = "workers.kill_after_s", into: Slot | None = None,
             lend: bool = False) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """One call on one of ``w``'s channels, waited for (:meth:`begin`, then
        :meth:`Call.wait`); the reply's tensors are the daemon's own
        (copied out of the worker's arena; with ``lend``, views of it while fewer than
        :data:`LENT_MAX` channels are lent: the module's "Outputs without a copy"), or
        views of the shared-memory slot ``into`` for those the worker wrote there.
        Tensors in a registered region go by reference (the module's "Shared memory").

        Raises:
            WorkerDied: the worker ended (or was killed) during the call.
            InferdError: the call's own failure, as the worker raised it.
        """
        return self.begin(w, header, what, tensors, timeout, key, into, lend).wait()

    def begin(self, w: Worker, header: dict[str, Any], what: str,
              tensors: dict[str, NDArray[Any]] | None = None, timeout: float | None = None,
              key: str = "workers.kill_after_s", into: Slot | None = None,
              lend: bool = False) -> Call:
        """Send a call (as :meth:`call` does) and return it in flight, without waiting:
        :meth:`Call.wait` waits for its reply; the I/O thread instead polls
        :meth:`Call.fileno` and takes the reply with :meth:`Call.receive` and
        :meth:`Call.result` once it is readable (daemon/model_threads.py, "Runs in a
        worker from the I/O thread").

        Raises:
            InferdError: nothing was sent (a tensor the channel cannot carry, no
                channel to a worker that is gone).
        """
        channel = self._channel(w, what)
        plan = self._by_reference(w, header, tensors, into) if (
            tensors or into is not None) else _Plan(tensors)
        call = Call(self, w, channel, plan, header.get("op"), what,
                    self.kill_after_s if timeout is None else timeout, key, into, lend)
        w.running[id(call)] = what
        try:
            channel.send(header, plan.tensors, plan.fds)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a worker gone: receive() says so
        except BaseException:  # nothing was sent (a tensor the channel cannot carry)
            w.running.pop(id(call), None)
            if plan.used:
                self._unuse(plan.used)
            with w.lock:
                w.idle.append(channel)
            raise
        return call

    def _answered(self, call: Call, reply: dict[str, Any], out: dict[str, NDArray[Any]]
                  ) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """What :meth:`Call.result` returns for a reply that came: the regions the
        worker maps now noted, its memory checked, the channel back in use, the
        worker's error raised, outputs it placed in a slot taken as views."""
        w, channel = call.w, call.channel
        if call.plan.maps or "unmapped" in reply:
            with self._lock:  # mapped there now (an unmapped one is passed again)
                unmapped = set(reply.get("unmapped", ()))
                for rid in unmapped:
                    w.regions.pop(rid, None)
                for rid, _, writable in call.plan.maps:
                    if rid in unmapped or rid not in self._shared:
                        continue
                    w.regions[rid] = w.regions.get(rid, False) or writable
        if self.max_memory is not None and call.op in ("run", "step"):
            rss = _resident(w.pid)
            if rss > self.max_memory:  # this run made it grow: it is charged with it
                channel.close()
                self.kill(w, f"was killed: its resident memory {rss / 2**20:.1f} MiB passed "
                             f"workers.max_memory ({self.max_memory / 2**20:.1f} MiB)")
                raise self.death(w, call.what)
        over = arm = False
        with w.lock:
            if not channel.lent():
                arm = self._freed(w, channel, w.idle)
            elif sum(c.lent() for c in w.lent) < LENT_MAX:
                arm = self._freed(w, channel, w.lent)
            else:
                over = True
        if over:  # LENT_MAX lent already: copied, and the channel is free once they are
            out = _owned(out)
            with w.lock:  # taken back by _channel when no view is left
                arm = self._freed(w, channel, w.lent)
        if arm:
            self._later(self.channel_idle_s, self._shed, w, "channels")
        if "error" in reply:
            raise decode_error(reply["error"])
        placed = reply.get("placed")
        if placed:
            assert call.into is not None
            out = self._placed(w, call.into, placed, reply["order"], out)
        return reply, out

    # ----------------------------------------------------------------- shared memory

    def _by_reference(self, w: Worker, header: dict[str, Any],
                      tensors: dict[str, NDArray[Any]] | None, into: Slot | None) -> _Plan:
        """Which of ``tensors`` go by reference to a region (named in ``header``), and
        the descriptors ``w`` needs for them and for the slot ``into``; the rest go
        through the channel."""
        tensors = tensors or {}
        found = {}
        for name, a in tensors.items():
            where = shared_of(a)
            if where is not None:
                found[name] = where
        slot = shared_of(np.frombuffer(into.buffer, np.uint8)) if into is not None else None
        if not found and slot is None:
            return _Plan(tensors)
        wanted: dict[int, tuple[Shared, bool]] = {}
        for shared, _ in found.values():
            wanted[shared.id] = (shared, False)
        if slot is not None:
            wanted[slot[0].id] = (slot[0], True)
        plan = _Plan(None)
        ok: set[int] = set()
        with self._lock:
            for rid, (shared, writable) in wanted.items():
                if rid not in self._shared:
                    if not shared.listen(self._released):
                        continue  # released: its tensors are copied (they are alive)
                    self._shared[rid] = shared
                if shared.released:
                    continue
                have = w.regions.get(rid)
                if have is None and len(w.regions) >= self.region_limit:
                    continue  # the worker's descriptors: copied instead
                if have is None or (writable and not have):
                    plan.maps.append((rid, shared.size, writable))
                    plan.fds.append(shared.fd)
                self._uses[rid] += 1
                plan.used.append(shared)
                ok.add(rid)
        rest: dict[str, NDArray[Any]] = {}
        refs: dict[str, tuple[int, int, str, tuple[int, ...], int]] = {}
        for name, a in tensors.items():
            where = found.get(name)
            if where is not None and where[0].id in ok:
                refs[name] = (where[0].id, where[1], dtype_code(a), a.shape, a.nbytes)
                self.by_reference += a.nbytes
            else:
                rest[name] = a
        plan.tensors = rest
        if refs:
            header["refs"] = refs
            header["order"] = list(tensors)
        if plan.maps:
            header["maps"] = plan.maps
        if slot is not None and slot[0].id in ok:
            assert into is not None
            header["into"] = (slot[0].id, into.offset + into.used, into.offset + into.size)
        return plan

    def _placed(self, w: Worker, into: Slot, placed: dict[str, Any], order: list[str],
                out: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """The outputs the worker wrote into ``into``, as views of it (each checked to lie
        in the slot), with those that came through the channel, in the model's order."""
        end = into.offset + into.size
        for name, (start, code, shape, nbytes) in placed.items():
            if not (into.offset <= start and start + nbytes <= end):
                raise InferdError(f"worker {w.pid} placed output {name!r} ({nbytes} bytes "
                                  f"at {start}) outside the slot of {into.size} bytes at "
                                  f"{into.offset}", ErrorCode.INTERNAL)
            dtype = dtype_of(code)
            count = nbytes // dtype.itemsize if dtype.itemsize else 0
            out[name] = np.frombuffer(into.buffer, dtype, count, start).reshape(shape)
        return {name: out[name] for name in order if name in out}

    def _released(self, shared: Shared) -> None:
        """``shared`` was released by its client: unmapped in the workers once no call
        uses it (the last call out does it otherwise, :meth:`_unuse`)."""
        with self._lock:
            if self._uses[shared.id] <= 0:
                self._forget(shared.id)

    def _unuse(self, used: list[Shared]) -> None:
        with self._lock:
            for shared in used:
                self._uses[shared.id] -= 1
                if self._uses[shared.id] <= 0:
                    del self._uses[shared.id]
                    if shared.released:
                        self._forget(shared.id)

    def _forget(self, rid: int) -> None:
        """Have every worker that maps region ``rid`` unmap it (the pool's lock held)."""
        self._shared.pop(rid, None)
        for w in self._workers.values():
            if w.regions.pop(rid, None) is not None:
                self._forgets.setdefault(id(w), (w, []))[1].append(rid)
        if self._forgets and not self._forgetting and not self._closed:
            self._forgetting = True
            threading.Thread(target=self._forget_loop, name="inferd-worker-forget",
                             daemon=True).start()

    def _forget_loop(self) -> None:
        while True:
            with self._lock:
                if not self._forgets or self._closed:
                    self._forgets.clear()
                    self._forgetting = False
                    return
                batch, self._forgets = self._forgets, {}
            for w, rids in batch.values():
                if not w.alive:
                    continue
                try:
                    self.call(w, {"op": "forget", "regions": rids},
                              "the release of a shared-memory region")
                except InferdError as e:
                    log.debug("worker %d: forgetting regions %s failed: %s", w.pid, rids,
                              e.message)

    def _channel(self, w: Worker, what: str) -> Channel:
        with w.lock:
            if w.lent:  # those whose reply's tensors are gone serve again, under
                w.idle[:0] = w.take_unlent()  # those freed since (taken first)
            if w.idle:
                return w.idle.pop()
        if not w.alive:
            raise self.death(w, what)
        ours, theirs = pair()
        with w.lock:  # the control channel carries the new channel's end
            try:
                w.control.settimeout(10.0)
                w.control.send({"op": "channel"}, fds=[theirs.fileno()])
                w.control.receive()
            except Unreadable as e:
                ours.close()
                self.kill(w, f"was killed for {e}")
                raise self.death(w, what) from None
            except (Gone, OSError):
                ours.close()
                raise self.death(w, what) from None
            finally:
                theirs.close()
        return Channel(ours, writable_peer=True)

    def _freed(self, w: Worker, channel: Channel, into: list[Channel]) -> bool:
        """``channel`` of ``w`` answered its call: into ``w.idle`` (free) or ``w.lent``
        (free once its reply's tensors are gone), ``w.lock`` held. The most recently
        freed is the next taken, so those a burst of calls opened age at the bottom, and
        :meth:`_shed` closes them once unused for ``channel_idle_s``. True if the caller
        must arm that look (:meth:`_later`, once the lock is released: the pool's lock
        is never taken under a worker's)."""
        channel.idle_since = time.monotonic()
        into.append(channel)
        if w.shedding or self._closed:
            return False
        w.shedding = True
        return True

    def _later(self, seconds: float, fn: Callable[[Worker], None], w: Worker,
               what: str) -> None:
        """Call ``fn(w)`` on a timer thread ``inferd-worker-WHAT-PID`` after ``seconds``,
        unless the pool closes first (:meth:`close` cancels it). Not under the pool's
        lock (it takes it)."""
        timer = threading.Timer(seconds, fn, (w,))
        timer.name = f"inferd-worker-{what}-{w.pid}"
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers = {t for t in self._timers if t.is_alive()
                            and t is not threading.current_thread()}
            self._timers.add(timer)
        timer.start()

    def _shed(self, w: Worker) -> None:
        """Close ``w``'s channels unused for ``channel_idle_s``: each holds an arena at
        each end as large as the largest message it carried (the OCR detector's input,
        17 MiB, on every channel that a burst of images opened), kept resident while the
        channel lives; the worker's thread that served it ends with it. A call later
        opens a channel again (one round trip on the control channel). Looks again when
        the next is due, while any channel is left free or lent."""
        now = time.monotonic()
        limit = self.channel_idle_s
        with w.lock:
            free = sorted([*w.idle, *w.take_unlent()], key=lambda c: c.idle_since)
            shed = [c for c in free if now - c.idle_since >= limit]
            w.idle = [c for c in free if now - c.idle_since < limit]
            if self._closed or not w.alive or not (w.idle or w.lent):
                again = None
            else:  # the oldest free one's turn, or a lent one's once its views are gone
                again = w.idle[0].idle_since + limit - now if w.idle else limit
            w.shedding = again is not None
        for channel in shed:
            channel.close()
        if shed:
            log.debug("worker %s (pid %d): %d channel(s) unused for %g s closed", w.name,
                      w.pid, len(shed), limit)
        if again is not None:
            self._later(max(again, 0.01), self._shed, w, "channels")

    def rss(self, w: Worker) -> int | None:
        try:
            reply, _ = self.call(w, {"op": "stats"}, "stats", timeout=5.0,
                                 key="a 5 s limit")
        except InferdError:
            return None
        return int(reply["rss"])

    def loaded(self, w: Worker, ok: bool) -> None:
        """The load :meth:`worker` counted as pending on ``w`` ended (``ok``: the model is
        in it now)."""
        with self._lock:
            w.pending -= 1
            w.models += ok
        if not ok:
            self._idle_soon(w)

    def unloaded(self, w: Worker) -> None:
        """A model left ``w``. A worker with no model left ends after
        ``idle_exit_s`` unless a load comes first (memory a worker keeps after an
        unload is not room; an engine imported again for each of a run of loads and
        unloads costs a second each); a measuring worker (:data:`MEASURING`) at once:
        its one candidate is done with, and its 60-130 MiB left for ``idle_exit_s``
        beside the workers that serve made the daemon's peak (bench/bench_memory.py)."""
        with self._lock:
            w.models -= 1
        self._idle_soon(w)

    def _idle_soon(self, w: Worker) -> None:
        with self._lock:
            if w.models > 0 or w.pending > 0 or self._closed:
                return
        if w.name.endswith(MEASURING):
            self._retire(w)
        else:
            self._later(self.idle_exit_s, self._retire, w, "idle")

    def _retire(self, w: Worker) -> None:
        with self._lock:
            if w.models > 0 or w.pending > 0 or w.running or self._workers.get(w.name) is not w:
                return
            del self._workers[w.name]
            w.killed_for = "unloaded"
        if w.name.endswith(MEASURING):
            log.info("worker %s (pid %d) ends: its candidate is measured", w.name, w.pid,
                     extra={"BACKEND": w.backend, "WORKER_PID": w.pid})
        else:
            log.info("worker %s (pid %d) ends: no model left in it for %g s", w.name,
                     w.pid, self.idle_exit_s,
                     extra={"BACKEND": w.backend, "WORKER_PID": w.pid})
        with w.lock:  # closing its control channel ends it
            for channel in (w.control, *w.idle, *w.lent):
                channel.close()  # a lent arena stays mapped while its tensors live
            w.idle.clear()
            w.lent.clear()

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {k: w.pid for k, w in self._workers.items() if w.alive}

    def close(self) -> None:
        """End every worker and the zygote; nothing of the pool is left (threads, fds)."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
            timers, self._timers = self._timers, set()
        for timer in timers:
            timer.cancel()
        for w in workers:
            self.kill(w, "stopped")
        if self.zygote is not None:
            self.zygote.close()  # reaped: every worker's end is reported before this
        with self._lock:  # and those retired (a measuring one ends at once) whose end
            # was not reported yet: out of the map, but their pidfds still open
            late = [w for w in self._by_pid.values() if all(w is not x for x in workers)]
            self._by_pid.clear()
        for w in (*workers, *late):
            with w.lock:
                for channel in (w.control, *w.idle, *w.lent):
                    channel.close()
                w.idle.clear()
                w.lent.clear()
            w.close_pidfd()


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _owned(tensors: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
    """``tensors`` as copies of their own (those that view a lent arena let go of it)."""
    return {name: np.array(a, copy=True) for name, a in tensors.items()}


def _resident(pid: int) -> int:
    """A process's resident bytes (``/proc/PID/statm``, ~5 µs); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


MEASURING = " (measuring)"
"""The end of the name of a worker that holds one rival being measured (its own): one
that dies is not started again (the placer skips the candidate)."""


@dataclass
class LoadCall:
    """Everything a worker needs to load one model version (kept to load it again after
    its worker died)."""

    backend: str
    path: Path
    options: LoadOptions
    model: str
    model_dir: Path
    fallbacks: tuple[str, ...]
    tables: dict[str, Any]
    probe_timeout_s: float
    key: str
    strict_modes: bool = True
    cores: tuple[int, ...] = ()
    """model.toml ``cpu_affinity``: the cores its load and runs keep to (none: any)."""

    def header(self) -> dict[str, Any]:
        return {"op": "load", "backend": self.backend, "path": str(self.path),
                "cores": list(self.cores),
                "options": self.options, "model": self.model,
                "model_dir": str(self.model_dir), "fallbacks": list(self.fallbacks),
                "tables": self.tables, "probe_timeout_s": self.probe_timeout_s,
                "strict_modes": self.strict_modes}


class WorkerModel(InWorker, LoadedModel):
    """A model loaded in a worker process, run from the daemon like any loaded model."""

    def __init__(self, pool: WorkerPool, call: LoadCall, load_timeout_s: float) -> None:
        super().__init__()
        self.pool = pool
        self.call = call
        self.load_timeout_s = load_timeout_s
        self._remake()

    def _remake(self) -> None:
        reply = self._make(self.call.key, self.call.backend, self.call.header(),
                           f"the load of {self.call.model}", self.load_timeout_s,
                           "workers.load_kill_after_s")
        self.inputs: tuple[TensorSpec, ...] = tuple(reply["inputs"])
        self.outputs: tuple[TensorSpec, ...] = tuple(reply["outputs"])
        self.device = reply["device"] or ""
        self._describe: dict[str, Any] = dict(reply["describe"])
        self._batch_sizes: BatchSizes | None = reply["batch_sizes"]
        self.reported: int | None = reply["reported"]
        """What the backend said the model uses (None: it cannot tell)."""
        self.added = int(reply["added"])
        """The worker's resident growth across the load: measured where the model is,
        not in the daemon, whose size moves with whatever it serves meanwhile (a model
        moved by placement beside the OCR graph counted 35-63 MiB of the graph's
        tensors so)."""
        self.engine_bytes = int(reply["engine"])
        self._memory = max(self.added, self.reported or 0)

    def _gone(self) -> str:
        return f"model {self.call.model} is unloaded"

    @property
    def handle(self) -> int:
        return self._at[1]

    @property
    def pid(self) -> int:
        return self.worker.pid

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        into = OUTPUTS_INTO.slot
        if into is not None:  # this run's, not a later one's on this thread
            OUTPUTS_INTO.slot = None
        reply, out = self._send(self._live(), inputs, outputs, into).wait()
        ENGINE_TIME.seconds = reply["took"]
        return out

    def start(self, inputs: dict[str, NDArray[Any]], outputs: list[str] | None = None,
              into: Slot | None = None) -> Call | None:
        """Send a run without waiting for it (:meth:`WorkerPool.begin`: the I/O thread's
        way, daemon/model_threads.py); None if its worker is gone (the model loads again
        in a new one: that is left to a run that waits)."""
        at = self._at
        if not at[0].alive or self._closed:
            return None
        return self._send(at, inputs, outputs, into)

    def _send(self, at: tuple[Worker, int], inputs: dict[str, NDArray[Any]],
              outputs: list[str] | None, into: Slot | None) -> Call:
        """Send a run to the model in its worker (``at``: the worker and the handle
        there); its outputs come back as views of the worker's arena."""
        w, handle = at
        return self.pool.begin(w, {"op": "run", "handle": handle, "outputs": outputs},
                               self.call.model, inputs, into=into, lend=True)

    def threads(self) -> list[tuple[int, list[int]]]:
        """The worker's threads that ran this model (native id, the cores the kernel
        allows it); none if the worker cannot say now (busy past a second, or gone)."""
        w, handle = self._at
        if not w.alive:
            return []
        try:
            reply, _ = self.pool.call(w, {"op": "threads", "handle": handle},
                                      f"the threads of {self.call.model}", timeout=1.0)
        except InferdError:
            return []
        return [(int(tid), list(cores)) for tid, cores in reply["threads"]]

    def unload(self) -> None:
        self._let_go("unload", f"model {self.call.model}", self.call.model)

    def memory_bytes(self) -> int | None:
        return self._memory

    def peak(self, shapes: dict[str, Any], values: dict[str, NDArray[Any]]) -> Peak:
        """:meth:`inferd.daemon.activations.Activations.peak`, computed in the worker."""
        w, handle = self._live()
        reply, _ = self.pool.call(w, {"op": "peak", "handle": handle,
                                      "path": str(self.call.path), "shapes": dict(shapes)},
                                  f"the activations of {self.call.model}", values)
        return Peak(*reply["peak"])

    def trim(self) -> None:
        """Free heap back to the system in the worker (before a measured run: a worker
        that died is started again first, so that the run is measured where it runs)."""
        w, _ = self._live()
        if w.alive:
            try:
                self.pool.call(w, {"op": "trim"}, "a trim", timeout=10.0,
                               key="a 10 s limit")
            except InferdError:
                pass  # a worker gone meanwhile: the run itself will say so

    def describe(self) -> dict[str, Any]:
        w = self.worker
        return {**self._describe, "worker": {"name": w.name, "pid": w.pid}}

    def batch_sizes(self) -> BatchSizes | None:
        return self._batch_sizes
