"""The OpenVINO backend (id ``openvino``): Intel CPUs, integrated GPUs and NPUs.

It reads a version folder's ``model.onnx`` directly, or the OpenVINO IR
(``model.xml`` + ``model.bin``) when the folder holds one. The device comes from the
model's placement (``cpu`` -> ``CPU``, ``gpu`` -> ``GPU``, ``npu`` -> ``NPU``) or exactly
from model.toml (``[openvino] device = "GPU.1"``). The probe lists OpenVINO's
``available_devices`` and registers only the kinds it really sees; a load on a device
that is absent fails with OpenVINO's own reason, and the daemon falls back along the
model's preference list.

Results are f32 by default: OpenVINO's CPU plugin otherwise picks bf16 on CPUs that
have it, which changes the results (``[openvino] precision`` overrides). Threads and
streams come from the config's ``[openvino]`` section, per model from model.toml; the
placement's thread count (``LoadOptions.threads``), when it chose one, wins.

The probe lists the devices in a short-lived child process: listing them loads every
device plugin (the GPU plugin brings OpenCL and its ICD, e.g. pocl with LLVM: 96 MiB
measured here), which would otherwise stay in the daemon for good. The daemon itself
loads only the plugins of the devices its models are placed on.

A model whose inputs have free dimensions is compiled once for them (dynamic shapes);
with ``[openvino] static_shapes = N`` the first N distinct input shapes it runs get a
copy compiled for exactly that shape (OpenVINO's static shapes run faster and plan
their memory ahead: on this machine ocr-cls batch 1 0.60 instead of 0.75 ms, ocr-det
on 736x2048 256 instead of 319 MiB). Each copy is compiled by the run that first
brings its shape (150-300 ms on the demo models) and kept while the model is loaded;
other shapes run on the dynamic compile.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import queue
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import BackendError, ErrorCode, ModelError
from inferd.libbackends.childprobe import EngineImportError, engine_facts
from inferd.libbackends.contract import (
    BatchSizes, Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)

MIN_VERSION = (2024, 0)
"""The oldest OpenVINO this backend is written for (the 2.0 API, IR v10/v11)."""

IR_VERSIONS = (10, 11)
"""The IR versions OpenVINO 2024-2026 reads (``<net version="N">``)."""

DEVICE_OF_KIND = {DeviceKind.CPU: "CPU", DeviceKind.GPU: "GPU", DeviceKind.NPU: "NPU"}
PRECISIONS = {"f32": "f32", "f16": "f16", "bf16": "bf16"}
OPTION_KEYS = ("device", "precision", "threads", "streams", "static_shapes")
PROBE_TIMEOUT_S = 60.0
"""How long the child process that lists OpenVINO's devices may take."""

log = logging.getLogger(__name__)

# OpenVINO element type names -> wire dtype names
_OV_TYPES = {
    "f32": "float32", "f64": "float64", "f16": "float16", "i8": "int8", "u8": "uint8",
    "i16": "int16", "u16": "uint16", "i32": "int32", "u32": "uint32", "i64": "int64",
    "u64": "uint64", "boolean": "bool",
}


def kind_of(device: str) -> DeviceKind | None:
    """The kind of an OpenVINO device name (``GPU.1`` -> gpu), None for others."""
    base = device.split(".", 1)[0].upper()
    return next((k for k, name in DEVICE_OF_KIND.items() if name == base), None)


def parse_version(text: str) -> tuple[int, int]:
    """(year, release) of an OpenVINO version string such as ``2026.4.1-22982-...``."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _reason(e: Exception) -> str:
    """OpenVINO's message without its source-file trace lines."""
    text = re.sub(r"(Exception from|Check '.*?' failed at) src/\S+:\d+:\s*", "", str(e))
    return " ".join(ln.strip() for ln in text.splitlines() if ln.strip()) or type(e).__name__


def _spec(port: Any, model: str) -> TensorSpec:
    etype = port.get_element_type().get_type_name()
    dtype = _OV_TYPES.get(etype)
    if dtype is None:
        raise ModelError(f"model {model}: tensor {port.get_any_name()!r} has type {etype}, "
                         f"which inferd cannot carry")
    shape = tuple(d.get_length() if d.is_static else None for d in port.get_partial_shape())
    return TensorSpec(port.get_any_name(), dtype, shape)


