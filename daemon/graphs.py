"""The graph manager: the graphs of the model repository, each loaded on first use (on
the ``inferd-graph-loader`` thread, not the I/O thread) and run by its executor
(:mod:`inferd.daemon.executors`); retired on reload when its graph.toml changed.

Unloading, retiring and stopping a graph wait for its frames in flight, but never for a
node stuck inside one call past ``stuck_after`` seconds: such a graph's executor is
abandoned (its frames answered UNAVAILABLE naming the node) and the stuck thread left
to end when its call returns; an unload then fails with that reason.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from inferd.daemon.executors import (
    ModelCaller, ModelQueues, PipelineExecutor, TaskExecutor, graph_failure,
)
from inferd.daemon.graph import Executor, graph_names, graph_path, load_graph_file
from inferd.daemon.pipeline import unpin_current_thread
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.repository import Repository
from inferd.ipc.errors import ErrorCode, InferdError, ModelError, failure
from inferd.ipc.replies import AnyTicket, ReplySink

log = logging.getLogger(__name__)


class GraphManager:
    """The graphs of a repository: loaded on first use, run by their executor.

    Args:
        repo: the model repository (graphs live beside models).
        registry: processors for processor nodes.
        models: the model manager (model nodes queue their calls there; a processor
            node's deaths are charged in its quarantine, and a client it refuses for a
            graph is refused here).
        sink: where replies go (any thread); graph threads release it on exit.
    """

    def __init__(self, repo: Repository, registry: ProcessorRegistry, models: ModelQueues,
                 sink: ReplySink) -> None:
        self.repo = repo
        self.registry = registry
        self._call = ModelCaller(models)
        self._sink = sink
        self._graphs: dict[str, TaskExecutor | PipelineExecutor] = {}
        self._left: list[tuple[str, TaskExecutor | PipelineExecutor]] = []  # given up on
        self._errors: dict[str, str] = {}  # the last load error of each graph not loaded
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="inferd-graph-loader",
                                          initializer=unpin_current_thread)

    def is_graph(self, name: str | None) -> bool:
        """Whether ``name`` is a graph (loaded, or with a graph.toml and no model)."""
        if not name:
            return False
        if name in self._graphs:
            return True
        try:
            return (graph_path(self.repo, name).is_file()
                    and not self.repo.versions(name))
        except (InferdError, OSError):  # an unreadable model folder is no graph
            return False

    def executor(self, name: str) -> TaskExecutor | PipelineExecutor:
        """The running executor of ``name``, loading the graph on first use.

        Raises:
            ModelError: the graph's load error (naming the node, edge or model).
        """
        ex = self._graphs.get(name)
        if ex is not None:
            return ex
        with self._lock:
            ex = self._graphs.get(name)
            if ex is None:
                try:
                    spec = load_graph_file(self.repo, name, self.registry)
                except Exception as e:  # shown by `inferctl models` until it loads
                    code, message = failure(e, f"graph {name}", log, model=name)
                    self._errors[name] = message
                    log.error("graph %s failed to load: %s", name, message,
                              extra={"MODEL": name})
                    if isinstance(e, InferdError):
                        raise
                    raise InferdError(message, code) from e
                if spec is None:
                    raise InferdError(f"graph {name!r} not found", ErrorCode.NOT_FOUND)
                try:
                    ex = (PipelineExecutor(spec, self._call, self._sink)
                          if spec.executor is Executor.PIPELINE
                          else TaskExecutor(spec, self._call, self._sink))
                except BaseException:
                    spec.release()
                    raise
                self._graphs[name] = ex
                self._errors.pop(name, None)
        return ex

    def preload(self, name: str) -> list[str]:
        """Load graph ``name`` now (its processor steps built) and return the models its
        nodes call, for the caller to load (``models.preload``: daemon/runtime.py).

        Raises:
            InferdError: the graph's load error."""
        ex = self.executor(name)
        return list(dict.fromkeys(n.model for n in ex.spec.nodes if n.model))

    def submit(self, ticket: AnyTicket) -> None:
        """Queue one infer request (its ticket) for a graph (I/O thread); raises to
        refuse it.

        A graph not loaded yet is loaded on the graph loader thread (parsing it may read
        model files), and the request is answered from there if the load fails."""
        request = ticket.request
        # a client whose requests keep killing the processors worker in this graph's
        # nodes (ModelCaller.charge), or a graph set aside for it
        self._call.check(request.model or "", ticket)
        if request.stream is not None:  # a graph keeps no state between requests
            raise ModelError(f"graph {request.model} cannot run as a stream: only a model "
                             f"with a [stream] table in its model.toml can",
                             ErrorCode.INVALID_ARGUMENT)
        ex = self._graphs.get(request.model or "")
        if ex is not None:
            ex.submit(ticket)
            return
        self._loader.submit(self._load_and_submit, ticket)

    def _load_and_submit(self, ticket: AnyTicket) -> None:
        name = ticket.request.model or ""
        try:
            self.executor(name).submit(ticket)
        except Exception as e:
            self._sink.send(ticket, graph_failure(ticket.request, name, e))

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for name in graph_names(self.repo):
            if self.repo.versions(name):
                continue
            ex = self._graphs.get(name)
            error = None if ex else self._errors.get(name)
            info: dict[str, Any] = {"name": name, "kind": "graph",
                                    "state": "ready" if ex else "failed" if error
                                    else "unloaded", "error": error}
            aside = self._call.set_aside(name)
            if aside is not None:  # loaded, but refused to every client until a reload
                info.update(state="failed", error=aside)
            if ex is not None:
                info.update(executor=ex.spec.executor,
                            nodes=[{"name": n.name, "model": n.model,
                                    "processor": n.processor} for n in ex.spec.nodes],
                            dropped=ex.spec.dropped, threads=ex.threads(),
                            placement=[p.to_json() for p in ex.pinnings],
                            graph_inputs=list(ex.spec.inputs),
                            graph_outputs=list(ex.spec.outputs))
            out.append(info)
        return out

    def executors(self) -> list[tuple[str, TaskExecutor | PipelineExecutor]]:
        """The running graphs by name, and those given up on whose stuck call is still
        running (the stuck-stage watch reads them)."""
        with self._lock:
            self._left = [(n, ex) for n, ex in self._left if ex.busy.oldest() is not None]
            return list(self._graphs.items()) + self._left

    def _retire(self, name: str, ex: TaskExecutor | PipelineExecutor, timeout: float | None,
                stuck_after: float | None) -> str | None:
        """Stop ``ex`` and let go of its steps; if a node is stuck, abandon it: None, or
        what is stuck."""
        if ex.stop(timeout, stuck_after):
            ex.spec.release()
            return None
        stuck = "; ".join(ex.stuck()) or f"frames still in flight after {timeout} s"
        ex.abandon()
        # a stuck call in the processors worker keeps its step there until it returns
        ex.spec.release()
        with self._lock:
            self._left.append((name, ex))
        log.warning("graph %s: left running: %s", name, stuck, extra={"MODEL": name})
        return stuck

    def unload(self, name: str, timeout: float | None = None,
               stuck_after: float | None = None) -> None:
        """Finish ``name``'s frames in flight and end its threads (the next request
        loads it again, re-reading graph.toml).

        Raises:
            InferdError: UNAVAILABLE, a node is stuck (named): the graph is unloaded
                all the same and its frames answered; the stuck thread is left behind.
        """
        with self._lock:
            ex = self._graphs.pop(name, None)
        stuck = self._retire(name, ex, timeout, stuck_after) if ex is not None else None
        if stuck:
            raise InferdError(f"graph {name}: unloaded, but a node did not end: {stuck}; "
                              f"its frames were answered UNAVAILABLE", ErrorCode.UNAVAILABLE)

    def reload(self, repo: Repository, timeout: float | None,
               stuck_after: float | None = None) -> list[str]:
        """Follow a reload of the repository (control thread): every loaded graph whose
        graph.toml changed or is gone is retired. Its frames in flight finish on the old
        executor (a stuck one's are answered UNAVAILABLE); the next request loads the
        file as it is now.

        Returns:
            The names of the graphs retired.
        """
        with self._lock:
            moved = repo.root != self.repo.root
            self.repo = repo
            self._errors.clear()  # a fixed graph.toml is tried again by its next request
            stale = {name: ex for name, ex in self._graphs.items()
                     if moved or _source(repo, name) != ex.spec.source}
            for name in stale:
                del self._graphs[name]
        for name, ex in stale.items():
            log.info("graph %s: graph.toml changed or removed; retiring the running "
                     "graph", name, extra={"MODEL": name})
            self._retire(name, ex, timeout, stuck_after)
        return sorted(stale)

    def stop(self, timeout: float, stuck_after: float | None = None) -> list[str]:
        """Finish the frames in flight and end every graph's threads; the threads that
        did not end (stuck), named."""
        deadline = time.monotonic() + timeout
        self._loader.shutdown(wait=True)  # requests waiting for a load get their executor
        with self._lock:
            graphs, self._graphs = list(self._graphs.items()), {}
        left: list[str] = []
        for name, ex in graphs:
            stuck = self._retire(name, ex, max(0.1, deadline - time.monotonic()), stuck_after)
            if stuck:
                left.append(f"graph {name}: {stuck}")
        return left


def _source(repo: Repository, name: str) -> str | None:
    """The text of ``name``'s graph.toml now, or None if it cannot be read."""
    try:
        return graph_path(repo, name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
