"""The Rockchip NPU backend (id ``rknn``), run out of process in a backend host
(:mod:`inferd.libbackends.host`), never imported by the daemon itself.

Two modes, chosen by what the host's interpreter has:

- **board** (aarch64, ``rknn-toolkit-lite2``'s ``RKNNLite``, the vendor's
  ``/usr/lib/librknnrt.so``): runs the ``model.rknn`` beside the repository's
  ``model.onnx`` (written by ``inferd-convert rknn``), on the NPU cores of
  ``[rknn] core_mask`` (``auto``, ``0``, ``1``, ``2``, ``0_1``, ``0_1_2``).
- **simulator** (x86_64, ``rknn-toolkit2``): converts ``model.onnx``
  (``load_onnx`` -> ``build(do_quantization=False)``, fp16) and simulates it
  (``init_runtime()`` with no target). A ``.rknn`` file cannot run there: the load says
  so. ``core_mask`` is checked but has nothing to place.

model.toml ``[rknn]`` keys: ``core_mask``, ``target_platform`` (default ``rk3588``),
``input_shapes`` (``{name = [1, 3, 48, 192]}``: RKNN needs fixed shapes; a free first
axis is run one row at a time, so it must be 1).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import platform
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import BackendError, ModelError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)
from inferd.libbackends.onnxfile import onnx_specs

LIBRKNNRT = Path("/usr/lib/librknnrt.so")
CORE_MASKS = {"auto": 0, "0": 1, "1": 2, "2": 4, "0_1": 3, "0_1_2": 7}
NPU_CORES = {"rk3588": 3, "rk3576": 2, "rk3568": 1, "rk3566": 1, "rk3562": 1}
OPTIONS = ("core_mask", "target_platform", "input_shapes")
RKNN_FILE = "model.rknn"
SPECS_SUFFIX = ".json"  # model.rknn.json: the tensors of model.rknn, by inferd-convert


def board_soc() -> str | None:
    """The Rockchip SoC this machine is (from the device tree), or None."""
    try:
        compatible = Path("/proc/device-tree/compatible").read_bytes().decode(errors="replace")
    except OSError:
        return None
    for soc in NPU_CORES:
        if f"rockchip,{soc}" in compatible:
            return soc
    return None


def check_options(model: Path, options: dict[str, Any]) -> tuple[str, int, dict[str, list[int]]]:
    """(target_platform, core mask value, input_shapes) from model.toml's ``[rknn]``.

    Raises:
        ModelError: an unknown key or a bad value, naming the model.toml key.
    """
    where = f"model {model}: model.toml [rknn]"
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ModelError(f"{where} has unknown keys {unknown}; known: {', '.join(OPTIONS)}")
    platform_ = str(options.get("target_platform", "rk3588")).lower()
    if platform_ not in NPU_CORES:
        raise ModelError(f"{where} target_platform = {platform_!r}: expected one of "
                         f"{', '.join(NPU_CORES)}")
    raw = options.get("core_mask", "auto")
    mask_name = str(raw) if isinstance(raw, str | int) and not isinstance(raw, bool) else ""
    if mask_name not in CORE_MASKS:
        raise ModelError(f"{where} core_mask = {raw!r}: expected one of "
                         f"{', '.join(repr(k) for k in CORE_MASKS)}")
    mask = CORE_MASKS[mask_name]
    if mask and max(int(c) for c in mask_name.split("_")) >= NPU_CORES[platform_]:
        raise ModelError(f"{where} core_mask = {mask_name!r}: {platform_} has "
                         f"{NPU_CORES[platform_]} NPU core(s) (0..{NPU_CORES[platform_] - 1})")
    shapes = options.get("input_shapes", {})
    if not isinstance(shapes, dict) or not all(
            isinstance(v, list) and all(isinstance(d, int) and d > 0 for d in v)
            for v in shapes.values()):
        raise ModelError(f"{where} input_shapes must be a table of input name = list of "
                         f"positive sizes, e.g. {{x = [1, 3, 48, 192]}}")
    return platform_, mask, {str(k): list(v) for k, v in shapes.items()}


def fixed_shapes(model: Path, inputs: list[TensorSpec],
                 given: dict[str, list[int]]) -> tuple[list[list[int]], bool]:
    """The shape each input is built with, and whether the first axis is run row by row.

    Raises:
        ModelError: a free axis other than the first with no ``input_shapes`` entry.
    """
    unknown = sorted(set(given) - {s.name for s in inputs})
    if unknown:
        raise ModelError(f"model {model}: model.toml [rknn] input_shapes names inputs "
                         f"{unknown}; the model's inputs are {[s.name for s in inputs]}")
    shapes, rowwise = [], False
    for s in inputs:
        if s.name in given:
            shape = given[s.name]
            if len(shape) != len(s.shape) or any(
                    d is not None and d != g for d, g in zip(s.shape, shape)):
                raise ModelError(f"model {model}: model.toml [rknn] input_shapes "
                                 f"{s.name} = {shape} does not fit the model's "
                                 f"{list(s.shape)}")
        else:
            free = [i for i, d in enumerate(s.shape) if d is None]
            if [i for i in free if i != 0]:
                raise ModelError(f"model {model}: input {s.name!r} has free axes {free} "
                                 f"({list(s.shape)}); RKNN needs fixed shapes: set "
                                 f"model.toml [rknn] input_shapes = {{{s.name} = [...]}}")
            shape = [1 if d is None else int(d) for d in s.shape]
        if s.shape and s.shape[0] is None:
            if shape[0] != 1:
                raise ModelError(f"model {model}: model.toml [rknn] input_shapes "
                                 f"{s.name}: the free first axis runs one row at a time, "
                                 f"so it must be 1, not {shape[0]}")
            rowwise = True
        shapes.append(shape)
    return shapes, rowwise


def convert(onnx_path: Path, target_platform: str, shapes: list[list[int]],
            names: list[str]) -> Any:
    """An ``rknn.api.RKNN`` object with ``onnx_path`` converted (fp16, no quantisation)."""
    from rknn.api import RKNN

    rknn = RKNN(verbose=False)
    rknn.config(target_platform=target_platform)
    if rknn.load_onnx(model=str(onnx_path), inputs=names, input_size_list=shapes) != 0:
        rknn.release()
        raise ModelError(f"rknn-toolkit2 cannot load {onnx_path} (load_onnx failed; "
                         f"see the host's output in the daemon's debug log)")
    if rknn.build(do_quantization=False) != 0:
        rknn.release()
        raise ModelError(f"rknn-toolkit2 cannot convert {onnx_path} for {target_platform} "
                         f"(build failed: an operator or shape RKNN lacks)")
    return rknn


class RknnModel(LoadedModel):
    """One RKNN runtime (RKNNLite on a board, RKNN's simulator on x86) for one model."""

    def __init__(self, runtime: Any, path: Path, inputs: list[TensorSpec],
                 outputs: list[TensorSpec], rowwise: bool, device: str) -> None:
        self.device = device  # "npu core 0_1", "npu core auto", "rk3588 simulator"
        self._rt = runtime
        self._path = path
        self._rowwise = rowwise
        self._lock = threading.Lock()
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)

    def _once(self, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        # ONNX models take NCHW; RKNN assumes NHWC for 4-D inputs unless told (and
        # ignores the format of the others, but refuses a None in the list).
        result = self._rt.inference(inputs=arrays, data_format=["nchw"] * len(arrays))
        if result is None or len(result) != len(self.outputs):
            raise BackendError(f"RKNN inference of {self._path} failed (no outputs; see "
                               f"the host's output in the daemon's debug log)")
        return [np.asarray(r) for r in result]

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        arrays = [np.ascontiguousarray(inputs[s.name]) for s in self.inputs]
        with self._lock:
            if self._rt is None:
                raise BackendError(f"model {self._path} is unloaded")
            if self._rowwise:
                rows = arrays[0].shape[0]
                parts = [self._once([a[i:i + 1] for a in arrays]) for i in range(rows)]
                results = [np.concatenate([p[k] for p in parts]) if parts else
                           np.zeros((0,), np.float32) for k in range(len(self.outputs))]
            else:
                results = self._once(arrays)
        by_name = {s.name: r.astype(s.dtype, copy=False)
                   for s, r in zip(self.outputs, results)}
        return {n: by_name[n] for n in (outputs or list(by_name))}

    def unload(self) -> None:
        with self._lock:
            if self._rt is not None:
                self._rt.release()
                self._rt = None


class RknnBackend(Backend):
    """RKNNLite on an RK35xx board, or rknn-toolkit2's simulator elsewhere."""

    id = "rknn"
    kind = DeviceKind.NPU

    def __init__(self) -> None:
        self.mode, self._why = self._detect()
        self.version = self._version()

    @staticmethod
    def _detect() -> tuple[str | None, str]:
        machine = platform.machine()
        if machine in ("aarch64", "armv7l"):
            if not LIBRKNNRT.exists():  # before RKNNLite, whose import may need it
                return None, (f"{LIBRKNNRT} not found: the NPU runtime library comes with "
                              f"the board vendor's image (rknpu2)")
            try:
                importlib.import_module("rknnlite.api")
                return "board", ""
            except Exception as e:  # noqa: BLE001  an import error is the reason
                lite = (f"rknn-toolkit-lite2 does not import ({type(e).__name__}: {e}): "
                        f"it comes with the board vendor's image, or `pip install "
                        f"rknn-toolkit-lite2` for {sys.executable} (or set "
                        f"INFERD_RKNN_PYTHON to an interpreter that has it)")
        else:
            lite = f"rknn-toolkit-lite2 (RKNNLite) runs on aarch64 boards only, not {machine}"
        if importlib.util.find_spec("rknn") is not None:
            return "simulator", ""
        return None, (f"{lite}, and rknn-toolkit2 (the simulator) is not installed in "
                      f"{sys.executable}")

    def _version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        dist = {"board": "rknn-toolkit-lite2", "simulator": "rknn-toolkit2"}.get(self.mode or "")
        try:
            v = version(dist) if dist else "unavailable"
        except PackageNotFoundError:
            v = "unknown"
        return f"{v} (simulator)" if self.mode == "simulator" else v

    def probe(self) -> Probe:
        if self.mode is None:
            return Probe(False, self._why)
        if self.mode == "board":
            soc = board_soc()
            if soc is None:
                return Probe(False, "no Rockchip RK35xx NPU in /proc/device-tree/compatible")
            return Probe(True, devices=tuple(f"npu core {i}" for i in range(NPU_CORES[soc])))
        # Found, not imported: importing rknn-toolkit2 (torch) takes 3-10 s, more than a
        # plugin's probe may (the loader's probe_timeout_s); a broken one fails the load.
        missing = [m for m in ("rknn.api", "torch", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return Probe(False, f"rknn-toolkit2's simulator lacks {', '.join(missing)} in "
                                f"{sys.executable}")
        return Probe(True, devices=("rk3588 simulator",))

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.suffix not in (".onnx", ".rknn"):
            return False, f"{model_path.name} is neither an .onnx nor an .rknn file"
        if self.mode == "board" and model_path.suffix == ".onnx" \
                and not (model_path.parent / RKNN_FILE).exists():
            return False, (f"no {RKNN_FILE} beside {model_path.name}: convert it with "
                           f"`inferd-convert rknn {model_path.parent}`")
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        if self.mode is None:
            raise BackendError(self._why)
        target, mask, given = check_options(model_path, options.options)
        rknn_file = model_path if model_path.suffix == ".rknn" \
            else model_path.parent / RKNN_FILE
        if self.mode == "simulator":
            if rknn_file.exists():
                raise ModelError(f"{rknn_file}: a .rknn file cannot run in the simulator "
                                 f"(rknn-toolkit2 on {platform.machine()} simulates models "
                                 f"it converts from ONNX; run it on the board, or remove it "
                                 f"to simulate {model_path.name})")
            inputs, outputs = onnx_specs(model_path, "rknn")
            shapes, rowwise = fixed_shapes(model_path, inputs, given)
            rknn = convert(model_path, target, shapes, [s.name for s in inputs])
            if rknn.init_runtime() != 0:
                rknn.release()
                raise BackendError(f"rknn-toolkit2's simulator cannot start {model_path}")
        else:
            if not rknn_file.exists():
                raise ModelError(f"{rknn_file} not found: convert {model_path} with "
                                 f"`inferd-convert rknn {model_path.parent}`")
            inputs, outputs, rowwise = self._rknn_specs(rknn_file, model_path)
            shapes = [[1 if d is None else int(d) for d in s.shape] for s in inputs]
            from rknnlite.api import RKNNLite

            rknn = RKNNLite(verbose=False)
            if rknn.load_rknn(str(rknn_file)) != 0:
                rknn.release()
                raise ModelError(f"RKNNLite cannot load {rknn_file}")
            if rknn.init_runtime(core_mask=mask) != 0:
                rknn.release()
                raise BackendError(f"RKNNLite cannot start {rknn_file} on NPU core mask "
                                   f"{mask} (is {rknn_file} built for {board_soc()}?)")
        specs = [TensorSpec(s.name, s.dtype, (None, *shape[1:]) if rowwise else tuple(shape))
                 for s, shape in zip(inputs, shapes)]
        if self.mode == "board":
            device = f"npu core {next(k for k, v in CORE_MASKS.items() if v == mask)}"
        else:
            device = f"{target} simulator"
        return RknnModel(rknn, rknn_file if self.mode == "board" else model_path,
                         specs, outputs, rowwise, device)

    @staticmethod
    def _rknn_specs(rknn_file: Path, onnx_path: Path
                    ) -> tuple[list[TensorSpec], list[TensorSpec], bool]:
        sidecar = rknn_file.with_name(rknn_file.name + SPECS_SUFFIX)
        try:
            raw = json.loads(sidecar.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{sidecar} is missing or unreadable ({e}): it is written by "
                             f"`inferd-convert rknn` beside {rknn_file.name}") from e

        def specs(key: str) -> list[TensorSpec]:
            return [TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in raw[key]]
        return specs("inputs"), specs("outputs"), bool(raw.get("rowwise"))


def create_backend() -> Backend:
    return RknnBackend()
