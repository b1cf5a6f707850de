"""Loading a model as a plan of steps and running the plan as ONE LoadedModel.

:func:`load_model` is the loader's single entry point: a model whose every node runs on
the chosen backend is loaded by that backend as before (no cost beyond reading the
graph); otherwise the graph is cut (:mod:`.partition`), each backend sub-graph is
written to a private temporary folder and loaded by its backend, each custom-op node is
bound to its op, and the steps run in order in :class:`PartitionedModel`. Arrays cross
step boundaries as they are (numpy arrays handed from one engine to the next, no copy).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import ModelProto, TensorProto, ValueInfoProto, helper, numpy_helper

from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.libc import kept_signal_stack, malloc_trim
from inferd.libbackends.contract import Backend, LoadedModel, LoadOptions, TensorSpec
from inferd.libbackends.customops.contract import BindContext, BoundOp, OpRegistry, Shape
from inferd.libbackends.customops.partition import (
    Step, assign, consumed, describe_plan, order_and_group, summary,
)
from inferd.libbackends.trust import STRICT, StrictModes

log = logging.getLogger(__name__)

Types = dict[str, tuple[int, Shape | None]]
"""tensor name -> (ONNX elem type, shape with None/str for free dimensions; None for an
unknown rank)"""


def load_model(backend: Backend, path: Path, options: LoadOptions, *, model: str,
               ops: OpRegistry | None = None, fallbacks: Sequence[Backend] = (),
               tables: Mapping[str, Any] | None = None) -> LoadedModel:
    """Load ``path`` on ``backend``, partitioned if some nodes need another executor.

    Args:
        backend: the backend the registry chose.
        path: the model file.
        options: the load options (also given to every backend sub-graph).
        model: the model's label, for messages and the log.
        ops: the custom ops this model may use.
        fallbacks: other backends, in the order they are asked for nodes that
            ``backend`` lacks.
        tables: the model's model.toml; a fallback backend's sub-graphs get its own
            table (``[<backend id>]``) as their ``LoadOptions.options``.

    Raises:
        ModelError: a node nobody runs (UNSUPPORTED, naming its op), a custom op that
            cannot be bound, or a sub-graph its backend refuses.
    """
    others = [b for b in fallbacks if b is not backend]
    if path.suffix != ".onnx" or not _may_partition(backend, ops, others):
        return backend.load(path, options)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a broken file is the backend's to report
        log.debug("model %s: cannot read the graph (%s); loading it whole", model, e)
        return backend.load(path, options)
    executors = assign(proto, model, backend, others, ops)
    if all(b is backend for _, b, _ in executors):
        del proto
        malloc_trim()  # the parsed graph must not count in the model's measured memory
        return backend.load(path, options)
    return PartitionedModel.build(proto, executors, _per_backend(backend, options, tables,
                                                                 model), model, path,
                                  options.intra_op_threads)


def _may_partition(backend: Backend, ops: OpRegistry | None,
                   others: Sequence[Backend]) -> bool:
    """Whether a plan is possible at all: some custom op is loaded, or the backend can
    say which nodes it lacks and another backend can say which it runs. Otherwise the
    graph is not even read (reading it costs time and shows in the load's measured
    memory) and a node nobody runs is the backend's own load error."""
    if ops is not None and ops.all_ops():
        return True
    return callable(getattr(backend, "supported_nodes", None)) and \
        any(callable(getattr(b, "supported_nodes", None)) for b in others)


def _per_backend(chosen: Backend, options: LoadOptions, tables: Mapping[str, Any] | None,
                 model: str) -> Callable[[Backend], LoadOptions]:
    def options_for(b: Backend) -> LoadOptions:
        if b is chosen:
            return options
        table = (tables or {}).get(b.id, {})
        if not isinstance(table, dict):
            raise ModelError(f"model {model}: model.toml '{b.id}' must be a table ([{b.id}]) "
                             f"of settings for that backend", ErrorCode.INTERNAL)
        return dataclasses.replace(options, options=dict(table))
    return options_for


def np_dtype(elem: int) -> np.dtype[Any]:
    """numpy dtype of an ONNX element type (onnx >= 1.13 helper, else its old mapping:
    Debian bookworm ships onnx 1.12)."""
    convert = getattr(helper, "tensor_dtype_to_np_dtype", None)
    if convert is not None:
        return np.dtype(convert(elem))
    from onnx import mapping  # type: ignore[attr-defined]

    return np.dtype(mapping.TENSOR_TYPE_TO_NP_TYPE[elem])


