"""The runtime: one object that owns a daemon's backends, models and server, and answers
each protocol op. Several runtimes can live in one process (tests do that)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

from inferd.daemon.config import Config, load_config
from inferd.daemon.graphs import GraphManager
from inferd.daemon.models import ModelManager
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.repository import Repository
from inferd.daemon.worker import route_replies
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.server import Server, Ticket
from inferd.libbackends.loader import load_backends
from inferd.libbackends.registry import Registry

log = logging.getLogger(__name__)

try:
    VERSION = version("inferd")
except PackageNotFoundError:  # running from a source tree that is not installed
    VERSION = "0+unknown"


class Runtime:
    """A daemon instance: call :meth:`start`, then :meth:`serve` on the main thread."""

    def __init__(self, config: Config, overrides: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self._overrides = dict(overrides or {})  # command-line values, kept over reloads
        self.started = time.time()
        self.ready = threading.Event()
        self.registry = Registry()
        self.repo = Repository(Path(config.models.repository).resolve())
        self.server = Server(config.server.socket, self.handle,
                             max_message_bytes=config.server.max_message_bytes,
                             socket_mode=config.server.socket_mode,
                             grace_s=config.server.shutdown_grace_s)
        self.server.on_stop = self._on_stop
        reply = route_replies(self.server.send_reply)  # wire tickets and in-process ones
        self.models = ModelManager(self.repo, self.registry, config, reply,
                                   self.server.release_thread)
        self.processors = ProcessorRegistry()
        self.models.processors = self.processors
        self.graphs = GraphManager(self.repo, self.processors, self.models.submit, reply,
                                   self.server.release_thread)
        self._control = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-control")
        self._stopped = threading.Event()
        self._workers_done = True
        self._proc = psutil.Process()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Register backends, bind the socket and start the preload in the background."""
        load_backends(self.registry, self.config)
        self.processors.load_directory(self.config.processors.directory)
        self.server.bind()
        self.models.start()
        log.info("inferd %s serving %s (models in %s, pid %d)", VERSION,
                 self.config.server.socket, self.repo.root, os.getpid())
        threading.Thread(target=self._preload, name="inferd-preload", daemon=True).start()

    def _preload(self) -> None:
        self.models.preload()
        self.ready.set()
        log.info("ready: %d models warm (%s)", len(self.models.loaded()),
                 ", ".join(self.models.loaded()) or "none")

    def serve(self) -> None:
        """Run the I/O loop on this thread until :meth:`stop`; then shut down."""
        self.server.run()
        self._stopped.wait()
        self._control.shutdown(wait=False, cancel_futures=True)
        self.server.close(threads_done=self._workers_done)

    def stop(self) -> None:
        """Begin a graceful stop; safe from signal handlers."""
        self.server.stop()

    def reload(self) -> dict[str, Any]:
        """Re-read the config file and the model repository; blocking, failing no
        request (see :meth:`ModelManager.reload`). Keys that only a restart applies
        (the socket and its limits, backends, logging) are reported, not applied.

        Returns:
            What changed: models added, removed, changed, failed; keys needing a restart.

        Raises:
            ConfigError: the new config is invalid; the old one stays in force.
        """
        config = load_config(self.config.source, self._overrides)
        restart = [f"{section}.{key}" for section in ("server", "backends", "logging")
                   for key, value in vars(getattr(config, section)).items()
                   if getattr(getattr(self.config, section), key) != value]
        for name in restart:
            log.warning("reload: %s changed; it takes effect at the next restart", name)
        # [server], [backends] and [logging] stay as they were until a restart.
        for section in ("server", "backends", "logging"):
            setattr(config, section, getattr(self.config, section))
        self.config = config
        summary: dict[str, Any] = dict(self.models.reload(config))
        self.repo = self.models.repo
        summary["needs_restart"] = restart
        return summary

    def request_reload(self) -> None:
        """Schedule :meth:`reload` on the control thread; safe from a signal handler."""
        self.server.call_soon(lambda: self._control.submit(self._reload_logged))

    def _reload_logged(self) -> None:
        try:
            self.reload()
        except InferdError as e:
            log.error("reload failed, keeping the running configuration: %s", e.message)
        except Exception:
            log.exception("reload failed")

    def _on_stop(self) -> None:
        # On the I/O thread: drain the models elsewhere so replies keep flowing.
        def drain() -> None:
            grace = self.config.server.shutdown_grace_s
            graphs_done = self.graphs.stop(grace)  # graph frames still need their models
            self._workers_done = self.models.stop(grace) and graphs_done
            self._stopped.set()
        threading.Thread(target=drain, name="inferd-drain", daemon=True).start()

    # ----------------------------------------------------------------- ops

    def handle(self, request: Request, ticket: Ticket) -> Reply | None:
        """Answer one request (I/O thread): inline for cheap ops, later for the rest."""
        op = request.op
        if op is Op.INFER:
            if self.graphs.is_graph(request.model):
                self.graphs.submit(request, ticket)
            else:
                self.models.submit(request, ticket)
            return None
        if op is Op.PING:
            return Reply(request.id, result={"pong": True, "ready": self.ready.is_set()})
        if op is Op.STATUS:
            return Reply(request.id, result=self.status())
        if op is Op.MODELS:
            models = self.models.describe() + self.graphs.describe()
            if not request.params.get("verbose"):
                for m in models:
                    m.pop("placement", None)
            return Reply(request.id, result={"models": models})
        if op is Op.BACKENDS:
            return Reply(request.id, result=self.registry.view())
        if op in (Op.LOAD, Op.UNLOAD):
            if not request.model:
                raise ModelError(f"{op} needs 'model'")
            if self.graphs.is_graph(request.model):
                self._control.submit(self._graph_op, request, ticket)
                return None
            self.models.entry(request.model)  # refuse bad or unknown names right away
            self._control.submit(self._control_op, request, ticket)
            return None
        if op is Op.RELOAD:
            self._control.submit(self._control_op, request, ticket)
            return None
        raise InferdError(f"op {op} is not supported by this daemon", ErrorCode.UNSUPPORTED)

    def _graph_op(self, request: Request, ticket: Ticket) -> None:
        name = request.model or ""
        try:
            if request.op is Op.LOAD:
                self.graphs.executor(name)
            else:
                self.graphs.unload(name, self.config.server.shutdown_grace_s)
            result = next(g for g in self.graphs.describe() if g["name"] == name)
            reply = Reply(request.id, result=result)
        except InferdError as e:
            reply = Reply(request.id, error=(e.code, e.message))
        self.server.send_reply(ticket, reply)

    def _control_op(self, request: Request, ticket: Ticket) -> None:
        try:
            if request.op is Op.RELOAD:
                result = self.reload()
            else:
                if request.op is Op.LOAD:
                    entry = self.models.load(request.model or "", request.version)
                else:
                    entry = self.models.unload(request.model or "", request.version)
                with entry.lock:
                    result = entry.describe()
            reply = Reply(request.id, result=result)
        except InferdError as e:
            reply = Reply(request.id, error=(e.code, e.message))
        except Exception as e:
            log.exception("%s of %s failed", request.op, request.model)
            reply = Reply(request.id, error=(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))
        self.server.send_reply(ticket, reply)

    def status(self) -> dict[str, Any]:
        mem = self._proc.memory_info()
        return {
            "version": VERSION, "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "ready": self.ready.is_set(),
            "endpoint": self.config.server.socket,
            "config": str(self.config.source) if self.config.source else None,
            "repository": str(self.repo.root),
            "backends": [{"id": r["id"], "kind": r["kind"], "status": r["status"]}
                         for r in self.registry.describe()],
            "loaded_models": self.models.loaded(),
            "cache": self.models.cache_status(),
            "memory": {"rss_bytes": mem.rss, "vms_bytes": mem.vms},
            "max_message_bytes": self.config.server.max_message_bytes,
            "requests": self.server.stats["requests"],
        }
