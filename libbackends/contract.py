"""The backend contract: what every backend (built-in, Python plugin, native plugin) is.

A :class:`Backend` says who it is, which device kind it drives, whether its device is
really there (:meth:`Backend.probe`), whether it can run a model
(:meth:`Backend.supports`), and loads models into :class:`LoadedModel` objects that run
batches of named tensors. The daemon talks to backends only through this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import re
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import ErrorCode, ModelError
from inferd.ipc.dtypes import dtype_name

BACKEND_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a backend id may be: 1-64 letters, digits, '.', '_' or '-'."""

API_VERSION = (1, 0)
"""(major, minor) of the backend contract; a plugin must match the major and not exceed
the minor."""


class DeviceKind(StrEnum):
    """The kind of device a backend drives; preference lists name these."""

    CPU = "cpu"
    GPU = "gpu"
    NPU = "npu"


Dim = int | str | None
"""A tensor dimension: a fixed size, a symbolic name, or unknown."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, wire dtype name and shape of a model input or output."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Probe:
    """Result of :meth:`Backend.probe`: is the device there, and if not, why not.

    Attributes:
        available: the backend can run models now.
        reason: why not (or a note on a partial find), for ``inferctl backends``.
        devices: the devices found, as the engine names them (``CPU``, ``GPU.0``,
            ``cuda:0``).
        kinds: the device kinds found, for a backend that drives several (OpenVINO:
            CPU, GPU and NPU); empty means just the backend's own ``kind``. Models are
            placed only on kinds listed here.
    """

    available: bool
    reason: str = ""
    devices: tuple[str, ...] = ()
    kinds: tuple[DeviceKind, ...] = ()


@dataclass
class LoadOptions:
    """What the daemon asks of a load.

    Attributes:
        intra_op_threads, inter_op_threads, allow_spinning: the ``[onnxruntime]``
            thread settings of the daemon's config.
        options: the backend's own settings: the table named after the backend id in
            the model's model.toml (``[openvino]``, ``[onnxruntime-gpu]``, ``[rknn]``),
            over the config file's section of that name where the daemon has one; ``{}``
            if neither. The backend checks its own keys and raises ModelError naming
            the model.toml key for an unknown or bad one.
        kind: the device kind the placement chose for this load (the entry of the
            model's preference list that matched); None means the backend's own kind.
        threads: the engine threads per run the placement chose for this model
            (model.toml ``threads``, or measured within a graph); a backend uses it
            over its own thread setting. None: the backend's own setting. When set,
            ``intra_op_threads`` equals it too (for backends written before it).
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    allow_spinning: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    kind: DeviceKind | None = None
    threads: int | None = None


@dataclass(frozen=True)
class BatchSizes:
    """The batch sizes (rows: lengths of the first dimension) a model runs without a
    switch cost (see :meth:`LoadedModel.batch_sizes`).

    Attributes:
        free: sizes it has ready (compiled for).
        more: how many other sizes it may still make ready (each once, at its first
            run: a compile); 0 when every other size costs a switch at every change.
    """

    free: frozenset[int] = frozenset()
    more: int = 0


class LoadedModel(ABC):
    """A model loaded by a backend, ready to run."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    device: str = ""
    """The device it runs on, as the engine names it (``CPU``, ``GPU.0``, ``cuda:0``,
    ``npu core 0_1``); empty: the backend's device kind."""

    @abstractmethod
    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        """Run one batch.

        Args:
            inputs: one array per model input, already checked against ``self.inputs``.
            outputs: names of the outputs wanted, or None for all.

        Returns:
            The requested outputs by name.

        Raises:
            ModelError or BackendError: the run failed; the message names the model.
        """

    def run_into(self, inputs: dict[str, NDArray[Any]], outputs: list[str] | None,
                 into: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """:meth:`run`, writing the outputs named in ``into`` into the arrays given there
        (C-contiguous, writable, of the dtype and shape the caller expects from an earlier
        run on inputs of these shapes: a worker process's shared arena, so that its reply
        carries them without a copy). Optional: the default runs as :meth:`run` and
        ignores ``into``.

        Returns:
            The requested outputs by name: for a name in ``into``, that very array when
            the engine wrote it there; else the engine's own (an output of another
            shape than expected: the caller stops asking for this model).
        """
        return self.run(inputs, outputs)

    @abstractmethod
    def unload(self) -> None:
        """Free everything the model holds. Called once; ``run`` is not called after."""

    def memory_bytes(self) -> int | None:
        """Memory the backend knows the model uses, or None if it cannot tell."""
        return None

    def describe(self) -> dict[str, Any]:
        """Optional facts shown by ``inferctl models -v`` (a partitioned model's
        ``plan``); empty by default."""
        return {}

    def batch_sizes(self) -> BatchSizes | None:
        """The batch sizes this model runs without a switch cost, for adaptive batching
        (daemon/batching.py); None, the default, when every size runs at its own cost
        (onnxruntime plans each run anew). OpenVINO's dynamic compile re-plans at each
        change of input shape (~2 ms on ocr-cls here): only its static compiles are
        free."""
        return None


class Backend(ABC):
    """One inference engine on one kind of device.

    Attributes:
        id: unique name in a registry, e.g. ``"onnxruntime"``.
        version: the backend's own version string.
        api_version: the contract version it was written against.
        kind: the device kind it drives.
    """

    id: str
    version: str
    api_version: tuple[int, int] = API_VERSION
    kind: DeviceKind

    @abstractmethod
    def probe(self) -> Probe:
        """Check that the device and its runtime are really present. Must not raise."""

    @abstractmethod
    def supports(self, model_path: Path) -> tuple[bool, str]:
        """Whether this backend can run the model file, and if not, why not."""

    @abstractmethod
    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        """Load a model. Raises ModelError or BackendError naming the file."""


    # Optional: ``configure(settings: dict) -> None``, called once before ``probe()`` with
    # the daemon config file's section named after the backend id (``[ncnn]``; ``{}`` if
    # the daemon has none): settings that decide what the probe registers, such as
    # ``[ncnn] allow_software_vulkan``. A change to them takes effect at a restart.

    # Optional: ``supported_nodes(model: onnx.ModelProto) -> list[str]``, one entry per
    # node of model.graph.node, "" where this backend runs the node, else why not. The
    # loader asks it to cut a model into sub-graphs per backend (docs/customops.md); a
    # backend without it is taken to run every node of a standard ONNX domain.


REQUIRED_METHODS = ("probe", "supports", "load")
REQUIRED_ATTRIBUTES = ("id", "version", "kind")


def check_inputs(model: str, specs: tuple[TensorSpec, ...],
                 inputs: dict[str, NDArray[Any]]) -> None:
    """Check a request's tensors against a model's declared inputs.

    Raises:
        ModelError (INVALID_ARGUMENT): missing or extra inputs, wrong dtype, rank or a
            fixed dimension; the message names the model, the tensor and what it expects.
    """
    if len(inputs) != len(specs) or not all(s.name in inputs for s in specs):
        names = [s.name for s in specs]
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        parts = []
        if missing:
            parts.append(f"missing inputs {missing}")
        if extra:
            parts.append(f"unknown inputs {extra}")
        raise ModelError(f"model {model}: {' and '.join(parts)}; it takes {names}")
    for spec in specs:
        name = spec.name
        array = inputs[name]
        dtype = dtype_name(array)
        if dtype != spec.dtype:
            raise ModelError(f"model {model}: input {name!r} is {dtype}, expected {spec.dtype}")
        if len(array.shape) != len(spec.shape):
            raise ModelError(f"model {model}: input {name!r} has shape {list(array.shape)} "
                             f"(rank {array.ndim}), expected rank {len(spec.shape)} "
                             f"{list(spec.shape)}")
        for axis, (got, want) in enumerate(zip(array.shape, spec.shape)):
            if isinstance(want, int) and want >= 0 and got != want:
                raise ModelError(f"model {model}: input {name!r} has shape "
                                 f"{list(array.shape)}, expected {list(spec.shape)} "
                                 f"(axis {axis} must be {want})")


def run_error(message: str, inputs: dict[str, NDArray[Any]],
              client: bool = False) -> ModelError:
    """The error of an engine's failed run, with the code of whoever caused it.

    A request with an input that holds no element (a zero-size dimension on an axis the
    model leaves free; a fixed one is refused by :func:`check_inputs`) is the client's
    error when the engine fails on it: onnxruntime reports such a failure as ``FAIL``
    (ocr-rec with ``[0,3,48,320]``: a Reshape of zero rows; vad with ``[1,0]``: a
    reflect Pad of nothing) and OpenVINO as a RuntimeError, although the same engines
    call a non-empty input of a bad shape ``INVALID_ARGUMENT``. An empty input that an
    engine runs is not refused: a zero batch is legal ONNX.

    Args:
        message: what failed, naming the engine and the model, and the engine's reason.
        inputs: the run's inputs.
        client: the engine itself said the inputs are wrong (onnxruntime's
            ``INVALID_ARGUMENT`` status).

    Returns:
        A ModelError: INVALID_ARGUMENT when the client caused the failure, else INTERNAL.
    """
    empty = [f"{name!r} has shape {list(a.shape)}" for name, a in inputs.items()
             if a.size == 0]
    if empty:
        return ModelError(f"{message} (an empty input: {', '.join(empty)}; the model "
                          f"cannot run on zero elements)", ErrorCode.INVALID_ARGUMENT)
    return ModelError(message, ErrorCode.INVALID_ARGUMENT if client else ErrorCode.INTERNAL)


ALIGNMENT = 64
"""Bytes to which an in-process engine's floating-point inputs are aligned."""
_FLOATS = frozenset({"float16", "float32", "float64", "bfloat16", "float8_e4m3fn",
                     "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})


ADDRESS_FREE_OPS = frozenset({
    "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice",
    "Concat", "Split", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad",
    "DepthToSpace", "SpaceToDepth", "ReverseSequence", "Compress", "ScatterElements",
    "ScatterND", "Where", "Shape", "Size"})
"""ONNX ops that only move, pick, fill or describe elements: onnxruntime's results of a
model made of them alone do not depend on where its float inputs lie, so such a model
needs no aligned copy (:func:`aligned`). The list is the test's, not a belief:
tests/e2e/test_onnx_node_cases.py runs every ONNX node case made only of these ops with
its float inputs at 16 offsets and finds one result each. Arithmetic is left out even
where it came out the same (reductions, normalisations and Einsum did not), and so are
Constant and ConstantOfShape, which no such case has beside a float input."""


def address_free(op_types: set[str]) -> bool:
    """Whether a model of ``op_types`` (every node's, sub-graphs included) gives the same
    bits wherever its inputs lie (:data:`ADDRESS_FREE_OPS`)."""
    return bool(op_types) and op_types <= ADDRESS_FREE_OPS


SCRATCH_BYTES = 64 * 2**10
"""Bytes of each thread's scratch buffer for :func:`aligned` with ``scratch=True``: small
inputs are copied there, at 64-byte offsets, instead of into fresh allocations."""
SCRATCH_INPUT = 4 * 2**10
"""An input of at most this many bytes goes to the scratch buffer (copying it costs less
than asking numpy for its address)."""

_scratch = threading.local()


def _scratch_buffer() -> NDArray[np.uint8]:
    """This thread's scratch buffer, starting at a multiple of :data:`ALIGNMENT`."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        raw = np.empty(SCRATCH_BYTES + ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % ALIGNMENT
        buf = _scratch.buf = raw[start:start + SCRATCH_BYTES]
    return buf  # type: ignore[no-any-return]


def _copy_aligned(array: NDArray[Any]) -> NDArray[Any]:
    raw = np.empty(array.nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    copy = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def aligned(inputs: dict[str, NDArray[Any]], scratch: bool = False
            ) -> dict[str, NDArray[Any]]:
    """``inputs`` with every floating-point tensor at an address that is a multiple of
    :data:`ALIGNMENT` (a copy of each one that is not; the others as they are).

    The same input must give the same bits whatever address it landed at: received
    frames and numpy's own arrays sit at any 16-byte (or worse) boundary, and
    onnxruntime's float reductions take different code paths at different alignments
    (ReduceSum over 3x257 float32 gave 3 different results over 16 offsets). Integer
    tensors are exact anyway and are not copied (an image stays where it is).

    Args:
        inputs: the tensors.
        scratch: copy small tensors (up to :data:`SCRATCH_INPUT` bytes each) into this
            thread's scratch buffer, without looking where they are: the copies are
            valid only until this thread calls ``aligned(..., scratch=True)`` again (an
            engine's run that reads them and returns outputs of its own).
    """
    out = inputs
    offset = 0
    for name, array in inputs.items():
        nbytes = array.nbytes
        if nbytes == 0 or dtype_name(array) not in _FLOATS:
            continue
        if scratch and nbytes <= SCRATCH_INPUT and offset + nbytes <= SCRATCH_BYTES:
            copy = np.ndarray(array.shape, array.dtype, _scratch_buffer(), offset)
            copy[...] = array
            offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        elif array.ctypes.data % ALIGNMENT == 0:
            continue
        else:
            copy = _copy_aligned(array)
        if out is inputs:
            out = dict(inputs)
        out[name] = copy
    return out


def check_outputs(model: str, specs: tuple[TensorSpec, ...], wanted: list[str] | None) -> None:
    """Raise ModelError (INVALID_ARGUMENT) if ``wanted`` names an output the model lacks."""
    if wanted is None:
        return
    names = [s.name for s in specs]
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ModelError(f"model {model}: unknown outputs {unknown}; it has {names}")
