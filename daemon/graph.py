"""Graphs: TOML files in the model repository naming nodes (models and processors) and
the edges between them; a client calls a graph exactly as it calls a model.

``<repository>/<graph>/graph.toml``::

    executor = "pipeline"          # or "task"
    queue_size = 16                # pipeline: frames held per edge before backpressure
    input_queue_size = 64          # frames that may wait to enter (then RESOURCE_EXHAUSTED)
    task_threads = 4               # task: the pool's threads
    cpu_affinity = [0, 1]          # optional: cores the graph's own threads may run on
    inputs = ["image"]             # the graph's input tensors
    [outputs]                      # graph output -> "node.value"
    texts = "result.texts"

    [[nodes]]
    name = "det"                   # letters, digits, '_' and '-'
    model = "ocr-det"              # a model of the repository ...
    inputs = { x = "det_pre.x" }   # ... fed from other nodes ("input.<name>": the graph's)
    rename = { "sigmoid_0.tmp_0" = "pred" }   # optional: output names as others use them
    foreach = false                # true: the input is a list, one model call per element

    [[nodes]]
    name = "det_pre"
    processor = "ocr.det_pre"      # ... or a processor, with its parameters
    params = { limit_side_len = 736 }
    inputs = { image = "input.image" }

Edges are the ``inputs`` references. Loading checks the whole graph once: unknown
processors, nodes that name no model that exists, edges from nodes or graph inputs that
do not exist, and cycles are load errors that name the culprit. Nodes that feed no graph
output are dropped after the topological sort.
"""

from __future__ import annotations

import logging
import re
import time
import tomllib
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from inferd.daemon.units import parse_affinity
from inferd.daemon.processors import Context, ProcessorRegistry, Step, release
from inferd.daemon.repository import Repository, check_name
from inferd.ipc.errors import ErrorCode, InferdError, ModelError, failure
from inferd.ipc.protocol import Request

log = logging.getLogger(__name__)

GRAPH_FILE = "graph.toml"
INPUT = "input"
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class Executor(StrEnum):
    """How a graph runs (graph.toml ``executor``)."""

    TASK = "task"
    PIPELINE = "pipeline"


@dataclass
class Node:
    """One node: a model call or a processor step, with where its inputs come from."""

    name: str
    model: str | None = None
    step: Step | None = None
    processor: str | None = None
    inputs: dict[str, tuple[str, str]] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)
    foreach: bool = False

    @property
    def producers(self) -> set[str]:
        return {src for src, _ in self.inputs.values()}


@dataclass
class GraphSpec:
    """A checked graph: live nodes in topological order."""

    name: str
    executor: Executor
    inputs: list[str]
    outputs: dict[str, tuple[str, str]]
    nodes: list[Node]
    dropped: list[str]
    queue_size: int = 16
    input_queue_size: int = 64
    task_threads: int = 4
    cpu_affinity: list[int] | None = None
    source: str = ""
    """The graph.toml text it was built from (a reload compares it with the file)."""

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def consumers(self, name: str) -> list[str]:
        return [n.name for n in self.nodes if name in n.producers]

    def release(self) -> None:
        """Let go of the steps its nodes hold in the processors worker (the graph is
        retired: no frame calls them again)."""
        release([n.step for n in self.nodes])


def _fail(graph: str, message: str, code: ErrorCode = ErrorCode.INVALID_ARGUMENT) -> ModelError:
    return ModelError(f"graph {graph}: {message}", code)


def _ref(graph: str, where: str, ref: Any) -> tuple[str, str]:
    if not isinstance(ref, str) or "." not in ref:
        raise _fail(graph, f"{where}: {ref!r} is not a 'node.value' reference")
    node, value = ref.split(".", 1)
    return node, value


