"""Cutting an ONNX graph into steps, Arm NN's way: each node goes to the first executor
that supports it, and the graph becomes maximal runs of nodes per executor.

A node goes to a custom op when one matches it (custom ops win, see docs/customops.md),
else to the model's chosen backend if that backend supports it, else to the first other
registered backend that says it supports it (onnxruntime CPU, typically). A backend
answers through the optional method ``supported_nodes(model) -> list[str]`` (one entry
per node, "" for supported, else why not; onnxruntime reads its kernel registry,
OpenVINO can answer with ``query_model``); a backend without it is taken to run every
node of a standard ONNX domain. Nodes are ordered topologically preferring to stay on the
current executor (fewer cuts), then grouped: consecutive backend nodes form one
sub-graph, each custom-op node is its own step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from onnx import GraphProto, ModelProto, NodeProto

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.contract import Backend
from inferd.libbackends.customops.contract import (  # noqa: F401  summary: re-exported
    STANDARD_DOMAINS, CustomOp, OpRegistry, summary,
)

log = logging.getLogger(__name__)


@dataclass
class Step:
    """A run of nodes on one executor: a backend sub-graph or one custom-op node."""

    executor: str
    nodes: list[int]
    backend: Backend | None = None
    op: CustomOp | None = None
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    node_outputs: list[str] = field(default_factory=list)


def node_label(graph: GraphProto, i: int) -> str:
    node = graph.node[i]
    return node.name or f"{node.op_type}#{i}"


def node_support(backend: Backend, model: ModelProto) -> list[str]:
    """What ``backend`` says of each node: "" to run it, else why not."""
    ask = getattr(backend, "supported_nodes", None)
    if callable(ask):
        try:
            answer = list(ask(model))
        except Exception as e:  # noqa: BLE001  a plugin's bug: the backend takes nothing
            log.warning("backend %s: supported_nodes() raised %s: %s", backend.id,
                        type(e).__name__, e, extra={"BACKEND": backend.id})
            return [f"supported_nodes() raised {type(e).__name__}"] * len(model.graph.node)
        if len(answer) == len(model.graph.node):
            return [str(a or "") for a in answer]
        return [f"supported_nodes() answered {len(answer)} entries for "
                f"{len(model.graph.node)} nodes"] * len(model.graph.node)
    return ["" if (n.domain or "") in STANDARD_DOMAINS else
            f"domain {n.domain!r} is not a standard ONNX domain" for n in model.graph.node]


def assign(model: ModelProto, name: str, chosen: Backend, fallbacks: Sequence[Backend],
           ops: OpRegistry | None) -> list[tuple[str, Backend | None, CustomOp | None]]:
    """The executor of every node: (executor label, backend, op).

    A node of a standard domain (or calling one of the model's own functions) that no
    backend claims stays on the chosen backend, with a WARNING: only the engine itself
    can be sure it lacks an op.

    Raises:
        ModelError (UNSUPPORTED): a node of another domain that no custom op and no
            backend runs; the message names its op type and domain, each backend's
            reason and the custom ops known.
    """
    graph = model.graph
    local = {(f.domain, f.name) for f in model.functions}
    answers: dict[str, list[str]] = {chosen.id: node_support(chosen, model)}
    out: list[tuple[str, Backend | None, CustomOp | None]] = []
    for i, node in enumerate(graph.node):
        op = ops.find(node) if ops is not None else None
        if op is not None:
            out.append((f"{op.kind}:{op.op_type}", None, op))
            continue
        if not answers[chosen.id][i]:
            out.append((chosen.id, chosen, None))
            continue
        for b in fallbacks:
            if b.id not in answers:
                answers[b.id] = node_support(b, model)
            if not answers[b.id][i]:
                out.append((b.id, b, None))
                break
        else:
            why = "; ".join(f"{b}: {a[i]}" for b, a in answers.items())
            if _standard(node, local):
                # A standard node nobody claims is given to the chosen backend anyway: a
                # backend's answer may be too cautious (an op it expands as a function),
                # and a model that loaded before partitioning existed must still load;
                # a backend that really lacks it says so when it loads.
                log.warning("model %s: node %s (%s) is claimed by no backend (%s); it "
                            "stays on %s", name, node_label(graph, i), node.op_type, why,
                            chosen.id, extra={"MODEL": name.split(" ")[0],
                                              "BACKEND": chosen.id})
                out.append((chosen.id, chosen, None))
                continue
            known = ", ".join(ops.names()) if ops is not None and ops.all_ops() else "none"
            raise ModelError(f"model {name}: node {node_label(graph, i)} needs op "
                             f"{node.op_type} (domain {node.domain or 'ai.onnx'!r}), which no "
                             f"custom op and no backend provides ({why}); custom ops "
                             f"loaded: {known}", ErrorCode.UNSUPPORTED)
    return out


def _standard(node: NodeProto, local: set[tuple[str, str]]) -> bool:
    return (node.domain or "") in STANDARD_DOMAINS or (node.domain, node.op_type) in local


def consumed(node: NodeProto) -> list[str]:
    """Every tensor a node reads, including outer-scope names used by its sub-graphs."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            inner = {o for n in g.node for o in n.output} | {i.name for i in g.input} \
                | {t.name for t in g.initializer}
            names += [n for sub in g.node for n in consumed(sub) if n not in inner]
    return names


def order_and_group(graph: GraphProto,
                    executors: list[tuple[str, Backend | None, CustomOp | None]]
                    ) -> list[Step]:
    """Topological order that stays on one executor as long as it can, in steps."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    deps = [{producer[t] for t in consumed(n) if t in producer} for n in graph.node]
    users: dict[int, list[int]] = defaultdict(list)
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    missing = [len(d) for d in deps]
    ready = [i for i, m in enumerate(missing) if m == 0]
    steps: list[Step] = []
    current: str | None = None
    while ready:
        same = [i for i in ready if executors[i][0] == current and executors[i][1]]
        i = min(same) if same else min(ready)
        ready.remove(i)
        label, backend, op = executors[i]
        if backend is not None and steps and steps[-1].executor == label:
            steps[-1].nodes.append(i)
        else:
            steps.append(Step(label, [i], backend, op))
        current = label
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    if sum(len(s.nodes) for s in steps) != len(graph.node):
        raise ModelError("the graph has a cycle or a node reads a tensor produced later",
                         ErrorCode.INVALID_ARGUMENT)
    _wire(graph, steps)
    return steps


def _wire(graph: GraphProto, steps: list[Step]) -> None:
    """Each step's inputs (read, not produced inside) and outputs (needed later)."""
    initializers = {t.name for t in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    needed_after: set[str] = set(graph_outputs)
    for step in reversed(steps):
        made = {o for i in step.nodes for o in graph.node[i].output if o}
        read: list[str] = []
        for i in step.nodes:
            for t in consumed(graph.node[i]):
                if t not in made and t not in read:
                    read.append(t)
        step.outputs = [o for i in step.nodes for o in graph.node[i].output
                        if o and o in needed_after]
        if step.backend is None:  # an op's inputs are its node's, in order
            step.inputs = [t for t in graph.node[step.nodes[0]].input if t]
        else:  # a backend sub-graph takes its initializers inside it
            step.inputs = [t for t in read if t not in initializers]
        needed_after |= set(read)


def describe_plan(graph: GraphProto, steps: list[Step], detail: dict[int, str]) -> dict[str, Any]:
    """The plan as JSON (``inferctl models -v``)."""
    return {"cuts": len(steps) - 1,
            "steps": [{"executor": s.executor, "detail": detail.get(k, ""),
                       "nodes": [node_label(graph, i) for i in s.nodes],
                       "inputs": s.inputs, "outputs": s.outputs}
                      for k, s in enumerate(steps)]}