def ir_info(xml: Path) -> tuple[int | None, str | None]:
    """The IR version of ``model.xml`` and the OpenVINO version that wrote it (its
    ``rt_info``), as far as they can be read without parsing the whole file."""
    with open(xml, "rb") as f:
        head = f.read(4096).decode("utf-8", "replace")
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 8192))
        tail = f.read().decode("utf-8", "replace")
    m = re.search(r"<net\b[^>]*\bversion=\"(\d+)\"", head)
    w = re.search(r"<info name=\"OpenVINO Runtime\" value=\"([^\"]+)\"", tail)
    return (int(m.group(1)) if m else None), (w.group(1) if w else None)


class _Compiled:
    """One compiled model and its pool of infer requests (one per concurrent run)."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.ports = {p.get_any_name(): p for p in compiled.outputs}
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run(self, inputs: dict[str, NDArray[Any]], names: list[str]) -> dict[str, NDArray[Any]]:
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            request = self.compiled.create_infer_request()
        # inputs copied into the request's tensors: sharing them (share_inputs) is no
        # faster on a static compile and slower on a dynamic one (1.0 instead of 0.8 ms
        # on ocr-cls: each new buffer re-plans the input)
        request.infer(inputs)
        # copies: the request's output tensors are overwritten by its next run
        result = {n: np.array(request.get_tensor(self.ports[n]).data) for n in names}
        self._requests.put(request)
        return result


ShapeKey = tuple[tuple[str, tuple[int, ...]], ...]


class OvModel(LoadedModel):
    """A compiled OpenVINO model; each concurrent run takes its own infer request.

    Args:
        compiled: the model compiled for its own (possibly dynamic) input shapes.
        path: the file it was read from (for messages).
        device: where it runs, as shown to users.
        static_shapes: how many distinct input shapes get a compile of their own (0:
            none; only a model with free input dimensions uses it).
        compile_for: compiles the model for the input shapes given (static copies).
    """

    def __init__(self, compiled: Any, path: Path, device: str, static_shapes: int = 0,
                 compile_for: Any = None) -> None:
        self._path = path
        self.device = device
        self.inputs = tuple(_spec(p, str(path)) for p in compiled.inputs)
        self.outputs = tuple(_spec(p, str(path)) for p in compiled.outputs)
        self._names = [s.name for s in self.outputs]
        self._dynamic = _Compiled(compiled)
        free = any(d is None for s in self.inputs for d in s.shape)
        self._static_limit = static_shapes if free and compile_for is not None else 0
        self._compile_for = compile_for
        self._static: dict[ShapeKey, _Compiled] = {}
        self._static_lock = threading.Lock()

    @property
    def compiled(self) -> Any:
        """The compile for the model's own input shapes."""
        return self._dynamic.compiled

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        names = outputs or self._names
        compiled = self._for_shapes(inputs) if self._static_limit else self._dynamic
        try:
            return compiled.run(inputs, names)
        except Exception as e:  # OpenVINO raises RuntimeError and its own classes
            raise ModelError(f"openvino failed to run {self._path}: {_reason(e)}",
                             ErrorCode.INTERNAL) from e

    def _for_shapes(self, inputs: dict[str, NDArray[Any]]) -> _Compiled:
        """The static compile for these input shapes, compiled now if there is room for
        one more; else the dynamic compile."""
        key = tuple(sorted((n, tuple(int(d) for d in a.shape)) for n, a in inputs.items()))
        found = self._static.get(key)
        if found is not None:
            return found
        if len(self._static) >= self._static_limit:
            return self._dynamic
        with self._static_lock:  # one compile at a time; another thread may have done it
            found = self._static.get(key)
            if found is None and len(self._static) < self._static_limit:
                try:
                    found = _Compiled(self._compile_for(dict(key)))
                    log.info("openvino: %s compiled for the static input shapes %s",
                             self._path, _shapes_text(key))
                except Exception as e:  # noqa: BLE001  the dynamic compile still serves
                    found = self._dynamic
                    log.warning("openvino: %s cannot be compiled for the static input "
                                "shapes %s (%s); they run on the dynamic compile",
                                self._path, _shapes_text(key), _reason(e))
                self._static[key] = found
        return found or self._dynamic

    def batch_sizes(self) -> BatchSizes | None:
        """The batch sizes of its static compiles, and how many more it may compile; on
        the dynamic compile alone every change of size re-plans (~2 ms a switch)."""
        if not any(s.shape and not isinstance(s.shape[0], int) for s in self.inputs):
            return None  # a fixed batch dimension: nothing to choose
        if not self._static_limit:
            return BatchSizes()
        free = frozenset(k[0][1][0] for k, c in list(self._static.items())
                         if c is not self._dynamic and k and k[0][1])
        return BatchSizes(free, max(0, self._static_limit - len(self._static)))

    def describe(self) -> dict[str, Any]:
        if not self._static_limit:
            return {}
        return {"static_shapes": [_shapes_text(k) for k, c in list(self._static.items())
                                  if c is not self._dynamic],
                "static_shapes_limit": self._static_limit}

    def unload(self) -> None:
        self._dynamic = None  # type: ignore[assignment]
        self._static = {}
        self._compile_for = None


