"""The graph manager: the graphs of the model repository, each loaded on first use (on
the ``inferd-graph-loader`` thread, not the I/O thread) and run by its executor
(:mod:`inferd.daemon.executors`); retired on reload when its graph.toml changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from inferd.daemon.executors import ModelCaller, PipelineExecutor, TaskExecutor, graph_failure
from inferd.daemon.graph import Executor, graph_names, graph_path, load_graph_file
from inferd.daemon.pipeline import unpin_current_thread
from inferd.daemon.processors import ProcessorRegistry
from inferd.daemon.repository import Repository
from inferd.ipc.errors import ErrorCode, InferdError, failure
from inferd.ipc.protocol import Request
from inferd.ipc.replies import ReplySink

log = logging.getLogger(__name__)


class GraphManager:
    """The graphs of a repository: loaded on first use, run by their executor.

    Args:
        repo: the model repository (graphs live beside models).
        registry: processors for processor nodes.
        submit: submits a model request (the model manager's ``submit``).
        sink: where replies go (any thread); graph threads release it on exit.
    """

    def __init__(self, repo: Repository, registry: ProcessorRegistry,
                 submit: Callable[[Request, Any], None], sink: ReplySink) -> None:
        self.repo = repo
        self.registry = registry
        self._call = ModelCaller(submit)
        self._sink = sink
        self._graphs: dict[str, TaskExecutor | PipelineExecutor] = {}
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
                ex = (PipelineExecutor(spec, self._call, self._sink)
                      if spec.executor is Executor.PIPELINE
                      else TaskExecutor(spec, self._call, self._sink))
                self._graphs[name] = ex
                self._errors.pop(name, None)
        return ex

    def submit(self, request: Request, ticket: Any) -> None:
        """Queue one infer request for a graph (I/O thread); raises to refuse it.

        A graph not loaded yet is loaded on the graph loader thread (parsing it may read
        model files), and the request is answered from there if the load fails."""
        ex = self._graphs.get(request.model or "")
        if ex is not None:
            ex.submit(request, ticket)
            return
        self._loader.submit(self._load_and_submit, request, ticket)

    def _load_and_submit(self, request: Request, ticket: Any) -> None:
        try:
            self.executor(request.model or "").submit(request, ticket)
        except Exception as e:
            self._sink.send(ticket, graph_failure(request, request.model or "", e))

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
            if ex is not None:
                info.update(executor=ex.spec.executor,
                            nodes=[{"name": n.name, "model": n.model,
                                    "processor": n.processor} for n in ex.spec.nodes],
                            dropped=ex.spec.dropped, threads=ex.threads(),
                            placement=[p.to_json() for p in ex.placements],
                            graph_inputs=list(ex.spec.inputs),
                            graph_outputs=list(ex.spec.outputs))
            out.append(info)
        return out

    def unload(self, name: str, timeout: float) -> bool:
        """Finish ``name``'s frames in flight and end its threads (the next request
        loads it again, re-reading graph.toml)."""
        with self._lock:
            ex = self._graphs.pop(name, None)
        return ex.stop(timeout) if ex is not None else True

    def reload(self, repo: Repository, timeout: float) -> list[str]:
        """Follow a reload of the repository (control thread): every loaded graph whose
        graph.toml changed or is gone is retired. Its frames in flight finish on the old
        executor; the next request loads the file as it is now.

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
            if not ex.stop(timeout):
                log.warning("graph %s: frames still in flight after %s s", name, timeout,
                            extra={"MODEL": name})
        return sorted(stale)

    def stop(self, timeout: float) -> bool:
        """Finish the frames in flight and end every graph's threads."""
        deadline = time.monotonic() + timeout
        ok = True
        self._loader.shutdown(wait=True)  # requests waiting for a load get their executor
        with self._lock:
            graphs, self._graphs = list(self._graphs.values()), {}
        for ex in graphs:
            ok = ex.stop(max(0.1, deadline - time.monotonic())) and ok
        return ok


def _source(repo: Repository, name: str) -> str | None:
    """The text of ``name``'s graph.toml now, or None if it cannot be read."""
    try:
        return graph_path(repo, name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
