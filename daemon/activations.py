"""What a run of an ONNX model holds at its peak, known before it runs.

The model's graph is given the run's concrete input shapes, ONNX shape inference
(``onnx.shape_inference`` with data propagation) sizes every intermediate tensor, and a
walk over the nodes in topological order keeps each tensor alive from the node that
makes it to the last node that reads it: the largest sum of live bytes on the way is the
run's peak of activations (:meth:`Activations.peak`). An engine's working memory is
close to a fixed multiple of it (the factor per backend is in
:mod:`inferd.daemon.memory`; ``bench/bench_memory.py`` measures it on the demo models).

Shape inference alone leaves the tensors that follow a ``Reshape`` whose target is
computed from ``Shape`` nodes unsized (the recogniser's attention blocks): the small
integer computations on shapes and constants are folded into constants between rounds
of inference (:class:`_Fold`). Sub-graphs (``If``, ``Loop``, ``Scan``) count their own
peak at the node that runs them (the larger branch of an ``If`` whose condition is not
known). Weights are stripped when the file is read (their dimensions stay), so what is
kept per model is a skeleton of some hundred KiB; ``onnx`` is imported only here, when
a model is first estimated.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SMALL = 4096
"""Tensors of at most this many elements keep their values (shapes, scales, small
constants); larger ones are stripped to their dimensions."""
ROUNDS = 4
"""Rounds of shape inference and folding at most."""


@dataclass(frozen=True)
class Peak:
    """A run's peak of live activations: ``bytes``, and how many intermediate tensors
    could not be sized (counted as 0)."""

    bytes: int
    unsized: int
    tensors: int

    @property
    def complete(self) -> bool:
        """Sized well enough to refuse a run on it: at most one tensor in ten unsized
        (the outputs of an If whose branches give different shapes, behind the peak)."""
        return self.unsized * 10 <= self.tensors


class Activations:
    """The activation peaks of one ONNX model, by input shapes.

    Args:
        path: the model file.

    Raises:
        OSError, ValueError: the file cannot be read or parsed as ONNX (the caller
            falls back on measurements alone).
    """

    def __init__(self, path: Path) -> None:
        import onnx

        self._model = _skeleton(onnx.load(str(path)))
        self._lock = threading.Lock()  # the skeleton is copied per shape, not shared

    def peak(self, shapes: Mapping[str, Sequence[int]],
             values: Mapping[str, Any] | None = None) -> Peak:
        """The peak of live activations of a run with inputs of ``shapes``; ``values``:
        inputs whose values are known (small integers such as a sample rate, which
        may choose a branch)."""
        import onnx
        from onnx import shape_inference

        with self._lock:
            model = onnx.ModelProto()
            model.CopyFrom(self._model)
        _set_input_shapes(model.graph, shapes)
        for _ in range(ROUNDS):
            model = shape_inference.infer_shapes(model, data_prop=True)
            unsized = any(s is None for s in _sizes(model.graph).values())
            fold = _Fold()
            fold.graph(model.graph, dict(values or {}), {})
            if not (fold.branches or (unsized and fold.nodes)):
                break  # nothing more to learn from another round
            _clear_value_info(model.graph)
        else:
            model = shape_inference.infer_shapes(model, data_prop=True)
        walk = _Walk({v.name for v in model.graph.input})
        bytes_ = walk.graph(model.graph, _sizes(model.graph))
        return Peak(bytes_, walk.unsized, walk.tensors)


# ----------------------------------------------------------------- the skeleton


def _skeleton(model: Any) -> Any:
    """``model`` with every large tensor (weights, in Constant nodes or initializers)
    reduced to its name, type and dimensions."""
    for graph in _graphs(model.graph):
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    _strip(attr.t)
        for t in graph.initializer:
            _strip(t)
    return model


def _strip(t: Any) -> None:
    if math.prod(t.dims) > SMALL:
        dims, dtype, name = list(t.dims), t.data_type, t.name
        t.Clear()
        t.dims.extend(dims)
        t.data_type = dtype
        t.name = name


def _graphs(graph: Any) -> Iterable[Any]:
    yield graph
    for node in graph.node:
        for g in _subgraphs(node):
            yield from _graphs(g)


def _subgraphs(node: Any) -> list[Any]:
    out = []
    for attr in node.attribute:
        if attr.HasField("g"):
            out.append(attr.g)
        out.extend(attr.graphs)
    return out


def _set_input_shapes(graph: Any, shapes: Mapping[str, Sequence[int]]) -> None:
    for value in graph.input:
        shape = shapes.get(value.name)
        if shape is None:
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for d in shape:
            dims.add().dim_value = int(d)


def _clear_value_info(graph: Any) -> None:
    for g in _graphs(graph):
        del g.value_info[:]


# ----------------------------------------------------------------- sizes


def _itemsize(elem_type: int) -> int | None:
    from onnx import helper

    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None
    return None if dtype.kind == "O" else dtype.itemsize


def _size(value: Any) -> int | None:
    t = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    item = _itemsize(t.elem_type)
    if item is None or any(d is None for d in dims):
        return None
    return math.prod(d for d in dims if d is not None) * item


def _sizes(graph: Any) -> dict[str, int | None]:
    """Bytes of every tensor the graph (and its sub-graphs) describes; None: unsized."""
    out: dict[str, int | None] = {}
    for g in _graphs(graph):
        for value in [*g.value_info, *g.output, *g.input]:
            size = _size(value)
            if out.get(value.name) is None:
                out[value.name] = size
    return out


# ----------------------------------------------------------------- the walk


class _Walk:
    """The peak of live bytes over a graph's nodes in order (recursing into
    sub-graphs); counts the tensors it could not size.

    Only tensors that depend on the run's inputs count: what is computed from weights
    alone an engine computes once, when it loads the model (onnxruntime's constant
    folding), so it is part of the load's cost.

    Args:
        dynamic: the names of the run's inputs (more are added as the walk goes).
    """

    def __init__(self, dynamic: set[str]) -> None:
        self.unsized = 0
        self.tensors = 0
        self._dynamic = dynamic

    def graph(self, graph: Any, sizes: Mapping[str, int | None]) -> int:
        outputs = {o.name for o in graph.output}
        last: dict[str, int] = {}
        for i, node in enumerate(graph.node):
            for name in [*node.input, *_implicit_inputs(node)]:
                last[name] = i
        # A buffer holds one tensor and its aliases (an Identity's output); it is freed
        # once each of its names is past its last reader, unless one is a graph output.
        buffer_of: dict[str, int] = {}
        size_of: list[int] = []
        names_of: list[set[str]] = []
        live = peak = 0
        for i, node in enumerate(graph.node):
            reads = set(node.input) | _implicit_inputs(node)
            if node.op_type == "Constant" or not reads & self._dynamic:
                continue  # a weight, or computed from weights alone
            self._dynamic.update(o for o in node.output if o)
            # an If whose condition is not known: either branch may be taken
            inner = max((self.graph(g, sizes) for g in _subgraphs(node)), default=0)
            made = 0
            for name in node.output:
                if not name:
                    continue
                self.tensors += 1
                source = buffer_of.get(node.input[0]) if node.input else None
                if node.op_type in _ALIASES and source is not None:
                    buffer_of[name] = source  # the input's bytes under another name
                    names_of[source].add(name)
                    continue
                size = sizes.get(name)
                if size is None:
                    self.unsized += 1
                    size = 0
                buffer_of[name] = len(size_of)
                size_of.append(size)
                names_of.append({name})
                made += size
            # a sub-graph's own outputs become this node's: counted once
            peak = max(peak, live + max(inner, made))
            live += made
            for name in [*reads, *node.output]:
                b = buffer_of.get(name)
                if b is None or last.get(name, -1) > i or name in outputs:
                    continue
                names_of[b].discard(name)
                if not names_of[b]:
                    live -= size_of[b]
                    size_of[b] = 0
        return peak


_ALIASES = ("Identity",)


def _implicit_inputs(node: Any) -> set[str]:
    """Names a node's sub-graphs read from the enclosing scope."""
    names: set[str] = set()
    for g in _subgraphs(node):
        defined = {v.name for v in g.input} | {t.name for t in g.initializer}
        for n in g.node:
            defined.update(n.output)
        for n in g.node:
            names.update(x for x in n.input if x and x not in defined)
            names.update(x for x in _implicit_inputs(n) if x not in defined)
    return names