def parse_graph(name: str, raw: dict[str, Any], repo: Repository,
                registry: ProcessorRegistry) -> GraphSpec:
    """Check a parsed graph.toml and build its nodes.

    Raises:
        ModelError: INVALID_ARGUMENT for a malformed graph, a dangling edge, a cycle or
            an unknown processor; NOT_FOUND for a node naming a missing model.
    """
    try:
        executor = Executor(raw.get("executor", Executor.PIPELINE))
    except ValueError:
        raise _fail(name, f"executor {raw['executor']!r}: expected 'task' or "
                    f"'pipeline'") from None
    inputs = raw.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise _fail(name, "'inputs' must be a non-empty list of input names")
    raw_out = raw.get("outputs")
    if not isinstance(raw_out, dict) or not raw_out:
        raise _fail(name, "'outputs' must be a table: output name -> 'node.value'")
    outputs = {k: _ref(name, f"output {k}", v) for k, v in raw_out.items()}
    raw_nodes = raw.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise _fail(name, "no [[nodes]]")
    nodes: dict[str, Node] = {}
    try:
        return _parse_nodes(name, raw, repo, registry, executor, inputs, outputs,
                            raw_nodes, nodes)
    except BaseException:
        release([n.step for n in nodes.values()])  # those built in the processors worker
        raise


def _parse_nodes(name: str, raw: dict[str, Any], repo: Repository,
                 registry: ProcessorRegistry, executor: Executor, inputs: list[str],
                 outputs: dict[str, tuple[str, str]], raw_nodes: list[Any],
                 nodes: dict[str, Node]) -> GraphSpec:
    for i, rn in enumerate(raw_nodes):
        if not isinstance(rn, dict) or not isinstance(rn.get("name"), str) \
                or not _NODE.fullmatch(rn["name"]) or rn["name"] == INPUT:
            raise _fail(name, f"nodes[{i}] needs a 'name' of letters, digits, '_' and '-' "
                        f"(not '{INPUT}')")
        nn = rn["name"]
        if nn in nodes:
            raise _fail(name, f"node {nn} is defined twice")
        if ("model" in rn) == ("processor" in rn):
            raise _fail(name, f"node {nn} needs exactly one of 'model' or 'processor'")
        node = Node(nn, foreach=bool(rn.get("foreach", False)),
                    rename=dict(rn.get("rename", {})))
        raw_in = rn.get("inputs", {})
        if not isinstance(raw_in, dict) or not raw_in:
            raise _fail(name, f"node {nn} needs 'inputs' (value name -> 'node.value')")
        node.inputs = {k: _ref(name, f"node {nn} input {k}", v) for k, v in raw_in.items()}
        if "model" in rn:
            node.model = check_name(rn["model"])
            if not repo.versions(node.model):
                raise _fail(name, f"node {nn} names model {node.model!r}, which is not in the "
                            f"repository (models: {', '.join(repo.names()) or 'none'})",
                            ErrorCode.NOT_FOUND)
        else:
            node.processor = rn["processor"]
            params = rn.get("params", {})
            if not isinstance(params, dict):
                raise _fail(name, f"node {nn}: 'params' must be a table")
            node.step = registry.build({"op": node.processor, **params},
                                       Context(lambda m: repo.resolve(m).path, name, repo),
                                       f"graph {name}: node {nn}")
        nodes[nn] = node
    # dangling edges: every reference must name a node (or a graph input)
    for node in nodes.values():
        for local, (src, value) in node.inputs.items():
            _check_source(name, src, value, f"{src}.{value} -> {node.name}.{local}", nodes,
                          inputs)
    for out, (src, value) in outputs.items():
        _check_source(name, src, value, f"{src}.{value} -> output {out}", nodes, inputs)
    order = _toposort(name, nodes)
    live = _live(outputs, nodes)
    dropped = [n for n in order if n not in live]
    if dropped:
        log.info("graph %s: nodes %s feed no output and are dropped", name,
                 ", ".join(dropped), extra={"MODEL": name})
        release([nodes[n].step for n in dropped])
    return GraphSpec(name, executor, list(inputs), outputs,
                     [nodes[n] for n in order if n in live], dropped,
                     queue_size=_positive(name, raw, "queue_size", 16),
                     input_queue_size=_positive(name, raw, "input_queue_size", 64),
                     task_threads=_positive(name, raw, "task_threads", 4),
                     cpu_affinity=_cores(name, raw.get("cpu_affinity")))