def onnx_elem(dtype: np.dtype[Any]) -> int:
    """ONNX element type of a numpy dtype (see :func:`np_dtype`)."""
    convert = getattr(helper, "np_dtype_to_tensor_dtype", None)
    if convert is not None:
        return int(convert(np.dtype(dtype)))
    from onnx import mapping  # type: ignore[attr-defined]

    return int(mapping.NP_TYPE_TO_TENSOR_TYPE[np.dtype(dtype)])


def _value_types(proto: ModelProto) -> Types:
    g = proto.graph
    types: Types = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = (vi.type.tensor_type.elem_type, _shape(vi))
    for t in g.initializer:
        types[t.name] = (t.data_type, list(t.dims))
    return types


def _shape(vi: ValueInfoProto) -> Shape | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tt.shape.dim]


def _list(shape: Shape | None) -> Any:
    return list(shape) if shape is not None else None


def _vi(name: str, types: Types) -> ValueInfoProto:
    elem, shape = types[name]
    return helper.make_tensor_value_info(name, elem, shape)


def _spec(name: str, types: Types) -> TensorSpec:
    elem, shape = types[name]
    dtype = "string" if elem == TensorProto.STRING else np_dtype(elem).name
    return TensorSpec(name, dtype, tuple(shape) if shape is not None else ())