# ----------------------------------------------------------------- folding


class _Fold:
    """Replaces the nodes whose inputs are all known small values (constants, and the
    shapes shape inference found) by Constant nodes of their results, and an If whose
    condition is known by the branch it takes, in a graph and its sub-graphs; counts
    what it did."""

    def __init__(self) -> None:
        self.nodes = 0
        self.branches = 0

    def graph(self, graph: Any, outer: Mapping[str, Any],
              outer_shapes: Mapping[str, list[int]]) -> None:
        from onnx import helper, numpy_helper

        known: dict[str, Any] = dict(outer)
        for t in graph.initializer:
            if math.prod(t.dims) <= SMALL and _has_data(t):
                known[t.name] = numpy_helper.to_array(t)
        shapes = {**outer_shapes, **_shapes(graph)}
        nodes = []
        for node in graph.node:
            if node.op_type == "Constant":
                value = _constant(node)
                if value is not None:
                    known[node.output[0]] = value
                nodes.append(node)
                continue
            if node.op_type == "If" and node.input[0] in known:
                # the condition is known (a shape test, a sample rate): the branch taken
                # replaces the If
                branch = next(a.g for a in node.attribute
                              if a.name == ("then_branch" if known[node.input[0]].all()
                                            else "else_branch"))
                nodes.extend(branch.node)
                nodes.extend(helper.make_node("Identity", [inner.name], [outer_name])
                             for inner, outer_name in zip(branch.output, node.output))
                self.branches += 1
                continue
            subgraphs = _subgraphs(node)
            if subgraphs:
                for g in subgraphs:
                    self.graph(g, known, shapes)
                nodes.append(node)
                continue
            if node.op_type in _RECURRENT and not any(a.name == "hidden_size"
                                                       for a in node.attribute):
                # ONNX infers a recurrent node's outputs only from its hidden_size
                # attribute, which exporters may leave out: it is the last dimension of R
                recurrence = shapes.get(node.input[2]) if len(node.input) > 2 else None
                if recurrence is not None and len(recurrence) == 3:
                    node.attribute.append(helper.make_attribute("hidden_size",
                                                                recurrence[2]))
                    self.nodes += 1
            values = _evaluate(node, known, shapes)
            if values is None:
                nodes.append(node)
                continue
            self.nodes += 1
            for name, value in zip(node.output, values):
                known[name] = value
                nodes.append(helper.make_node("Constant", [], [name],
                                              value=numpy_helper.from_array(value, name)))
        del graph.node[:]
        graph.node.extend(nodes)


