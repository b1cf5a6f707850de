"""The ncnn backend (id ``ncnn``): Tencent's ncnn on the CPU and, through Vulkan, on the
GPUs edge boards carry (Arm Mali, Qualcomm Adreno, Broadcom V3D, Jetson).

**Devices.** The probe lists the Vulkan devices in a short-lived child process (creating
the Vulkan instance loads the loader and every driver, 59 MiB with Mesa's lavapipe,
which a daemon serving only CPU models should not keep; a driver that crashes there
fails the listing, not the daemon). A software Vulkan device (lavapipe, Vulkan device
type CPU) is not an accelerator: it counts for gpu placement only when the config file
says ``[ncnn] allow_software_vulkan = true`` (CI and the tests do); ``inferctl
backends`` lists each device with its type. A model placed on gpu runs on a Vulkan
device or its load fails with the reason, and the daemon falls back along the model's
preference list: never a silent run on the CPU.

**Models.** A version folder may hold ``model.ncnn.param`` + ``model.ncnn.bin`` (+
``model.ncnn.json``, the ONNX tensors they stand for), written by ``inferd-convert
ncnn``; otherwise ``model.onnx`` is converted with pnnx at first load and cached under
the state directory (:mod:`inferd.libbackends.ncnn_convert`). The loaded model presents
the ONNX model's input and output names, dtypes and shapes (ncnn's blobs are ``in0``...
``out0``...), batch axis included: ncnn's ``Mat`` has none, so a batch runs one row at
a time, each row in its own extractor.

**Options** (inferd.toml ``[ncnn]``, per model over it in model.toml ``[ncnn]``):
``precision`` (``"fp32"``, the default, within 1e-5 of onnxruntime; ``"fp16"``, ncnn's
own default, where Mali and Adreno gain: storage and arithmetic in half precision),
``threads`` (ncnn's CPU threads for one run; default 1), ``device`` (``"auto"``: the
first hardware Vulkan device, discrete before integrated before virtual; or a Vulkan
device index), ``input_shapes`` (the shapes pnnx traces at), ``cache_dir`` (the
conversion cache; default ``<state directory>/ncnn``), ``allow_software_vulkan``, and
on the CPU what a run's memory costs: ``memory_pool`` (``"net"``, ncnn's own: the net
keeps every buffer of its runs in a pool until it is unloaded, so its largest run's
working memory stays resident; ``"run"``: each row's buffers come from a pool of its
own, returned to malloc when the row ends) and ``winograd`` / ``sgemm`` (ncnn's faster
convolutions, which need workspace; ``false``: the direct convolution).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from inferd.ipc import defs
from inferd.ipc.errors import BackendError, ErrorCode, ModelError
from inferd.libbackends.childprobe import child_json
from inferd.libbackends.contract import (
    Backend, DeviceKind, Dim, LoadedModel, LoadOptions, Probe,
)
from inferd.libbackends.ncnn_convert import (
    BIN, PARAM, SIDECAR, Converted, convert_cached, pnnx_binary, read_sidecar, trace_shapes,
)

log = logging.getLogger(__name__)

OPTION_KEYS = ("precision", "threads", "device", "input_shapes", "cache_dir",
               "allow_software_vulkan", "memory_pool", "winograd", "sgemm")
PRECISIONS = ("fp32", "fp16")
MEMORY_POOLS = ("net", "run")
RUN_POOL_FIT = 0.75
"""``memory_pool = "run"``: a buffer is reused for a request at least this share of its
size (ncnn's ``size_compare_ratio``; the net's own pool takes any larger buffer, so a
small request can hold a large one while a large request allocates anew)."""
PROBE_TIMEOUT_S = 60.0
"""How long the child process that lists the Vulkan devices may take."""
PARAM_MAGIC = "7767517"
"""The first line of every ncnn ``.param`` file."""
DEVICE_TYPES = {0: "discrete", 1: "integrated", 2: "virtual", 3: "cpu"}
"""ncnn's ``GpuInfo.type()`` -> the Vulkan device type it stands for."""
PREFERENCE = ("discrete", "integrated", "virtual")
_LIST_CODE = ("import json, ncnn\n"
              "n = ncnn.get_gpu_count()\n"
              "print(json.dumps([[i, ncnn.get_gpu_info(i).device_name(), "
              "ncnn.get_gpu_info(i).type()] for i in range(n)]))")


