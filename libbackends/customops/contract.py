"""The custom-op contract, the attribute helper and the registry of ops.

Every implementation (a Python class, a native CPU library, a native OpenCL library) is
a :class:`CustomOp`: it matches ONNX nodes by op type and (optionally) domain, and is
bound to one node of one model as a :class:`BoundOp` that infers output types and
computes. The :class:`OpRegistry` holds the ops of one scope (the daemon's directories,
or one model's own ``customops/`` folder layered over them). A partitioned plan's one-line
summary lives here too, without onnx: the daemon logs it for a model loaded in a worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import ErrorCode, ModelError

if TYPE_CHECKING:  # onnx is imported when an op is bound, not with the registry
    from onnx import NodeProto

STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
"""Domains whose ops an engine may know; any other domain is custom by definition."""

Shape = list[int | str | None]

_MISSING = object()


def get_attr(node: NodeProto, name: str, default: Any = _MISSING) -> Any:
    """The value of attribute ``name`` of ``node`` (RKNN's ``get_node_attr``).

    Floats, ints, strings (decoded to ``str``), tensors (as numpy arrays) and their
    lists are returned as Python values.

    Raises:
        ModelError (INVALID_ARGUMENT): the node has no such attribute and no default
            was given; the message names the node, its op type and its attributes.
    """
    for attr in node.attribute:
        if attr.name == name:
            from onnx import helper

            value = helper.get_attribute_value(attr)
            if isinstance(value, bytes):
                return value.decode("utf-8", "replace")
            if isinstance(value, list) and value and isinstance(value[0], bytes):
                return [v.decode("utf-8", "replace") for v in value]
            if attr.type == attr.TENSOR:
                from onnx import numpy_helper

                return numpy_helper.to_array(value)
            return value
    if default is _MISSING:
        have = [a.name for a in node.attribute]
        raise ModelError(f"node {node.name or '?'} ({node.op_type}) has no attribute "
                         f"{name!r} (it has {have or 'none'})", ErrorCode.INVALID_ARGUMENT)
    return default


class OpKind(StrEnum):
    """How an op is implemented (shown in the plan)."""

    PYTHON = "python"
    NATIVE_CPU = "native-cpu"
    NATIVE_GPU = "native-gpu"


@dataclass
class BindContext:
    """What binding an op to a node may need.

    Args:
        model: the model's name (for messages).
        threads: the model's threads (native CPU ops split their window over them).
    """

    model: str
    threads: int = 1


class BoundOp(ABC):
    """One op bound to one node: types in, arrays out."""

    detail: str = ""
    """Shown in the plan after the op (e.g. the chosen kernel)."""

    @abstractmethod
    def shape_infer(self, in_shapes: list[Shape], in_dtypes: list[np.dtype[Any]]
                    ) -> tuple[list[Shape], list[np.dtype[Any]]]:
        """Output shapes and dtypes for inputs of these shapes and dtypes."""

    @abstractmethod
    def compute(self, inputs: Sequence[NDArray[Any]]) -> list[NDArray[Any]]:
        """One output array per node output."""

    def close(self) -> None:
        """Release what :meth:`CustomOp.bind` acquired."""


class CustomOp(ABC):
    """An implementation of one op type, from one file."""

    op_type: str
    domain: str | None
    source: str
    kind: OpKind

    @property
    def label(self) -> str:
        return f"{self.op_type} (domain {self.domain!r})" if self.domain is not None \
            else f"{self.op_type} (any domain)"

    @abstractmethod
    def bind(self, node: NodeProto, ctx: BindContext) -> BoundOp:
        """Prepare to run ``node``. Raises ModelError naming the op and the reason."""

    def to_json(self) -> dict[str, Any]:
        return {"op_type": self.op_type, "domain": self.domain, "kind": str(self.kind),
                "source": self.source}


@dataclass
class Skipped:
    """A file or class that is not an op, and why (shown and logged)."""

    path: str
    reason: str
    stage: str = "contract checked"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "stage": self.stage, "reason": self.reason}


@dataclass
class OpRegistry:
    """The custom ops of one scope, by (domain or None, op type).

    Args:
        parent: ops of the enclosing scope; this registry's ops shadow them.
    """

    parent: OpRegistry | None = None
    ops: dict[tuple[str | None, str], CustomOp] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)
    search_path: list[str] = field(default_factory=list)
    search_path_source: str = ""

    def add(self, op: CustomOp) -> str | None:
        """Register ``op``; None, or why not (the op type is taken in this scope)."""
        key = (op.domain, op.op_type)
        taken = self.ops.get(key)
        if taken is not None:
            return f"op type {op.label} is already defined by {taken.source}"
        self.ops[key] = op
        return None

    def find(self, node: NodeProto) -> CustomOp | None:
        """The op for ``node``: this scope first, the exact domain before "any"."""
        domain = node.domain or ""
        op = self.ops.get((domain, node.op_type)) or self.ops.get((None, node.op_type))
        if op is None and domain == "ai.onnx":
            op = self.ops.get(("", node.op_type))
        if op is None and self.parent is not None:
            return self.parent.find(node)
        return op

    def all_ops(self) -> list[CustomOp]:
        mine = list(self.ops.values())
        inherited = self.parent.all_ops() if self.parent else []
        keys = set(self.ops)
        return mine + [o for o in inherited if (o.domain, o.op_type) not in keys]

    def names(self) -> list[str]:
        return sorted(o.label for o in self.all_ops())

    def view(self) -> dict[str, Any]:
        """The troubleshooting view (answered with the ``backends`` op)."""
        return {"ops": [o.to_json() for o in self.all_ops()],
                "skipped": [s.to_json() for s in self.skipped],
                "search_path": list(self.search_path),
                "search_path_source": self.search_path_source}


def summary(plan: dict[str, Any]) -> str:
    """One line: ``3 steps, 2 cuts: onnxruntime 1 node | python:cstSigmoid | ...``."""
    parts = []
    for s in plan["steps"]:
        n = len(s["nodes"])
        text = s["executor"] if ":" in s["executor"] else \
            f"{s['executor']} {n} node{'s' if n != 1 else ''}"
        parts.append(text + (f" [{s['detail']}]" if s["detail"] else ""))
    return (f"{len(plan['steps'])} steps, {plan['cuts']} cuts: " + " | ".join(parts))


def plan_note(model: Any) -> str:
    """``", partitioned: 3 steps, 2 cuts: ..."`` for a loaded model's load log line, or
    "" (light: the daemon calls it for a model loaded in a worker, without onnx)."""
    plan = model.describe().get("plan")
    return f", partitioned: {summary(plan)}" if plan else ""