_RECURRENT = ("LSTM", "GRU", "RNN")


def _has_data(t: Any) -> bool:
    return bool(t.raw_data or t.float_data or t.int32_data or t.int64_data
                or t.double_data or t.uint64_data) or math.prod(t.dims) == 0


def _constant(node: Any) -> Any:
    from onnx import numpy_helper

    for attr in node.attribute:
        if attr.name == "value" and _has_data(attr.t) and math.prod(attr.t.dims) <= SMALL:
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_int":
            return np.array(attr.i, np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), np.int64)
        if attr.name == "value_float":
            return np.array(attr.f, np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), np.float32)
    return None


def _shapes(graph: Any) -> dict[str, list[int]]:
    out = {}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        t = value.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            out[value.name] = [d.dim_value for d in t.shape.dim]
    return out


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _evaluate(node: Any, known: Mapping[str, Any],
              shapes: Mapping[str, list[int]]) -> list[Any] | None:
    """The node's outputs if it can be computed now (a shape computation), else None."""
    op = node.op_type
    a = _attrs(node)
    if op == "Shape":
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        return [np.array(shape[a.get("start", 0):a.get("end")], np.int64)]
    if op == "Size":
        shape = shapes.get(node.input[0])
        return None if shape is None else [np.array(math.prod(shape), np.int64)]
    inputs = [x for x in node.input]
    if not inputs or any(x and x not in known for x in inputs):
        return None
    fn = _OPS.get(op)
    if fn is None:
        return None
    args = [known[x] if x else None for x in inputs]
    try:
        out = fn(args, a)
    except (ValueError, TypeError, IndexError, ZeroDivisionError, OverflowError):
        return None
    values = [np.asarray(v) for v in out]
    if any(v.size > SMALL for v in values):
        return None
    return values


def _axes(args: list[Any], a: Mapping[str, Any], position: int) -> list[int] | None:
    if len(args) > position and args[position] is not None:
        return [int(x) for x in np.asarray(args[position]).ravel()]
    axes = a.get("axes")
    return None if axes is None else [int(x) for x in axes]