def _cores(graph: str, cores: Any) -> list[int] | None:
    if cores is None:
        return None
    try:
        return parse_affinity(cores)
    except ValueError as e:
        raise _fail(graph, f"cpu_affinity = {cores!r}: {e}") from None


def _positive(graph: str, raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(graph, f"{key!r} = {value!r}: expected a positive integer")
    return value


def _check_source(graph: str, src: str, value: str, edge: str, nodes: dict[str, Node],
                  inputs: list[str]) -> None:
    if src == INPUT:
        if value not in inputs:
            raise _fail(graph, f"dangling edge {edge}: the graph has no input {value!r} "
                        f"(inputs: {', '.join(inputs)})")
    elif src not in nodes:
        raise _fail(graph, f"dangling edge {edge}: there is no node {src!r} "
                    f"(nodes: {', '.join(nodes)})")


def _toposort(graph: str, nodes: dict[str, Node]) -> list[str]:
    pending = {n: {p for p in node.producers if p != INPUT} for n, node in nodes.items()}
    order: list[str] = []
    while pending:
        ready = sorted(n for n, deps in pending.items() if not deps)
        if not ready:
            raise _fail(graph, f"cycle among nodes {' -> '.join(_cycle(pending))}")
        for n in ready:
            order.append(n)
            del pending[n]
        for deps in pending.values():
            deps.difference_update(ready)
    return order


def _cycle(pending: dict[str, set[str]]) -> list[str]:
    start = sorted(pending)[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(pending[path[-1]])[0]
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


def _live(outputs: dict[str, tuple[str, str]], nodes: dict[str, Node]) -> set[str]:
    live: set[str] = set()
    todo = [src for src, _ in outputs.values() if src != INPUT]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo += [p for p in nodes[n].producers if p != INPUT]
    return live


# --------------------------------------------------------------------------- calls


class ModelCall(Protocol):
    """How a node calls a model in-process (:class:`inferd.daemon.executors.ModelCaller`):
    ``submit`` queues the call in the model's queue and returns its future at once, so
    that many calls can be in flight together; ``result`` waits for one, no longer
    than the request's deadline."""

    def submit(self, model: str, inputs: dict[str, Any], deadline: float | None,
               peer: bytes = b"", uid: int | None = None) -> Future[dict[str, Any]]: ...

    def result(self, future: Future[dict[str, Any]], model: str,
               deadline: float | None) -> dict[str, Any]: ...


def run_node(spec: GraphSpec, node: Node, values: dict[str, Any], call: ModelCall,
             deadline: float | None, peer: bytes = b"", uid: int | None = None
             ) -> dict[str, Any]:
    """Run one node on its input values; errors name the graph and the node. A model
    node's calls go to the model's queue as the client ``peer``'s (its turns there) and
    as uid ``uid``'s (the quarantine charges it a worker death they cause, and refuses
    it as it would the client's own call of the model)."""
    try:
        if node.step is not None:
            out = node.step(values)
            if not isinstance(out, dict):
                raise ModelError(f"processor returned {type(out).__name__}, not a dict")
            return out
        assert node.model is not None
        if node.foreach:
            # every element's call in flight at once: the model's batching sees them
            lists = {k: _elements(k, v) for k, v in values.items()}
            n = len(next(iter(lists.values())))
            if any(len(v) != n for v in lists.values()):
                raise ModelError("foreach inputs of different lengths: " + ", ".join(
                    f"{k}: {len(v)}" for k, v in lists.items()))
            futures = [call.submit(node.model, {k: v[i] for k, v in lists.items()},
                                   deadline, peer, uid) for i in range(n)]
            merged: dict[str, Any] = {} if futures else EmptyLists()
            for f in futures:
                for k, v in call.result(f, node.model, deadline).items():
                    merged.setdefault(node.rename.get(k, k), []).append(v)
            return merged
        out = call.result(call.submit(node.model, values, deadline, peer, uid), node.model,
                          deadline)
        return {node.rename.get(k, k): v for k, v in out.items()}
    except Exception as e:
        code, message = failure(e, f"graph {spec.name}: node {node.name}", log,
                                model=spec.name)
        if isinstance(e, InferdError):
            message = f"graph {spec.name}: node {node.name}: {message}"
        raise InferdError(message, code) from e


def _elements(name: str, value: Any) -> list[Any]:
    """The elements a foreach node calls its model on: a list's items, or an array's
    rows (numpy scalars of a 1-D array become 0-d arrays, which the model takes)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        raise ModelError(f"foreach input {name!r} is a scalar, not a list or an array "
                         f"with a first dimension to iterate over")
    try:
        items = list(value)
    except TypeError:
        raise ModelError(f"foreach input {name!r} is a {type(value).__name__}, not a "
                         f"list or an array") from None
    return [np.asarray(x) if isinstance(x, np.generic) else x for x in items]


class EmptyLists(dict[str, Any]):
    """The outputs of a foreach node that ran on an empty list: whatever output a
    consumer asks for is an empty list (the model was never called, so its output names
    are not known here)."""

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: str) -> list[Any]:
        return []


def gather(graph: str, node: Node, packets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A node's input values from its producers' output dicts."""
    values = {}
    for local, (src, value) in node.inputs.items():
        produced = packets[src]
        if value not in produced:
            raise InferdError(f"graph {graph}: node {node.name}: producer {src} gave no "
                              f"value {value!r} "
                              f"(it gave {', '.join(sorted(produced))})",
                              ErrorCode.INVALID_ARGUMENT)
        values[local] = produced[value]
    return values


def graph_outputs(spec: GraphSpec, packets: dict[str, dict[str, Any]],
                  request: Request) -> dict[str, Any]:
    import numpy as np

    out = {}
    for name, (src, value) in spec.outputs.items():
        if request.outputs and name not in request.outputs:
            continue
        if value not in packets[src]:
            raise InferdError(f"graph {spec.name}: output {name}: node {src} gave no value "
                              f"{value!r}", ErrorCode.INTERNAL)
        v = packets[src][value]
        out[name] = v if isinstance(v, np.ndarray) else np.asarray(v)
    if request.outputs:
        missing = [o for o in request.outputs if o not in spec.outputs]
        if missing:
            raise InferdError(f"graph {spec.name}: no outputs {missing}; it gives "
                              f"{sorted(spec.outputs)}", ErrorCode.INVALID_ARGUMENT)
    return out


def check_graph_inputs(spec: GraphSpec, request: Request) -> None:
    missing = [i for i in spec.inputs if i not in request.inputs]
    extra = [i for i in request.inputs if i not in spec.inputs]
    if missing or extra:
        raise InferdError(f"graph {spec.name}: takes inputs {spec.inputs}; missing {missing}, "
                          f"unknown {extra}", ErrorCode.INVALID_ARGUMENT)


def load_graph_file(repo: Repository, name: str,
                    registry: ProcessorRegistry) -> GraphSpec | None:
    """The graph ``name`` from ``<repo>/<name>/graph.toml``, or None if there is none."""
    path = graph_path(repo, name)
    if not path.is_file():
        return None
    try:
        source = path.read_text(encoding="utf-8")
        raw = tomllib.loads(source)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise _fail(name, f"cannot read {path}: {e}") from e
    started = time.monotonic()
    spec = parse_graph(name, raw, repo, registry)
    spec.source = source
    log.info("graph %s loaded from %s (%s executor, %d nodes) in %.0f ms", name, path,
             spec.executor, len(spec.nodes), (time.monotonic() - started) * 1000,
             extra={"MODEL": name})
    return spec


def graph_path(repo: Repository, name: str) -> Path:
    """``<repository>/<name>/graph.toml``; raises ModelError if ``name`` is not plain or
    the file is a link out of the repository (see Repository.inside)."""
    path = Path(repo.root) / check_name(name) / GRAPH_FILE
    if path.is_symlink() or path.parent.is_symlink():
        repo.checked(path, name)
    return path


def graph_names(repo: Repository) -> list[str]:
    root = Path(repo.root)
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{GRAPH_FILE}"))