@dataclass(frozen=True)
class VulkanDevice:
    """One Vulkan physical device, as ncnn numbers it."""

    index: int
    name: str
    type: str  # discrete, integrated, virtual, cpu

    @property
    def software(self) -> bool:
        """A device of Vulkan type CPU (lavapipe, SwiftShader): no accelerator."""
        return self.type == "cpu"

    def label(self) -> str:
        kind = "software, Vulkan type cpu" if self.software else f"{self.type} gpu"
        return f"vulkan:{self.index} {self.name} ({kind})"


def _devices(raw: Any) -> list[VulkanDevice]:
    return [VulkanDevice(int(i), str(name), DEVICE_TYPES.get(int(t), "other"))
            for i, name, t in raw]


def list_vulkan_devices(module_file: str, timeout_s: float = PROBE_TIMEOUT_S
                        ) -> list[VulkanDevice]:
    """The Vulkan devices ncnn sees, listed by a child process that imports the same
    ncnn as this process. Raises RuntimeError with the child's reason."""
    return _devices(child_json(_LIST_CODE, module_file, timeout_s))


def no_vulkan_reason() -> str:
    """Why the Vulkan loader may find no device here (for the probe's note)."""
    import ctypes

    try:
        ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return "the Vulkan loader libvulkan.so.1 is missing (Debian: libvulkan1)"
    icd = os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    if icd:
        return f"no Vulkan driver answered (VK_ICD_FILENAMES={icd})"
    return ("no Vulkan driver answered (none installed? Debian: mesa-vulkan-drivers, or "
            "the board vendor's driver)")


def _fit(row: NDArray[Any], want: tuple[Dim, ...], name: str) -> NDArray[Any]:
    """One row of an ncnn output in the ONNX output's shape (without the batch axis):
    ncnn's ``Mat`` drops axes of size 1 that ONNX keeps."""
    if row.ndim == len(want) and all(not isinstance(d, int) or d == g
                                     for d, g in zip(want, row.shape)):
        return row
    free = [i for i, d in enumerate(want) if not isinstance(d, int)]
    if len(free) <= 1:
        return row.reshape([d if isinstance(d, int) else -1 for d in want])
    dims = list(row.shape)
    for i, d in enumerate(want):  # put back the fixed axes of size 1 ncnn left out
        if len(dims) < len(want) and d == 1 and (i >= len(dims) or dims[i] != 1):
            dims.insert(i, 1)
    if len(dims) != len(want):
        raise BackendError(f"ncnn gave output {name!r} a row of shape {list(row.shape)}, "
                           f"which does not fit the ONNX model's {list(want)}")
    return row.reshape(dims)


class NcnnModel(LoadedModel):
    """One ``ncnn.Net``; every row of every run takes its own extractor (ncnn lets
    several extractors of one net run at once)."""

    def __init__(self, ncnn: Any, net: Any, converted: Converted, device: str,
                 run_pool: bool = False) -> None:
        self._ncnn = ncnn
        self._net = net
        self._run_pool = run_pool
        self._path = converted.param
        self.device = device
        self.inputs = converted.inputs
        self.outputs = converted.outputs
        self._in_blobs = [(f"in{i}", s.name) for i, s in enumerate(self.inputs)]
        self._out_blobs = {s.name: (f"out{i}", s.shape[1:])
                           for i, s in enumerate(self.outputs)}

    def run(self, inputs: dict[str, NDArray[Any]],
            outputs: list[str] | None = None) -> dict[str, NDArray[Any]]:
        net = self._net
        if net is None:
            raise BackendError(f"ncnn model {self._path} is unloaded")
        names = outputs or list(self._out_blobs)
        rows = {int(inputs[name].shape[0]) for _, name in self._in_blobs}
        if len(rows) != 1:
            raise ModelError(f"model {self._path}: the inputs' first axes (the batch) "
                             f"differ: {sorted(rows)}")
        results: dict[str, list[NDArray[Any]]] = {n: [] for n in names}
        for r in range(rows.pop()):
            ex = net.create_extractor()
            pools = self._row_pools(ex)
            try:
                for blob, name in self._in_blobs:
                    # a Mat made from an array points into it without holding it, and
                    # ncnn's in-place layers write there (a wire frame is read-only; a
                    # temporary copy may be freed before the run): each row is copied
                    # into a Mat of ncnn's own while the array it points into is held
                    row = np.ascontiguousarray(inputs[name][r], dtype=np.float32)
                    ex.input(blob, self._ncnn.Mat(row).clone())
                for name in names:
                    blob, want = self._out_blobs[name]
                    code, mat = ex.extract(blob)
                    if code != 0:
                        raise BackendError(f"ncnn failed to run {self._path}: extracting "
                                           f"{blob} ({name!r}) returned {code}")
                    results[name].append(_fit(np.array(mat), want, name))
                    del mat  # a copy: nothing of the row's pools outlives the row
            finally:
                ex.clear()  # the row's blobs go back to its pools, which free them
                for pool in pools:
                    pool.clear()
        return {n: np.stack(rows_) if rows_ else
                np.zeros((0, *[d if isinstance(d, int) else 0 for d in
                               self._out_blobs[n][1]]), np.float32)
                for n, rows_ in results.items()}

    def _row_pools(self, ex: Any) -> tuple[Any, ...]:
        """``memory_pool = "run"``: a blob and a workspace pool of the row's own, set on
        its extractor (the caller holds them until the extractor is gone; ``extract``
        returns a copy made outside them)."""
        if not self._run_pool:
            return ()
        blobs, work = self._ncnn.PoolAllocator(), self._ncnn.PoolAllocator()
        for pool in (blobs, work):
            pool.set_size_compare_ratio(RUN_POOL_FIT)
        ex.set_blob_allocator(blobs)
        ex.set_workspace_allocator(work)
        return blobs, work

    def unload(self) -> None:
        net, self._net = self._net, None
        if net is not None:
            net.clear()