def _unsqueeze(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    x = np.asarray(args[0])
    axes = _axes(args, a, 1) or []
    rank = x.ndim + len(axes)
    for axis in sorted(ax % rank for ax in axes):
        x = np.expand_dims(x, axis)
    return [x]


def _squeeze(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    axes = _axes(args, a, 1)
    x = np.asarray(args[0])
    return [np.squeeze(x) if axes is None else np.squeeze(x, tuple(ax % x.ndim for ax in axes))]


def _slice(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    x = np.asarray(args[0])
    if len(args) > 1:
        starts = [int(v) for v in np.asarray(args[1]).ravel()]
        ends = [int(v) for v in np.asarray(args[2]).ravel()]
        axes = _axes(args, a, 3) or list(range(len(starts)))
        steps = ([int(v) for v in np.asarray(args[4]).ravel()]
                 if len(args) > 4 and args[4] is not None else [1] * len(starts))
    else:  # opset < 10
        starts, ends = list(a["starts"]), list(a["ends"])
        axes, steps = list(a.get("axes", range(len(starts)))), [1] * len(starts)
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis % x.ndim] = slice(start, end, step)
    return [x[tuple(index)]]


def _reshape(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    x = np.asarray(args[0])
    shape = [int(v) for v in np.asarray(args[1]).ravel()]
    if not a.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return [x.reshape(shape)]


def _cast(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    from onnx import helper

    return [np.asarray(args[0]).astype(helper.tensor_dtype_to_np_dtype(a["to"]))]


def _div(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    x, y = np.asarray(args[0]), np.asarray(args[1])
    if x.dtype.kind in "iu" and y.dtype.kind in "iu":
        return [np.trunc(x / y).astype(x.dtype)]
    return [x / y]


def _binary(fn: Any) -> Any:
    def run(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
        x, y = np.asarray(args[0]), np.asarray(args[1])
        out = fn(x, y)
        return [out.astype(x.dtype) if out.dtype.kind != "b" else out]
    return run


def _unary(fn: Any) -> Any:
    def run(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
        x = np.asarray(args[0])
        return [np.asarray(fn(x)).astype(x.dtype)]
    return run


def _gather(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    return [np.take(np.asarray(args[0]), np.asarray(args[1]).astype(np.int64),
                    axis=a.get("axis", 0))]


def _concat(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    return [np.concatenate([np.atleast_1d(np.asarray(x)) for x in args], axis=a["axis"])]


def _constant_of_shape(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    from onnx import numpy_helper

    value = a.get("value")
    fill = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
    shape = [int(v) for v in np.asarray(args[0]).ravel()]
    if math.prod(shape) > SMALL:
        raise ValueError("too large to fold")
    return [np.full(shape, fill.ravel()[0], fill.dtype)]


def _range(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    start, limit, delta = (np.asarray(x).item() for x in args)
    if abs(float((limit - start) / delta)) > SMALL:
        raise ValueError("too large to fold")
    return [np.arange(start, limit, delta, dtype=np.asarray(args[0]).dtype)]


def _expand(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    x = np.asarray(args[0])
    shape = [int(v) for v in np.asarray(args[1]).ravel()]
    if math.prod(np.broadcast_shapes(x.shape, tuple(shape))) > SMALL:
        raise ValueError("too large to fold")
    return [x * np.ones(shape, x.dtype)]


def _reduce(fn: Any) -> Any:
    def run(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
        x = np.asarray(args[0])
        axes = _axes(args, a, 1)
        keep = bool(a.get("keepdims", 1))
        return [fn(x, axis=None if axes is None else tuple(axes), keepdims=keep)]
    return run


def _where(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
    return [np.where(np.asarray(args[0]), np.asarray(args[1]), np.asarray(args[2]))]


def _minmax(fn: Any) -> Any:
    def run(args: list[Any], a: Mapping[str, Any]) -> list[Any]:
        out = np.asarray(args[0])
        for x in args[1:]:
            out = fn(out, np.asarray(x))
        return [out]
    return run


_OPS: dict[str, Any] = {
    "Identity": lambda args, a: [np.asarray(args[0])],
    "Cast": _cast,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Reshape": _reshape,
    "Transpose": lambda args, a: [np.transpose(np.asarray(args[0]), a.get("perm"))],
    "Flatten": lambda args, a: [np.asarray(args[0]).reshape(
        int(math.prod(np.asarray(args[0]).shape[:a.get("axis", 1)])), -1)],
    "Tile": lambda args, a: [np.tile(np.asarray(args[0]), np.asarray(args[1]))],
    "Gather": _gather,
    "Concat": _concat,
    "ConstantOfShape": _constant_of_shape,
    "Range": _range,
    "Expand": _expand,
    "Where": _where,
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _div,
    "Mod": _binary(np.mod),
    "Pow": _binary(np.power),
    "Equal": _binary(np.equal),
    "Less": _binary(np.less),
    "Greater": _binary(np.greater),
    "And": _binary(np.logical_and),
    "Or": _binary(np.logical_or),
    "Not": lambda args, a: [np.logical_not(np.asarray(args[0]))],
    "Neg": _unary(np.negative),
    "Abs": _unary(np.abs),
    "Floor": _unary(np.floor),
    "Ceil": _unary(np.ceil),
    "Sqrt": _unary(np.sqrt),
    "Max": _minmax(np.maximum),
    "Min": _minmax(np.minimum),
    "ReduceProd": _reduce(np.prod),
    "ReduceSum": _reduce(np.sum),
    "ReduceMin": _reduce(np.min),
    "ReduceMax": _reduce(np.max),
}
"""The operators a shape computation uses, on small numpy values (an explicit table,
as onnx's reference evaluator keeps one class per operator)."""
