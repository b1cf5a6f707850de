"""The runtime: one object that owns a daemon's backends, models and server, and answers
each protocol op. Several runtimes can live in one process (tests do that)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

from inferd.daemon import logs
from inferd.daemon.config import Config, load_config
from inferd.daemon.graphs import GraphManager
from inferd.daemon.inline import InlineOps
from inferd.daemon.workers.pool import WorkerPool
from inferd.daemon.workers.steps import RemoteSteps
from inferd.daemon.watch import Watch
from inferd.daemon.metrics import Metrics, TextfileWriter, textfile_wanted
from inferd.daemon.metrics_http import MetricsEndpoint, parse_listen
from inferd.daemon.models import ModelManager
from inferd.daemon.pipeline import unpin_current_thread
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.reload import ReloadRuns
from inferd.daemon.repository import Repository
from inferd.daemon.systemd import Notifier, Watchdog, watchdog_interval
from inferd.ipc.errors import ErrorCode, InferdError, ModelError, failure
from inferd.ipc.libc import set_arena_max, set_mmap_threshold
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import ReplySink, Ticket
from inferd.ipc.access import Access
from inferd.ipc.server import Server
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.customops.discovery import load_global
from inferd.libbackends.loader import load_backends
from inferd.libbackends.registry import Registry
from inferd.libbackends.trust import StrictModes

log = logging.getLogger(__name__)

RESTART_SECTIONS = ("server", "backends", "customops", "processors", "metrics", "security",
                    "workers")
"""Config sections a reload does not apply (reported as needs_restart)."""
STOP_MARGIN_S = 5.0
"""How long past the grace period :meth:`Runtime.serve` waits for the models to stop."""

try:
    VERSION = version("inferd")
except PackageNotFoundError:  # running from a source tree that is not installed
    VERSION = "0+unknown"


def remeasure_names(value: Any) -> list[str] | bool:
    """The reload op's ``remeasure`` parameter: absent or false -> False (nothing),
    true -> True (every model), a list of model names -> that list.

    Raises:
        InferdError (INVALID_ARGUMENT): anything else.
    """
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise InferdError(f"reload: remeasure = {value!r}: expected true or a list of model "
                      f"names", ErrorCode.INVALID_ARGUMENT)


HELD_FLOOR = 64 * 2**20
"""The least ``server.max_bytes_in_flight = "auto"`` gives."""


def requests_bound(config: Config) -> int:
    """``server.max_bytes_in_flight`` in bytes (0: no bound). ``"auto"``: half of the
    physical memory the cache budget leaves, at most a quarter of it, at least
    :data:`HELD_FLOOR` (a 2 GB board with the default budget of 75 %: 256 MiB)."""
    value = config.server.max_bytes_in_flight
    if value is not None:
        return int(value)
    total = psutil.virtual_memory().total
    budget = config.cache.max_memory
    left = total - budget if budget is not None else total
    return max(HELD_FLOOR, min(left // 2, total // 4))


MESSAGE_FLOOR = 32 * 2**10
"""The least ``server.max_message_bytes = "auto"`` gives: what the clients take inline
whatever the daemon (``inferd.ipc.staging.INLINE_BYTES``); twice it is 64 KiB, so a
header of the protocol's largest (65,536 bytes) is answered, never dropped by libzmq."""
MESSAGE_CEILING = 256 * 2**20
"""The most ``"auto"`` gives (the fixed default before it was derived)."""


def message_bound(config: Config, held: int) -> int:
    """``server.max_message_bytes`` in bytes. ``"auto"``: ``held``
    (``max_bytes_in_flight``, 0: none) over 4 x ``max_connections``, within
    :data:`MESSAGE_FLOOR` and :data:`MESSAGE_CEILING`. libzmq holds at most two messages
    per connection before the daemon reads them (one in the receive pipe, whose high-water
    mark is 1, and one being received), each frame at most twice this (``ZMQ_MAXMSGSIZE``):
    4 x this x ``max_connections`` bytes for all connections together, no more than
    ``max_bytes_in_flight`` (above the floor). ``held`` 0: the ceiling (nothing bounds)."""
    value = config.server.max_message_bytes
    if value is not None:
        return int(value)
    if held <= 0:
        return MESSAGE_CEILING
    per = held // (4 * config.server.max_connections)
    return max(MESSAGE_FLOOR, min(MESSAGE_CEILING, per))