class PartitionedModel(LoadedModel):
    """Steps run in order; the whole plan behind the LoadedModel contract."""

    def __init__(self, model: str, path: Path) -> None:
        self._model = model
        self._path = path
        self._steps: list[tuple[Step, LoadedModel | None, BoundOp | None, list[str]]] = []
        self._consts: dict[str, NDArray[Any]] = {}
        self._tmp = Path(tempfile.mkdtemp(prefix="inferd-plan-"))
        self._lock = threading.Lock()
        self.plan: dict[str, Any] = {}

    @classmethod
    def build(cls, proto: ModelProto, executors: list[Any],
              options: Callable[[Backend], LoadOptions], model: str, path: Path,
              threads: int = 1) -> PartitionedModel:
        self = cls(model, path)
        try:
            self._build(proto, executors, options, threads)
        except BaseException:
            self.unload()
            raise
        log.info("model %s partitioned: %s", model, summary(self.plan),
                 extra={"MODEL": model.split(" ")[0]})
        return self

    def _build(self, proto: ModelProto, executors: list[Any],
               options: Callable[[Backend], LoadOptions], threads: int) -> None:
        g = proto.graph
        steps = order_and_group(g, executors)
        types = _value_types(proto)
        inits = {t.name: t for t in g.initializer}
        ctx = BindContext(self._model, max(1, threads))
        details: dict[int, str] = {}
        for k, step in enumerate(steps):
            if step.op is not None:
                node = g.node[step.nodes[0]]
                step.node_outputs = list(node.output)
                bound = step.op.bind(node, ctx)
                self._steps.append((step, None, bound, []))
                details[k] = bound.detail
                for name in step.inputs:
                    if name in inits and name not in self._consts:
                        self._consts[name] = numpy_helper.to_array(inits[name])
                unknown = [n for n in step.inputs if n not in types]
                if unknown:
                    raise ModelError(f"model {self._model}: custom op {node.op_type}: the "
                                     f"types of inputs {unknown} are unknown")
                shapes, dtypes = bound.shape_infer([_list(types[n][1]) for n in step.inputs],
                                                   [np_dtype(types[n][0])
                                                    for n in step.inputs])
                outs = [o for o in node.output if o]
                if len(shapes) != len(outs) or len(dtypes) != len(outs):
                    raise ModelError(f"model {self._model}: custom op {node.op_type}: "
                                     f"shape_infer gave {len(shapes)} shapes and "
                                     f"{len(dtypes)} dtypes for {len(outs)} outputs")
                for o, s, d in zip(outs, shapes, dtypes):
                    types[o] = (onnx_elem(np.dtype(d)),
                                list(s) if s is not None else None)
            else:
                assert step.backend is not None
                sub = self._subgraph(proto, step, types, k)
                file = self._tmp / f"step{k}.onnx"
                onnx.save(sub, str(file))
                loaded = step.backend.load(file, options(step.backend))
                self._steps.append((step, loaded, None, []))
        self._plan_frees(steps, {o.name for o in g.output})
        self.inputs = tuple(_spec(i.name, types) for i in g.input if i.name not in inits)
        self.outputs = tuple(_spec(o.name, types) for o in g.output)
        self.plan = describe_plan(g, steps, details)

    def _subgraph(self, proto: ModelProto, step: Step, types: Types, k: int) -> ModelProto:
        g = proto.graph
        nodes = [g.node[i] for i in step.nodes]
        used = {t for n in nodes for t in consumed(n)}
        inits = [t for t in g.initializer if t.name in used]
        missing = [n for n in step.inputs if n not in types]
        if missing:
            raise ModelError(f"model {self._model}: step {k} ({step.executor}) reads "
                             f"{missing}, whose types are unknown")
        outputs = [_vi(o, types) if o in types else ValueInfoProto(name=o)
                   for o in step.outputs]
        graph = helper.make_graph(nodes, f"{g.name or 'graph'}_step{k}",
                                  [_vi(n, types) for n in step.inputs], outputs, inits)
        sub = helper.make_model(graph, opset_imports=list(proto.opset_import),
                                ir_version=proto.ir_version)
        problem = ""
        try:
            inferred = onnx.shape_inference.infer_shapes(sub, strict_mode=True)
        except Exception as e:  # onnx's InferenceError: retry leniently, keep the reason
            problem = f": {str(e).strip().splitlines()[-1]}"
            inferred = onnx.shape_inference.infer_shapes(sub)
        for vi in list(inferred.graph.output) + list(inferred.graph.value_info):
            if vi.type.tensor_type.elem_type and vi.name not in types:
                types[vi.name] = (vi.type.tensor_type.elem_type, _shape(vi))
        untyped = [o for o in step.outputs if o not in types]
        if untyped:
            raise ModelError(f"model {self._model}: step {k} ({step.executor}): the types "
                             f"of outputs {untyped} cannot be inferred{problem}")
        del sub.graph.output[:]
        sub.graph.output.extend(_vi(o, types) for o in step.outputs)
        return sub

    def _plan_frees(self, steps: list[Step], keep: set[str]) -> None:
        """After which step each intermediate tensor can be dropped."""
        last: dict[str, int] = {}
        for k, s in enumerate(steps):
            for t in s.inputs:
                last[t] = k
        for k, (step, loaded, bound, frees) in enumerate(self._steps):
            frees.extend(t for t, at in last.items() if at == k and t not in keep
                         and t not in self._consts)

    # ----------------------------------------------------------------- contract

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        env: dict[str, NDArray[Any]] = {**self._consts, **inputs}
        for step, loaded, bound, frees in self._steps:
            try:
                args = [env[n] for n in step.inputs]
            except KeyError as e:
                raise ModelError(f"model {self._model}: step {step.executor} needs "
                                 f"{e.args[0]!r}, which no step produced",
                                 ErrorCode.INTERNAL) from None
            if loaded is not None:
                env.update(loaded.run(dict(zip(step.inputs, args)), step.outputs))
            else:
                assert bound is not None
                outs = bound.compute(args)
                env.update((o, a) for o, a in zip(step.node_outputs, outs) if o)
            for t in frees:
                env.pop(t, None)
        wanted = outputs or [s.name for s in self.outputs]
        return {w: env[w] for w in wanted}

    def unload(self) -> None:
        errors = []
        for _, loaded, bound, _ in self._steps:
            try:
                if loaded is not None:
                    loaded.unload()
                if bound is not None:
                    bound.close()
            except InferdError as e:
                errors.append(e.message)
        self._steps = []
        shutil.rmtree(self._tmp, ignore_errors=True)
        if errors:
            raise ModelError(f"model {self._model}: unload: {'; '.join(errors)}")

    def memory_bytes(self) -> int | None:
        sizes = [m.memory_bytes() for _, m, _, _ in self._steps if m is not None]
        known = [s for s in sizes if s is not None]
        return sum(known) if known else None

    def describe(self) -> dict[str, Any]:
        return {"plan": self.plan}




def load_planned(backend: Backend, path: Path, options: LoadOptions, *, model: str,
                 model_dir: Path, ops: OpRegistry | None, fallbacks: Sequence[Backend],
                 probe_timeout_s: float = 10.0, tables: Mapping[str, Any] | None = None,
                 strict: StrictModes = STRICT) -> LoadedModel:
    """The model manager's hook: the model's own ``customops/`` folder over the daemon's
    ops (if strict modes allow it: else UntrustedCode), then :func:`load_model`. The
    loading thread keeps its alternate signal stack whatever an engine does to it
    (:func:`~inferd.ipc.libc.kept_signal_stack`: OpenVINO's)."""
    from inferd.libbackends.customops.discovery import load_model_ops

    with kept_signal_stack():
        return load_model(backend, path, options, model=model,
                          ops=load_model_ops(model_dir, ops, probe_timeout_s, strict),
                          fallbacks=fallbacks, tables=tables)