class NcnnBackend(Backend):
    """ncnn on the CPU, and on the Vulkan devices it finds."""

    id = "ncnn"
    kind = DeviceKind.CPU

    def __init__(self) -> None:
        import ncnn

        self._ncnn = ncnn
        self.version = str(ncnn.__version__)
        self._allow_software = False
        self._gpu_lock = threading.Lock()
        self._gpus: list[VulkanDevice] | None = None  # as this process sees them

    def configure(self, settings: dict[str, Any]) -> None:
        """The config file's ``[ncnn]`` section, before :meth:`probe`: whether a
        software Vulkan device counts for gpu placement."""
        self._allow_software = settings.get("allow_software_vulkan") is True

    def probe(self) -> Probe:
        try:
            found = list_vulkan_devices(self._ncnn.__file__)
        except RuntimeError as e:
            return Probe(True, f"gpu placement off: the Vulkan devices cannot be listed "
                               f"({e})", ("cpu",), (DeviceKind.CPU,))
        notes = [] if found else [f"gpu placement off: {no_vulkan_reason()}"]
        for d in found:
            if d.software:
                notes.append(f"vulkan:{d.index} is a software Vulkan device, "
                             + ("used for gpu placement ([ncnn] allow_software_vulkan = "
                                "true)" if self._allow_software else
                                "not an accelerator: not used for gpu placement unless "
                                "[ncnn] allow_software_vulkan = true"))
        usable = [d for d in found if self._allow_software or not d.software]
        kinds = (DeviceKind.CPU, DeviceKind.GPU) if usable else (DeviceKind.CPU,)
        return Probe(True, "; ".join(notes), ("cpu", *(d.label() for d in found)), kinds)

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.name == PARAM:
            return True, ""
        if model_path.suffix != ".onnx":
            return False, f"{model_path.name} is neither .onnx nor {PARAM}"
        if not (model_path.parent / PARAM).is_file() and pnnx_binary() is None:
            return False, (f"no {PARAM} beside {model_path.name} and no pnnx to convert it "
                           f"(`inferd-convert ncnn {model_path.parent}` on a machine with "
                           f"pnnx)")
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        ok, why = self.supports(model_path)
        if not ok:
            raise ModelError(f"ncnn cannot load {model_path}: {why}", ErrorCode.UNSUPPORTED)
        settings = self._settings(options)
        gpu = (options.kind or self.kind) is DeviceKind.GPU
        device = self._vulkan_device(settings) if gpu else None
        converted, scratch = self._converted(model_path, settings)
        try:
            net = self._net(converted, settings, device)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        where = device.label() if device else "cpu"
        log.info("ncnn: %s loaded on %s (%s, %d thread(s))", converted.param, where,
                 settings["precision"], settings["threads"])
        return NcnnModel(self._ncnn, net, converted, where,
                         run_pool=device is None and settings["memory_pool"] == "run")

    # ----------------------------------------------------------------- helpers

    def _settings(self, options: LoadOptions) -> dict[str, Any]:
        """The ``[ncnn]`` options with their defaults, checked; raises ModelError naming
        the key."""
        out: dict[str, Any] = {"precision": "fp32", "threads": 1, "device": "auto",
                               "input_shapes": {}, "cache_dir": "",
                               "allow_software_vulkan": self._allow_software,
                               "memory_pool": "net", "winograd": True, "sgemm": True}
        for key, value in options.options.items():
            where = f"model.toml [ncnn] {key} = {value!r}"
            if key not in OPTION_KEYS:
                raise ModelError(f"model.toml [ncnn] {key}: unknown key; known keys: "
                                 f"{', '.join(OPTION_KEYS)}", ErrorCode.INTERNAL)
            ok = {"precision": value in PRECISIONS,
                  "threads": isinstance(value, int) and not isinstance(value, bool)
                  and value >= 1,
                  "device": value == "auto" or (isinstance(value, int)
                                                and not isinstance(value, bool)
                                                and value >= 0),
                  "input_shapes": isinstance(value, dict),
                  "cache_dir": isinstance(value, str),
                  "allow_software_vulkan": isinstance(value, bool),
                  "memory_pool": value in MEMORY_POOLS,
                  "winograd": isinstance(value, bool), "sgemm": isinstance(value, bool)}[key]
            if not ok:
                expected = {"precision": "'fp32' or 'fp16'",
                            "threads": "an integer >= 1",
                            "device": "'auto' or a Vulkan device index (0, 1...)",
                            "input_shapes": "a table of input name = shape, e.g. "
                                            "{x = [[1, 3, 48, 320], [1, 3, 48, 640]]}",
                            "cache_dir": "a folder path",
                            "allow_software_vulkan": "true or false",
                            "memory_pool": "'net' or 'run'",
                            "winograd": "true or false", "sgemm": "true or false"}[key]
                raise ModelError(f"{where}: expected {expected}", ErrorCode.INTERNAL)
            out[key] = value
        if options.threads:  # the placement's choice (model.toml threads, or measured)
            out["threads"] = options.threads
        return out

    def _vulkan_device(self, settings: dict[str, Any]) -> VulkanDevice:
        """The Vulkan device a gpu load runs on, as this process sees them.

        Raises:
            BackendError (UNAVAILABLE): none, the one asked for is absent, or only a
                software device is there and it is not allowed.
        """
        with self._gpu_lock:
            if self._gpus is None:
                ncnn = self._ncnn
                self._gpus = _devices([i, ncnn.get_gpu_info(i).device_name(),
                                       ncnn.get_gpu_info(i).type()]
                                      for i in range(ncnn.get_gpu_count()))
            gpus = self._gpus
        if not gpus:
            raise BackendError(f"ncnn: no Vulkan device for gpu placement: "
                               f"{no_vulkan_reason()}", ErrorCode.UNAVAILABLE)
        wanted = settings["device"]
        if wanted == "auto":
            hardware = sorted((d for d in gpus if not d.software), key=lambda d:
                              PREFERENCE.index(d.type) if d.type in PREFERENCE else 9)
            software = [d for d in gpus if d.software and settings["allow_software_vulkan"]]
            device = next(iter(hardware + software), None)
            if device is None:
                raise BackendError(
                    f"ncnn: the only Vulkan devices are software ones "
                    f"({', '.join(d.label() for d in gpus)}), not accelerators: gpu "
                    f"placement needs [ncnn] allow_software_vulkan = true to use them",
                    ErrorCode.UNAVAILABLE)
            return device
        device = next((d for d in gpus if d.index == wanted), None)
        if device is None:
            raise BackendError(f"ncnn: no Vulkan device {wanted} (model.toml [ncnn] device); "
                               f"there are {', '.join(d.label() for d in gpus)}",
                               ErrorCode.UNAVAILABLE)
        if device.software and not settings["allow_software_vulkan"]:
            raise BackendError(f"ncnn: {device.label()} is a software Vulkan device, not an "
                               f"accelerator: set [ncnn] allow_software_vulkan = true to "
                               f"place models on it", ErrorCode.UNAVAILABLE)
        return device

    @staticmethod
    def _converted(model_path: Path, settings: dict[str, Any]) -> tuple[Converted, Path | None]:
        """The ncnn files for ``model_path``: beside it (``inferd-convert ncnn``), else
        from the conversion cache, converted now if need be; and a temporary folder to
        remove once they are read."""
        folder = model_path.parent
        if (folder / SIDECAR).is_file() or model_path.name == PARAM:
            return read_sidecar(folder / SIDECAR), None
        from inferd.libbackends.onnxfile import onnx_specs

        inputs, outputs = onnx_specs(model_path, "ncnn")
        for s in (*inputs, *outputs):
            if s.dtype != "float32":
                raise ModelError(f"ncnn cannot load {model_path}: tensor {s.name!r} is "
                                 f"{s.dtype}; ncnn runs float32 tensors only",
                                 ErrorCode.UNSUPPORTED)
            if len(s.shape) < 2 or len(s.shape) > 5 or s.shape[0] not in (None, 1):
                raise ModelError(f"ncnn cannot load {model_path}: tensor {s.name!r} has "
                                 f"shape {list(s.shape)}; ncnn needs a batch axis first "
                                 f"(free or 1) and 1 to 4 axes after it",
                                 ErrorCode.UNSUPPORTED)
        shapes = trace_shapes(model_path, inputs, settings["input_shapes"])
        if (folder / PARAM).is_file():  # made by hand: the ONNX file says what it is
            return Converted(folder / PARAM, folder / BIN, tuple(inputs), tuple(outputs),
                             shapes), None
        cache = Path(settings["cache_dir"] or Path(defs.STATE_DIR) / "ncnn")
        return convert_cached(model_path, tuple(inputs), tuple(outputs), shapes, cache)

    def _net(self, converted: Converted, settings: dict[str, Any],
             device: VulkanDevice | None) -> Any:
        """An ``ncnn.Net`` with the options set and the files read.

        Raises:
            ModelError: a file is missing, not ncnn's, or corrupt.
        """
        param, weights = converted.param, converted.bin
        try:
            with open(param, "rb") as f:
                magic = f.readline().strip()
        except OSError as e:
            raise ModelError(f"ncnn cannot read {param}: {e.strerror}",
                             ErrorCode.NOT_FOUND) from e
        if magic != PARAM_MAGIC.encode():
            raise ModelError(f"ncnn cannot load {param}: not an ncnn .param file (its first "
                             f"line is {magic[:40]!r}, not the magic {PARAM_MAGIC})",
                             ErrorCode.INTERNAL)
        if not weights.is_file():
            raise ModelError(f"ncnn cannot load {param}: its weights {weights.name} are "
                             f"missing (the pair is {PARAM} + model.ncnn.bin)",
                             ErrorCode.NOT_FOUND)
        net = self._ncnn.Net()
        opt = net.opt
        opt.num_threads = settings["threads"]
        half = settings["precision"] == "fp16"
        opt.use_fp16_packed = opt.use_fp16_storage = opt.use_fp16_arithmetic = half
        opt.use_bf16_storage = False
        opt.use_winograd_convolution = settings["winograd"]
        opt.use_sgemm_convolution = settings["sgemm"]
        opt.use_vulkan_compute = device is not None
        if device is not None:
            net.set_vulkan_device(device.index)
        if net.load_param(str(param)) != 0:
            raise ModelError(f"ncnn cannot load {param}: load_param failed (a corrupt "
                             f"or truncated .param, or a layer this ncnn {self.version} "
                             f"lacks; ncnn's reason is on the daemon's stderr)",
                             ErrorCode.INTERNAL)
        if net.load_model(str(weights)) != 0:
            net.clear()
            raise ModelError(f"ncnn cannot load {weights}: load_model failed (a truncated "
                             f".bin, or one that belongs to another .param)",
                             ErrorCode.INTERNAL)
        blobs = (list(net.input_names()), list(net.output_names()))
        want = ([f"in{i}" for i in range(len(converted.inputs))],
                [f"out{i}" for i in range(len(converted.outputs))])
        if blobs != want:
            net.clear()
            raise ModelError(f"ncnn cannot load {param}: its blobs {blobs[0]} -> {blobs[1]} "
                             f"do not match the {len(want[0])} inputs and "
                             f"{len(want[1])} outputs of {SIDECAR}", ErrorCode.INTERNAL)
        return net


def create_backend() -> Backend:
    """The factory the plugin loader calls."""
    return NcnnBackend()