def _shapes_text(key: ShapeKey) -> str:
    return ", ".join(f"{n}={'x'.join(map(str, shape)) or 'scalar'}" for n, shape in key)


def _release(version: str) -> str:
    return version.split("-", 1)[0]


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""  # vendored without metadata: the probe's child says


DEVICE_FACTS = ("print(json.dumps({'version': openvino.__version__, "
                "'devices': list(openvino.Core().available_devices)}))")


def list_devices(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str, list[str]]:
    """OpenVINO's version and ``available_devices``, from a child process (see the
    module's docstring) that finds the same ``openvino`` as this process would (the
    Debian add-on's is vendored: not on a child's default path). Raises RuntimeError
    with the child's reason."""
    facts = engine_facts("openvino", DEVICE_FACTS, timeout_s)
    if not isinstance(facts, dict) or not isinstance(facts.get("devices"), list):
        raise RuntimeError(f"the process listing them printed {str(facts)[:200]!r}")
    return str(facts["version"]), [str(d) for d in facts["devices"]]


class OpenVinoBackend(Backend):
    """OpenVINO on the CPU, GPU and NPU devices it finds."""

    id = "openvino"
    kind = DeviceKind.CPU

    def __init__(self) -> None:
        # openvino is imported when the first model loads on it (18 MiB); the probe asks
        # a child process (its GPU plugin, OpenCL and pocl stay out of the daemon too)
        if importlib.util.find_spec("openvino") is None:
            raise ImportError("python module openvino is not installed")
        self.version = _release(_installed_version("openvino"))
        self._core: Any = None

    def _get_core(self) -> Any:
        if self._core is None:
            import openvino

            self._core = openvino.Core()
        return self._core

    def import_engine(self) -> None:
        """Import openvino and make its Core now (the loader measures what they add,
        once)."""
        self._get_core()

    def probe(self) -> Probe:
        try:
            version, found = list_devices()
        except EngineImportError:
            raise  # the loader reports it at the stage 'opened'
        except Exception as e:  # noqa: BLE001  probe() must say why, never raise
            return Probe(False, f"openvino cannot list its devices: {_reason(e)}")
        self.version = _release(version)
        if parse_version(self.version) < MIN_VERSION:
            return Probe(False, f"openvino {self.version} is older than "
                                f"{'.'.join(map(str, MIN_VERSION))}, which this backend needs")
        devices = tuple(found)
        kinds = tuple(k for k in (DeviceKind.CPU, DeviceKind.GPU, DeviceKind.NPU)
                      if any(kind_of(d) is k for d in devices))
        if not kinds:
            return Probe(False, f"openvino found no CPU, GPU or NPU device "
                                f"(available_devices = {list(devices)})")
        return Probe(True, devices=devices, kinds=kinds)

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.suffix == ".rknn":
            return False, (f"{model_path.name} is compiled for a Rockchip NPU (backend "
                           f"rknn); openvino reads .onnx or IR (.xml + .bin)")
        if model_path.suffix not in (".onnx", ".xml"):
            return False, f"{model_path.name} is neither .onnx nor OpenVINO IR (.xml)"
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        ok, why = self.supports(model_path)
        if not ok:
            raise ModelError(f"openvino cannot load {model_path}: {why}",
                             ErrorCode.UNSUPPORTED)
        settings = self._settings(options)
        source = self._source(model_path)
        core = self._get_core()
        kind = options.kind or self.kind
        device = settings.get("device") or DEVICE_OF_KIND[kind]
        try:
            model = core.read_model(str(source))
        except Exception as e:
            raise ModelError(f"openvino cannot read {source}: {_reason(e)}"
                             f"{self._written_by(source)}") from e
        config: dict[str, Any] = {}
        dev_kind = kind_of(device)
        if dev_kind in (DeviceKind.CPU, DeviceKind.GPU) or "precision" in settings:
            config["INFERENCE_PRECISION_HINT"] = settings.get("precision", "f32")
        if dev_kind is DeviceKind.CPU:
            config["INFERENCE_NUM_THREADS"] = options.threads or settings.get("threads", 1)
            # OpenVINO pins its inference threads to cores by default: that fights the
            # model's cpu_affinity, and on a busy device a pinned thread waits for its
            # one core (ocr-cls 27 ms instead of 1.4 ms, measured on 2 busy vCPUs).
            config["ENABLE_CPU_PINNING"] = False
        config["NUM_STREAMS"] = settings.get("streams", 1)
        static = settings.get("static_shapes", 0)
        try:
            compiled = core.compile_model(model, device, config)
        except Exception as e:
            available = ", ".join(core.available_devices) or "none"
            absent = device.split(".", 1)[0] not in {d.split(".", 1)[0] for d in
                                                    core.available_devices} \
                or (("." in device) and device not in core.available_devices)
            if absent:
                raise BackendError(f"openvino cannot compile {source} for device {device}: "
                                   f"{_reason(e)} (available devices: {available})",
                                   ErrorCode.UNAVAILABLE) from e
            raise ModelError(f"openvino cannot compile {source} for device {device}: "
                             f"{_reason(e)}") from e
        try:
            executed = ",".join(compiled.get_property("EXECUTION_DEVICES")) or device
        except Exception:  # noqa: BLE001  only a label; the device asked for will do
            executed = device
        compile_for = None
        if static:
            def compile_for(shapes: dict[str, tuple[int, ...]]) -> Any:
                copy = model.clone()
                copy.reshape({name: list(dims) for name, dims in shapes.items()})
                return core.compile_model(copy, device, config)
        return OvModel(compiled, source, executed, static, compile_for)

    # ----------------------------------------------------------------- helpers

    def _settings(self, options: LoadOptions) -> dict[str, Any]:
        """The ``[openvino]`` options, checked; raises ModelError naming the key."""
        out: dict[str, Any] = {}
        for key, value in options.options.items():
            where = f"model.toml [openvino] {key} = {value!r}"
            if key not in OPTION_KEYS:
                raise ModelError(f"model.toml [openvino] {key}: unknown key; known keys: "
                                 f"{', '.join(OPTION_KEYS)}", ErrorCode.INTERNAL)
            if key == "device":
                if not isinstance(value, str) or kind_of(value) is None:
                    raise ModelError(f"{where}: expected an OpenVINO device name such as "
                                     f"'CPU', 'GPU', 'GPU.1' or 'NPU'", ErrorCode.INTERNAL)
                out[key] = value.upper()
            elif key == "precision":
                if value not in PRECISIONS:
                    raise ModelError(f"{where}: expected one of {', '.join(PRECISIONS)}",
                                     ErrorCode.INTERNAL)
                out[key] = PRECISIONS[value]
            else:
                least = 0 if key == "static_shapes" else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ModelError(f"{where}: expected an integer >= {least}",
                                     ErrorCode.INTERNAL)
                out[key] = value
        return out

    @staticmethod
    def _source(model_path: Path) -> Path:
        """The file to read: the IR beside ``model.onnx`` if the folder holds one;
        checks that an IR's weights file is there and its version is one this OpenVINO
        reads."""
        xml = model_path if model_path.suffix == ".xml" else model_path.with_name("model.xml")
        if not xml.exists():
            return model_path
        weights = xml.with_suffix(".bin")
        if not weights.is_file():
            raise ModelError(f"openvino cannot load {xml}: its weights file {weights.name} "
                             f"is missing (an IR is model.xml + model.bin side by side)",
                             ErrorCode.NOT_FOUND)
        try:
            version, writer = ir_info(xml)
        except OSError as e:
            raise ModelError(f"openvino cannot read {xml}: {e.strerror}") from e
        if version is not None and version not in IR_VERSIONS:
            import openvino

            by = f", written by OpenVINO {writer}" if writer else ""
            raise ModelError(f"openvino cannot load {xml}: it is IR version {version}{by}; "
                             f"this OpenVINO {openvino.__version__.split('-', 1)[0]} reads "
                             f"IR versions {' and '.join(map(str, IR_VERSIONS))} (re-export "
                             f"it with this version, or give model.onnx instead)",
                             ErrorCode.UNSUPPORTED)
        return xml

    def _written_by(self, source: Path) -> str:
        """A note when an IR was written by another OpenVINO than this one."""
        if source.suffix != ".xml":
            return ""
        try:
            _, writer = ir_info(source)
        except OSError:
            return ""
        if writer and parse_version(writer) != parse_version(self.version):
            return (f" (the IR was written by OpenVINO {writer.split('-', 1)[0]}, this is "
                    f"{self.version}: re-export it with this version)")
        return ""


def create_backend() -> Backend:
    """The factory the plugin loader calls."""
    return OpenVinoBackend()
