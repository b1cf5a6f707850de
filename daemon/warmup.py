"""Warm-up: one run of a freshly loaded model before it counts as ready, so the first
real request does not pay for lazy allocations and kernel selection.

model.toml ``warmup = true`` turns it on. The inputs are the ``.npy`` files in the
version's ``warmup/`` folder beside the model file (``<input name>.npy``, one per input),
else zeros of the declared shapes: the first dynamic dimension gets 1 (the batch), the
others ``cache.warmup_dim``; ``warmup_shapes = {x = [1, 3, 64, 64]}`` gives exact
shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.daemon.model_settings import ModelSettings
from inferd.daemon.placed_model import PlacedModel
from inferd.ipc.dtypes import numpy_dtype
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.libbackends.contract import LoadedModel, TensorSpec, check_inputs

WARMUP_DIR = "warmup"


def _zeros(spec: TensorSpec, shape: list[int]) -> NDArray[Any]:
    if spec.dtype == "string":
        return np.full(shape, "", dtype=object)
    return np.zeros(shape, dtype=numpy_dtype(spec.dtype))  # bfloat16, int4...: ml_dtypes'


def _shape(spec: TensorSpec, dynamic: int) -> list[int]:
    return [d if isinstance(d, int) and d >= 0 else (1 if axis == 0 else dynamic)
            for axis, d in enumerate(spec.shape)]


def warmup_inputs(label: str, model: LoadedModel, model_path: Path,
                  settings: ModelSettings, dynamic: int) -> dict[str, NDArray[Any]]:
    """The warm-up inputs for ``model`` (see the module docstring).

    Raises:
        ModelError: a warm-up file is unreadable.
    """
    folder = model_path.parent / WARMUP_DIR
    shapes = settings.warmup_shapes
    inputs = {}
    for spec in model.inputs:
        path = folder / f"{spec.name}.npy"
        if path.is_file():
            try:
                inputs[spec.name] = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise ModelError(f"model {label}: cannot read warm-up input {path}: {e}",
                                 ErrorCode.INTERNAL) from e
            continue
        shape = shapes.get(spec.name)
        inputs[spec.name] = _zeros(spec, _shape(spec, dynamic) if shape is None else shape)
    return inputs


def warm_up(label: str, model: LoadedModel, model_path: Path, settings: ModelSettings,
            dynamic: int) -> bool:
    """Run the warm-up if model.toml asks for one; True if it ran.

    Raises:
        ModelError: the warm-up failed; the model must not be served.
    """
    if not settings.warmup:
        return False
    inputs = warmup_inputs(label, model, model_path, settings, dynamic)
    try:
        check_inputs(label, model.inputs, inputs)
        # not one of the first requests whose inputs measuring waits for
        model.run_unsampled(inputs) if isinstance(model, PlacedModel) else model.run(inputs)
    except InferdError as e:
        raise ModelError(f"model {label}: warm-up failed: {e.message}",
                         ErrorCode.INTERNAL) from e
    return True