class Runtime:
    """A daemon instance: call :meth:`start`, then :meth:`serve` on the main thread.

    Args:
        config: the validated configuration.
        overrides: the command-line values, kept over reloads.
    """

    def __init__(self, config: Config, overrides: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self._overrides = dict(overrides or {})  # command-line values, kept over reloads
        self.notifier = Notifier.from_env()
        self._watchdog: Watchdog | None = None
        self._preload_failed: list[str] = []
        self.started = time.time()
        self.ready = threading.Event()
        self.registry = Registry()
        self.repo = Repository(Path(config.models.repository).resolve(),
                               config.models.allow_external_links)
        # Reads the runtime only when collected; counts each answered request's ticket.
        self.metrics = Metrics(self)
        held = requests_bound(config)
        self.server = Server(config.server.socket, self.handle,
                             max_message_bytes=message_bound(config, held),
                             socket_mode=config.server.socket_mode,
                             grace_s=config.server.shutdown_grace_s,
                             socket_group=config.server.socket_group,
                             cpu_affinity=config.server.cpu_affinity,
                             access=Access.of(config.access.uids, config.access.gids),
                             max_requests_per_client=config.server.max_requests_per_client,
                             max_bytes_per_client=config.server.max_bytes_per_client,
                             max_replies_queued_per_client=(
                                 config.server.max_replies_queued_per_client),
                             max_connections=config.server.max_connections,
                             max_bytes_in_flight=held,
                             observe=self.metrics.count, resolve=self.resolve)
        self.server.on_stop = self._on_stop
        self.server.on_peer_gone = self._peer_gone
        # Wire tickets are counted by the server, in-process ones (graph nodes calling
        # models) by the sink.
        sink = ReplySink(self.server.send_reply, observe=self.metrics.count)
        self.customops = OpRegistry()
        # engines in worker processes ([workers] isolation); forked at start
        self.workers = (None if config.workers.isolation == "in-process" else
                        WorkerPool(self.registry, self.customops,
                                   config.workers.kill_after_s,
                                   config.workers.restart_backoff_s,
                                   config.workers.max_memory,
                                   config.workers.idle_exit_s,
                                   config.workers.channel_idle_s))
        # with workers, every processor step is built and run in the processors worker
        # (its user files imported there only); else here, the user files at start
        steps = None if self.workers is None else RemoteSteps(
            self.workers, config.processors.directory, config.security.strict_modes,
            config.workers.kill_after_s)
        self.processors = ProcessorRegistry(StrictModes(config.security.strict_modes),
                                            remote=steps)
        self.models = ModelManager(self.repo, self.registry, lambda: self.config, sink,
                                   observer=self.metrics, processors=self.processors,
                                   customops=self.customops, workers=self.workers,
                                   watch=self.server.watch)
        if steps is not None:  # what the processors worker holds counts in the budget
            steps.on_memory = self.models.budget.worker_holds
        self.graphs = GraphManager(self.repo, self.processors, self.models, sink)
        # measuring placement yields to every request in flight (a graph's between its
        # models' runs too)
        self.models.placer.yield_to(lambda: bool(self.server.open_tickets()))
        # deadlines answered and stuck stages reported whatever a stage does
        self.watch = Watch(sink, self.server, self.models, self.graphs, lambda: self.config)
        self._textfile: TextfileWriter | None = None
        self._endpoint: MetricsEndpoint | None = None
        self._control = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-control",
                                           initializer=unpin_current_thread)
        self.reloads = ReloadRuns(self.reload, self._control.submit)
        self.inline = InlineOps(self.server.send_reply, self._collect_metrics)
        self._stopped = threading.Event()
        self._workers_done = True
        self._proc = psutil.Process()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Register backends, bind the socket and start the preload in the background."""
        set_arena_max(self.config.cache.malloc_arenas)
        set_mmap_threshold(self.config.cache.malloc_mmap_threshold)
        load_backends(self.registry, self.config)
        load_global(self.customops, self.config)
        if self.workers is None:
            self.processors.load_directory(self.config.processors.directory)
        else:
            self.workers.start()  # forks the zygote: before any thread of the daemon
        self.server.bind()
        self.inline.start()
        if isinstance(self.processors.remote, RemoteSteps):
            self.processors.remote.start()  # the user files' log lines, now
        self.models.start()
        self.watch.start()
        log.info("inferd %s serving %s (models in %s, pid %d)", VERSION,
                 self.config.server.socket, self.repo.root, os.getpid())
        problem = self.repo.problem()
        if problem:
            log.warning("%s (models.repository): no model can be served until it is there "
                        "and the daemon reloads", problem)
        interval = watchdog_interval()
        if interval is not None and self.notifier.enabled:
            self._watchdog = Watchdog(self.notifier, interval, self._health)
            self._watchdog.start()
        self._start_metrics()
        threading.Thread(target=self._preload, name="inferd-preload", daemon=True).start()

    def _start_metrics(self) -> None:
        m = self.config.metrics
        if m.textfile and textfile_wanted(Path(m.textfile), self.notifier.enabled):
            self._textfile = TextfileWriter(self.metrics, Path(m.textfile), m.interval_s)
            self._textfile.start()
        listen = parse_listen(m.listen)
        if listen is not None:
            try:
                self._endpoint = MetricsEndpoint(listen, self.metrics.text)
            except OSError as e:
                raise InferdError(f"cannot serve metrics at {listen.describe()} "
                                  f"(metrics.listen): {e.strerror}",
                                  ErrorCode.UNAVAILABLE) from e
            self._endpoint.start()

    def _stop_metrics(self) -> None:
        if self._endpoint is not None:
            self._endpoint.stop()
        if self._textfile is not None:
            self._textfile.stop()

    def _preload(self) -> None:
        def each(i: int, count: int, name: str) -> None:
            # Each load may take long on a small board: ask systemd for time per model,
            # so a preload that progresses is not killed while a stuck one still is.
            self.notifier.extend_timeout(self.config.systemd.extend_timeout_s,
                                         f"preloading model {name} ({i}/{count})")
        self._preload_failed = self.models.load_pinned(before_each=each)
        self._preload_failed += self._preload_graphs(self.models.catalog.preloaded_graphs(),
                                                     each)
        # the preloaded models' placement is measured before READY (their candidates in
        # workers of their own, on their warm-up inputs), within a bound: past it they
        # serve on their first candidate and measuring goes on beside serving
        bound = self.config.placement.ready_within_s
        if bound > 0:
            self.notifier.extend_timeout(bound + self.config.systemd.extend_timeout_s,
                                         "measuring the preloaded models' placement")
            left = self.models.placer.settle(bound)
            if left:
                log.info("placement of %s still measured after %g s ([placement] "
                         "ready_within_s): served on the first candidate meanwhile",
                         ", ".join(left), bound)
        self.ready.set()
        line = self.status_line()
        log.info("%s", line)
        self.notifier.ready(line)

    def _preload_graphs(self, names: list[str],
                        before_each: Callable[[int, int, str], None] | None = None
                        ) -> list[str]:
        """Load each graph of ``names`` (``models.preload``), then the models its nodes
        call (not pinned: the cache may evict them as it would lazily loaded ones), so
        that its first request pays neither (the processors worker's start and its steps'
        imports, ~1.4 s for the demo's ocr graph here, and the models' loads); the names
        that failed (logged)."""
        failed = []
        for name in names:
            try:
                models = self.graphs.preload(name)
                log.info("graph %s preloaded; loading its models: %s", name,
                         ", ".join(models) or "none", extra={"MODEL": name})
                for i, model in enumerate(models, 1):
                    if before_each is not None:
                        before_each(i, len(models), model)
                    self.models.load(model)
            except InferdError as e:
                log.error("preloaded graph %s failed to load: %s", name, e.message,
                          extra={"MODEL": name})
                failed.append(name)
        return failed

    def status_line(self) -> str:
        """One line for ``systemctl status``: backends loaded/failed, models warm."""
        ok = [r["id"] for r in self.registry.describe() if r["status"] == "registered"]
        # Every candidate the loader gave up on (or whose device is absent), by name; a
        # built-in whose id a plugin serves (Debian: onnxruntime from the add-on) is not a
        # failure worth a word in systemctl status; nor, while some backend is loaded, one
        # whose module is not installed or whose device is absent (onnxruntime-gpu on the
        # CPU build).
        bad = [Path(c["path"]).name for c in self.registry.view().get("candidates", [])
               if c["status"] in ("failed", "unavailable")
               and not (c["path"].startswith("built-in:")
                        and (c["path"].removeprefix("built-in:") in ok
                             or (ok and (c["stage"] == "opened"
                                         or c["status"] == "unavailable"))))]
        warm = self.models.loaded()
        parts = [f"backends: {len(ok)} loaded" + (f" ({', '.join(ok)})" if ok else "")
                 + f", {len(bad)} failed" + (f" ({', '.join(bad)})" if bad else ""),
                 f"models warm: {len(warm)}" + (f" ({', '.join(warm)})" if warm else "")]
        if self._preload_failed:
            parts.append(f"preload failed: {', '.join(self._preload_failed)}")
        return ("ready; " if self.ready.is_set() else "starting; ") + "; ".join(parts)

    def _health(self, limit: float) -> str | None:
        """Watchdog probe: the I/O loop answers a heartbeat, every worker thread of a
        ready model is alive, and the worker zygote is. None when healthy, else why
        not."""
        beat = threading.Event()
        self.server.call_soon(beat.set)
        if not beat.wait(limit):
            return f"the I/O loop did not answer a heartbeat within {limit:.3g} s"
        dead = self.models.dead_worker_threads()
        if dead:
            return f"worker threads are gone: {', '.join(dead)}"
        zygote = self.workers.zygote if self.workers is not None else None
        if zygote is not None and zygote.ended:  # no worker can start: restart the daemon
            return f"the worker zygote (pid {zygote.pid}) {zygote.ended}"
        stuck = self.watch.all_stuck() if self.config.systemd.watchdog_stuck else {}
        if stuck:
            return "; ".join(f"every inference thread of model {m} is stuck: {', '.join(s)}"
                             for m, s in stuck.items()) + " (systemd.watchdog_stuck)"
        return None

    def serve(self) -> None:
        """Run the I/O loop on this thread until :meth:`stop`; then shut down."""
        self.server.run()
        # The drain has the grace period per model; past that and a margin, stop anyway.
        if not self._stopped.wait(self.config.server.shutdown_grace_s + STOP_MARGIN_S):
            log.error("the models did not finish stopping within %.3g s",
                      self.config.server.shutdown_grace_s + STOP_MARGIN_S)
            self._workers_done = False
        self._control.shutdown(wait=False, cancel_futures=True)
        self.watch.stop()
        self.inline.stop()
        self.server.close()
        # A thread still busy (a control operation or a load waiting on a stuck stage)
        # would keep the interpreter from exiting: main then ends the process itself.
        # (the daemon's own pools, shut down by now: one still alive is busy)
        ours = [t for t in threading.enumerate() if not t.daemon
                and t.name.startswith("inferd-") and t is not threading.current_thread()]
        until = time.monotonic() + 1.0
        for t in ours:
            t.join(max(0.0, until - time.monotonic()))
        busy = [t.name for t in ours if t.is_alive()]
        if busy:
            log.warning("stopping: threads still busy are ended with the process: %s",
                        ", ".join(busy))
            self._workers_done = False

    @property
    def workers_done(self) -> bool:
        """False if a model's threads were still running when :meth:`serve` returned
        (they may be inside a backend's native code: see main's exit)."""
        return self._workers_done

    def stop(self) -> None:
        """Begin a graceful stop; safe from signal handlers."""
        self.server.stop()

    def reload(self) -> dict[str, Any]:
        """Re-read the config file and the model repository; blocking, failing no
        request (see :meth:`ModelManager.reload`). Log levels and the ``[access]``
        allow-list apply at once; keys that only a restart applies (the socket and its
        limits, backends) are reported, not applied. systemd sees ``RELOADING=1`` with
        ``MONOTONIC_USEC``, then ``READY=1`` with a fresh status line, also when the
        reload fails.

        Returns:
            What changed: models added, removed, changed, failed; keys needing a restart.

        Raises:
            InferdError: the reload failed (a ConfigError: the new config is invalid);
                the old configuration stays in force. Logged here.
        """
        self.notifier.reloading()
        try:
            return self._reload()
        except Exception as e:  # SIGHUP and `inferctl reload` log it alike
            code, message = failure(e, "reload", log, named=False)
            log.error("reload failed, keeping the running configuration: %s", message)
            raise InferdError(message, code) from e
        finally:
            if self.ready.is_set():
                self.notifier.ready(self.status_line())
            else:  # a SIGHUP during the preload: READY=1 is the preload's to send
                self.notifier.status(self.status_line())

    def _reload(self) -> dict[str, Any]:
        config = load_config(self.config.source, self._overrides)
        restart = [f"{section}.{key}" for section in RESTART_SECTIONS
                   for key, value in vars(getattr(config, section)).items()
                   if getattr(getattr(self.config, section), key) != value]
        for name in restart:
            log.warning("reload: %s changed; it takes effect at the next restart", name)
        # [server], [backends], [processors], [security], [workers] (the pool and its
        # zygote are made at start)... stay as they were until a
        # restart (RESTART_SECTIONS).
        for section in RESTART_SECTIONS:
            setattr(config, section, getattr(self.config, section))
        logs.set_levels(config.logging.level, config.logging.modules)
        self.server.access = Access.of(config.access.uids, config.access.gids)
        # the one place the configuration is held: the cache, its catalog and its
        # placer, the watch and the metrics read it from here
        previous, self.config = self.config, config
        summary: dict[str, Any] = dict(self.models.reload(previous))
        self.repo = self.models.repo
        summary["graphs_retired"] = self.graphs.reload(self.repo,
                                                       config.server.shutdown_grace_s,
                                                       config.models.stuck_after_s)
        # graphs models.preload names: loaded again (a changed one was retired), or anew
        failed = self._preload_graphs(self.models.catalog.preloaded_graphs())
        if failed:
            summary["failed"] = list(dict.fromkeys([*summary.get("failed", []), *failed]))
        summary["needs_restart"] = restart
        log.info("configuration reloaded from %s%s", config.source or "built-in defaults",
                 f" and {len(config.dropins)} drop-ins" if config.dropins else "")
        return summary

    def request_reload(self) -> None:
        """Schedule :meth:`reload` on the control thread (coalesced with the requests
        already waiting: :class:`ReloadRuns`); safe from a signal handler."""
        self.server.call_soon(self.reloads.request)

    def _peer_gone(self, peer: bytes) -> None:
        """A client disconnected (I/O thread): its requests still queued for a model
        are answered CANCELLED, not run, and its streams are freed."""
        dropped = self.models.cancel_peer(peer)
        if dropped:
            log.info("a client disconnected: %d of its requests were still queued and are "
                     "dropped", dropped)

    def _on_stop(self) -> None:
        # On the I/O thread: drain the models elsewhere so replies keep flowing.
        self.notifier.stopping("stopping: finishing requests in flight")
        if self._watchdog is not None:
            self._watchdog.stop()

        def drain() -> None:
            grace = self.config.server.shutdown_grace_s
            # graph frames still need their models: graphs first
            stuck = self.graphs.stop(grace, self.config.models.stuck_after_s)
            self._workers_done = self.models.stop(grace) and not stuck
            stuck += [f"model {w.name}: {s}" for w in self.models.running_threads()
                      for s in w.stuck()]
            if stuck:
                log.warning("stopping: stuck stages left to end with the process: %s",
                            "; ".join(stuck))
            self._stop_metrics()
            if self.workers is not None:
                self.workers.close()
            self._stopped.set()
        threading.Thread(target=drain, name="inferd-drain", daemon=True).start()

    # ----------------------------------------------------------------- ops

    def handle(self, ticket: Ticket) -> Reply | None:
        """Answer one request, held by its ticket (I/O thread): inline for cheap ops,
        later for the rest."""
        request = ticket.request
        op = request.op
        known = self.models.catalog.knows(request.model)  # a dict lookup
        if op is Op.INFER:
            self.watch.track(ticket)  # answered at its deadline, whatever a stage does
            if known:
                self.models.submit(ticket, io_thread=True)
            else:  # a graph, a model added since the scan, or a wrong name: the disk
                self.inline.submit(ticket, lambda: self._infer_unknown(ticket))
            return None
        if op is Op.PING:
            return Reply(request.id, result={"pong": True, "ready": self.ready.is_set(),
                                             "max_message_bytes": self.server.max_message_bytes})
        if op in (Op.STATUS, Op.MODELS, Op.METRICS, Op.BACKENDS):
            self.inline.submit(ticket, lambda: Reply(request.id, result=(
                self._inline_result(request))))
            return None
        if op in (Op.LOAD, Op.UNLOAD):
            if not request.model:
                raise ModelError(f"{op} needs 'model'")
            if known:  # an unload of a model the catalog knows always goes ahead
                if op is Op.LOAD:
                    self.models.entry(request.model)  # a version it does not have
                self._control.submit(self._control_op, ticket)
            else:  # a graph, or a bad or unknown name, refused right away
                self.inline.submit(ticket, lambda: self._control_unknown(ticket))
            return None
        if op is Op.RELOAD:
            names = remeasure_names(request.params.get("remeasure"))

            def answer(result: Any, error: BaseException | None) -> None:
                if error is None and names is not False:
                    # after the reload: a changed model.toml already applies
                    result = {**result, "remeasured": self.models.placer.remeasure(
                        None if names is True else names)}
                self.server.send_reply(ticket, self._control_reply(request, result, error))
            self.reloads.request(answer)
            return None
        raise InferdError(f"op {op} is not supported by this daemon", ErrorCode.UNSUPPORTED)

    def _inline_result(self, request: Request) -> Any:
        """The result of a status, models, metrics or backends request (inline thread)."""
        op = request.op
        if op is Op.STATUS:
            return self.status()
        if op is Op.METRICS:
            return self.inline.metrics()
        if op is Op.MODELS:
            models = self.models.describe() + self.graphs.describe()
            stuck = self.watch.stuck()
            for m in models:
                m["stuck"] = stuck.get(m["name"], [])
                if m.get("kind") == "graph":  # a graph's requests are the metrics' count
                    m["requests"], m["failed_requests"] = self.metrics.answered(m["name"])
                if not request.params.get("verbose"):
                    m.pop("placement", None)
                elif m.get("kind") != "graph" and m.get("placement"):
                    # where the engine runs, if in a worker: asked of the worker (outside
                    # any lock, and only for a verbose listing)
                    m["placement"] += [{**p, "backend": m.get("backend")} for p in
                                       self.models.engine_pinning(m["name"], m["version"])]
            return {"models": models}
        placed = [{k: m.get(k) for k in ("name", "version", "backend", "device", "chosen")}
                  for m in self.models.describe() if m.get("backend")]
        return {**self.registry.view(), "models": placed, "customops": self.customops.view()}

    def _collect_metrics(self) -> dict[str, Any]:
        return {"text": self.metrics.text(), "samples": self.metrics.samples()}

    def resolve(self, request: Request) -> None:
        """Refuse an infer whose model or graph does not exist (NOT_FOUND, listing what
        does), before its tensors are decoded: the server's ``inferd-decode`` thread
        calls it for tensors that take time to decode (ipc/decoder.py)."""
        name = request.model
        if self.models.catalog.knows(name) or self.graphs.is_graph(name):
            return
        self.models.entry(name or "", request.version)  # or a model added since the scan

    def _infer_unknown(self, ticket: Ticket) -> None:
        """An infer naming what the catalog does not know (inline thread): a graph, a
        model directory added since the scan, or NOT_FOUND."""
        if self.graphs.is_graph(ticket.request.model):
            self.graphs.submit(ticket)
        else:
            self.models.submit(ticket)

    def _control_unknown(self, ticket: Ticket) -> None:
        """A load or unload naming what the catalog does not know (inline thread)."""
        if not self.graphs.is_graph(ticket.request.model):
            self.models.entry(ticket.request.model)  # NOT_FOUND, or a model added since
        self._control.submit(self._control_op, ticket)

    def _control_op(self, ticket: Ticket) -> None:
        """Run a load or unload (of a model or a graph) on the control thread and
        answer it; whatever it raises becomes the request's coded reply."""
        request = ticket.request
        try:
            reply = self._control_reply(request, self._run_control_op(request), None)
        except Exception as e:
            reply = self._control_reply(request, None, e)
        self.server.send_reply(ticket, reply)

    def _control_reply(self, request: Request, result: Any,
                       error: BaseException | None) -> Reply:
        if error is None:
            return Reply(request.id, result=result)
        where = f"{request.op} of {request.model}" if request.model else str(request.op)
        return Reply(request.id, error=failure(error, where, log, named=False,
                                               model=request.model or "",
                                               request_id=request.id))

    def _run_control_op(self, request: Request) -> Any:
        name = request.model or ""
        if self.graphs.is_graph(name):
            if request.op is Op.LOAD:
                self.graphs.executor(name)
            else:
                self.graphs.unload(name, self.config.server.shutdown_grace_s,
                                   self.config.models.stuck_after_s)
            return next(g for g in self.graphs.describe() if g["name"] == name)
        if request.op is Op.LOAD:
            entry = self.models.load(name, request.version)
        else:
            entry = self.models.unload(name, request.version)
        return self.models.describe_entry(entry)

    def status(self) -> dict[str, Any]:
        mem = self._proc.memory_info()
        return {
            "version": VERSION, "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "ready": self.ready.is_set(),
            "endpoint": self.config.server.socket,
            "config": str(self.config.source) if self.config.source else None,
            "repository": str(self.repo.root),
            "repository_problem": self.repo.problem(),
            "clients_in_flight": self.server.clients.clients(),
            "connections": self.server.connections.count(),
            "requests_held_bytes": self.server.clients.held,
            "max_bytes_in_flight": self.server.clients.max_held,
            "backends": [{"id": r["id"], "kind": r["kind"], "status": r["status"]}
                         for r in self.registry.describe()],
            "loaded_models": self.models.loaded(),
            "cache": self.models.cache_status(),
            "memory": {"rss_bytes": mem.rss, "vms_bytes": mem.vms},
            "max_message_bytes": self.server.max_message_bytes,
            "requests": self.server.stats["requests"],
            "stuck": self.watch.stuck(),
        }
