"""Python custom ops: every class with an ``op_type`` in a ``*.py`` file of an ops folder.

RKNN's contract (rknn-toolkit2 ``reg_custom_op``)::

    class CstSigmoid:
        op_type = "cstSigmoid"
        domain = "com.example"           # optional: only nodes of this ONNX domain

        def shape_infer(self, node, in_shapes, in_dtypes):
            return [in_shapes[0]], [in_dtypes[0]]

        def compute(self, node, inputs):
            alpha = get_attr(node, "alpha", 1.0)
            return [1 / (1 + np.exp(-alpha * inputs[0]))]

The class is checked once when its file is loaded (instantiated without arguments,
both methods callable, ``op_type`` a non-empty string, ``domain`` a string if given);
what fails is logged with the reason and skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from onnx import NodeProto

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.libbackends.customops.contract import (
    BindContext, BoundOp, CustomOp, OpKind, OpRegistry, Shape, Skipped,
)

log = logging.getLogger(__name__)

REQUIRED = ("shape_infer", "compute")
_numbers = itertools.count(1)


class PythonOp(CustomOp):
    """An instance of a user class, shared by every node it runs."""

    kind = OpKind.PYTHON

    def __init__(self, obj: Any, op_type: str, domain: str | None, source: str) -> None:
        self.obj = obj
        self.op_type = op_type
        self.domain = domain
        self.source = source

    def bind(self, node: NodeProto, ctx: BindContext) -> BoundOp:
        return PythonBound(self, node)


class PythonBound(BoundOp):
    def __init__(self, op: PythonOp, node: NodeProto) -> None:
        self.op = op
        self.node = node
        self.where = f"custom op {op.op_type} ({op.source}) on node {node.name or '?'}"

    def shape_infer(self, in_shapes: list[Shape], in_dtypes: list[np.dtype[Any]]
                    ) -> tuple[list[Shape], list[np.dtype[Any]]]:
        try:
            shapes, dtypes = self.op.obj.shape_infer(self.node, in_shapes, in_dtypes)
            return [list(s) for s in shapes], [np.dtype(d) for d in dtypes]
        except ModelError:
            raise
        except Exception as e:  # the user's code: reported with the op and node
            raise ModelError(f"{self.where}: shape_infer raised {type(e).__name__}: {e}",
                             ErrorCode.INVALID_ARGUMENT) from e

    def compute(self, inputs: Sequence[NDArray[Any]]) -> list[NDArray[Any]]:
        try:
            out = self.op.obj.compute(self.node, list(inputs))
        except ModelError:
            raise
        except Exception as e:  # the user's code: a request's failure, not a crash
            raise ModelError(f"{self.where}: compute raised {type(e).__name__}: {e}",
                             ErrorCode.INTERNAL) from e
        if not isinstance(out, list | tuple) or len(out) != len(self.node.output):
            raise ModelError(f"{self.where}: compute returned {type(out).__name__} "
                             f"{'of ' + str(len(out)) if isinstance(out, list | tuple) else ''}"
                             f", expected a list of {len(self.node.output)} arrays",
                             ErrorCode.INTERNAL)
        return [np.asarray(a) for a in out]


def load_file(path: Path, registry: OpRegistry) -> list[CustomOp]:
    """Register every op class of one file; what cannot be is logged and recorded."""
    def skip(reason: str, stage: str = "contract checked") -> None:
        registry.skipped.append(Skipped(str(path), reason, stage))
        log.warning("custom op file %s skipped at stage '%s': %s", path, stage, reason,
                    extra={"PLUGIN_PATH": str(path), "STAGE": stage})

    name = f"inferd_customops_{next(_numbers)}_{path.stem}"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            skip("python cannot import it", "opened")
            return []
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # contained here: the daemon starts without it
        sys.modules.pop(name, None)
        skip(f"import raised {_exc(e)}", "opened")
        return []
    added: list[CustomOp] = []
    # definition order; a class imported from elsewhere is not this file's op
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and c.__module__ == name and hasattr(c, "op_type")]
    if not classes:
        skip("it defines no class with an op_type attribute")
    for cls in classes:
        op, why = _check(cls, path)
        if op is None:
            registry.skipped.append(Skipped(f"{path}:{cls.__name__}", why))
            log.warning("custom op class %s in %s skipped: %s", cls.__name__, path, why,
                        extra={"PLUGIN_PATH": str(path), "STAGE": "contract checked"})
            continue
        taken = registry.add(op)
        if taken:
            registry.skipped.append(Skipped(f"{path}:{cls.__name__}", taken, "registered"))
            log.warning("custom op class %s in %s skipped: %s", cls.__name__, path, taken,
                        extra={"PLUGIN_PATH": str(path), "STAGE": "registered"})
            continue
        log.info("custom op %s registered from %s (python)", op.label, op.source,
                 extra={"PLUGIN_PATH": str(path), "OP": op.op_type})
        added.append(op)
    return added


def _check(cls: type, path: Path) -> tuple[PythonOp | None, str]:
    op_type = getattr(cls, "op_type", None)
    if not isinstance(op_type, str) or not op_type:
        return None, f"op_type is {op_type!r}, not a non-empty string"
    domain = getattr(cls, "domain", None)
    if domain is not None and not isinstance(domain, str):
        return None, f"domain is a {type(domain).__name__}, not a string"
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        return None, (f"op {op_type} lacks method {', '.join(m + '()' for m in missing)}; "
                      f"the contract needs shape_infer(self, node, in_shapes, in_dtypes) "
                      f"and compute(self, node, inputs)")
    try:
        obj = cls()
    except Exception as e:  # the user's constructor
        return None, f"op {op_type}: {cls.__name__}() raised {_exc(e)}"
    return PythonOp(obj, op_type, domain, f"{path}:{cls.__name__}"), ""


def _exc(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    return f"{type(e).__name__}: {e}"
