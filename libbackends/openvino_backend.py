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
streams come from the config's ``[openvino]`` section, per model from model.toml.
"""

from __future__ import annotations

import queue
import re
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc.errors import BackendError, ErrorCode, ModelError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)

MIN_VERSION = (2024, 0)
"""The oldest OpenVINO this backend is written for (the 2.0 API, IR v10/v11)."""

IR_VERSIONS = (10, 11)
"""The IR versions OpenVINO 2024-2026 reads (``<net version="N">``)."""

DEVICE_OF_KIND = {DeviceKind.CPU: "CPU", DeviceKind.GPU: "GPU", DeviceKind.NPU: "NPU"}
PRECISIONS = {"f32": "f32", "f16": "f16", "bf16": "bf16"}
OPTION_KEYS = ("device", "precision", "threads", "streams")

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


class OvModel(LoadedModel):
    """A compiled OpenVINO model; each concurrent run takes its own infer request."""

    def __init__(self, compiled: Any, path: Path, device: str) -> None:
        self._compiled = compiled
        self._path = path
        self.device = device
        self.inputs = tuple(_spec(p, str(path)) for p in compiled.inputs)
        self.outputs = tuple(_spec(p, str(path)) for p in compiled.outputs)
        self._ports = {s.name: p for s, p in zip(self.outputs, compiled.outputs)}
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        names = outputs or list(self._ports)
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            request = self._compiled.create_infer_request()
        try:
            request.infer(inputs)
            # copies: the request's output tensors are overwritten by its next run
            result = {n: np.array(request.get_tensor(self._ports[n]).data) for n in names}
        except Exception as e:  # OpenVINO raises RuntimeError and its own classes
            raise ModelError(f"openvino failed to run {self._path}: {_reason(e)}") from e
        self._requests.put(request)
        return result

    def unload(self) -> None:
        self._compiled = None
        self._requests = queue.SimpleQueue()


class OpenVinoBackend(Backend):
    """OpenVINO on the CPU, GPU and NPU devices it finds."""

    id = "openvino"
    kind = DeviceKind.CPU

    def __init__(self) -> None:
        import openvino

        self._ov = openvino
        self.version = openvino.__version__.split("-", 1)[0]
        self._core: Any = None

    def _get_core(self) -> Any:
        if self._core is None:
            self._core = self._ov.Core()
        return self._core

    def probe(self) -> Probe:
        if parse_version(self.version) < MIN_VERSION:
            return Probe(False, f"openvino {self.version} is older than "
                                f"{'.'.join(map(str, MIN_VERSION))}, which this backend needs")
        try:
            devices = tuple(self._get_core().available_devices)
        except Exception as e:  # noqa: BLE001  probe() must say why, never raise
            return Probe(False, f"openvino cannot list its devices: {_reason(e)}")
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
            config["INFERENCE_NUM_THREADS"] = settings.get("threads", 1)
            # OpenVINO pins its inference threads to cores by default: that fights the
            # model's cpu_affinity, and on a busy device a pinned thread waits for its
            # one core (ocr-cls 27 ms instead of 1.4 ms, measured on 2 busy vCPUs).
            config["ENABLE_CPU_PINNING"] = False
        config["NUM_STREAMS"] = settings.get("streams", 1)
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
        return OvModel(compiled, source, executed)

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
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ModelError(f"{where}: expected an integer >= 1", ErrorCode.INTERNAL)
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
