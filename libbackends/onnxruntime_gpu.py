"""The onnxruntime GPU backend (id ``onnxruntime-gpu``): the CUDA and TensorRT execution
providers of the ``onnxruntime-gpu`` build, for NVIDIA discrete GPUs and Jetsons.

onnxruntime-gpu lists CUDA and TensorRT as available even where they cannot run (no
GPU, no CUDA libraries), and a session asked for them then silently runs on the CPU,
saying why only on stderr. So the probe and every load create the session, check the
providers it really got (``session.get_providers()``), and turn what onnxruntime
printed (e.g. ``libcublasLt.so.13: cannot open shared object file``) into the reason:
a "gpu" model never runs on the CPU.

Settings, from the model.toml table ``[onnxruntime-gpu]``: ``device_id`` (0),
``provider`` (``"cuda"`` or ``"tensorrt"``), ``fp16`` (TensorRT, false),
``trt_engine_cache`` (true) and ``cache_dir`` (``/var/cache/inferd/tensorrt``).
"""

from __future__ import annotations

import importlib.util
import logging
import io
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

from inferd.ipc.errors import BackendError, ErrorCode, ModelError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe,
)
from inferd.libbackends.childprobe import engine_facts
from inferd.libbackends.onnxruntime_cpu import (
    PROBE_TIMEOUT_S, LazyOnnxRuntime, OrtModel, installed_version, ort_facts,
)

log = logging.getLogger(__name__)

CACHE_DIR = "/var/cache/inferd/tensorrt"
OPTION_KEYS = ("device_id", "provider", "fp16", "trt_engine_cache", "cache_dir")
PROVIDERS = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_stderr_lock = threading.Lock()


@contextmanager
def captured_output() -> Iterator[list[str]]:
    """Capture what native code writes to file descriptor 2 meanwhile (onnxruntime's
    own logger writes there) and what Python code prints (onnxruntime's Python layer
    prints its provider fallbacks), then pass it on to stderr; the list holds the text
    once the block is left. Process-wide for its duration, hence the lock."""
    text: list[str] = []
    printed = io.StringIO()
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            with redirect_stdout(printed):
                yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            raw = tmp.read() + printed.getvalue().encode()
            if raw:
                os.write(2, raw)
            text.append(_ANSI.sub("", raw.decode("utf-8", "replace")))


def why_not_on_gpu(printed: str) -> str:
    """The reason onnxruntime printed for not creating a GPU provider, shortest form
    first: the library that failed to load and why, else its own message."""
    m = re.search(r"Failed to load library (\S+) with error: ([^\n]+)", printed)
    if m:
        return f"cannot load {Path(m.group(1)).name}: {m.group(2).strip()}"
    for pattern in (r"(Failed to create \w+ExecutionProvider[^\n]*)",
                    r"\[E:onnxruntime[^\]]*\] ([^\n]+)"):
        m = re.search(pattern, printed)
        if m:
            return m.group(1).strip()
    lines = [ln.strip() for ln in printed.splitlines() if ln.strip()]
    return lines[-1] if lines else "onnxruntime printed no reason"


def _probe_model() -> bytes:
    """A one-node float model (Relu), enough to make a provider load its libraries."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


GPU_FACTS = (
    "from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend\n"
    "b = OnnxRuntimeGpuBackend()\n"
    "p = b.probe_here()\n"
    "print(json.dumps({'version': b._ort.__version__, 'available': p.available,\n"
    "                  'reason': p.reason, 'devices': list(p.devices)}))\n")


class OnnxRuntimeGpuBackend(LazyOnnxRuntime, Backend):
    """onnxruntime with the CUDA (or TensorRT) execution provider."""

    id = "onnxruntime-gpu"
    kind = DeviceKind.GPU

    def __init__(self) -> None:
        # onnxruntime is imported when the first model loads on it; the probe (a CUDA
        # session) runs in a child process (libbackends/childprobe.py: engine_facts)
        self.version = installed_version("onnxruntime-gpu") or installed_version("onnxruntime")

    def _session(self, model: str | bytes, providers: list[Any], threads: int = 1
                 ) -> tuple[Any, str]:
        """A session and what onnxruntime printed while making it."""
        so = self._ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        with captured_output() as printed:
            session = self._ort.InferenceSession(model, sess_options=so, providers=providers)
        return session, printed[0]

    def probe(self) -> Probe:
        if importlib.util.find_spec("onnxruntime") is None:
            return Probe(False, "python module onnxruntime is not installed")
        try:
            ort = ort_facts()
            providers = ort["providers"]
            if "CUDAExecutionProvider" not in providers:  # no second child needed
                return Probe(False, f"onnxruntime {ort['version']} ({ort['location']}) is "
                                    f"a build without CUDA (providers: "
                                    f"{', '.join(providers)}); the GPU backend needs "
                                    f"onnxruntime-gpu in its place")
            facts = engine_facts("onnxruntime", GPU_FACTS, PROBE_TIMEOUT_S)
        except RuntimeError as e:
            return Probe(False, f"onnxruntime cannot be imported: {e}")
        self.version = facts["version"]
        return Probe(facts["available"], facts["reason"], tuple(facts["devices"]))

    def probe_here(self) -> Probe:
        """The probe itself, in this process (the child's side of :meth:`probe`)."""
        ort = self._ort
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            return Probe(False, f"onnxruntime {self.version} ({Path(ort.__file__).parent}) "
                                f"is a build without CUDA (providers: {', '.join(available)});"
                                f" the GPU backend needs onnxruntime-gpu in its place")
        if hasattr(ort, "preload_dlls") and importlib.util.find_spec("nvidia") is not None:
            # CUDA and cuDNN from NVIDIA's pip wheels (onnxruntime-gpu[cuda,cudnn])
            try:
                with captured_output():
                    ort.preload_dlls()
            except Exception as e:  # noqa: BLE001  the session below says what is missing
                log.debug("onnxruntime.preload_dlls() failed: %s", e)
        try:
            session, printed = self._session(_probe_model(), ["CUDAExecutionProvider"])
        except Exception as e:  # noqa: BLE001  probe() must say why, never raise
            return Probe(False, f"onnxruntime-gpu cannot create a CUDA session: {e}")
        got = session.get_providers()
        if "CUDAExecutionProvider" not in got:
            return Probe(False, f"CUDA provider unusable ({why_not_on_gpu(printed)}); "
                                f"onnxruntime would run on {', '.join(got)} only")
        devices = tuple(f"cuda:{i}" for i in range(_cuda_device_count() or 1))
        return Probe(True, devices=devices)

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.suffix != ".onnx":
            return False, f"{model_path.name} is not an .onnx file"
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        s = self._settings(options.options)
        provider = PROVIDERS[s["provider"]]
        cuda = ("CUDAExecutionProvider", {"device_id": s["device_id"]})
        providers: list[Any] = [cuda]
        if provider == "TensorrtExecutionProvider":
            trt: dict[str, Any] = {"device_id": s["device_id"], "trt_fp16_enable": s["fp16"]}
            if s["trt_engine_cache"]:
                trt.update(trt_engine_cache_enable=True,
                           trt_engine_cache_path=str(Path(s["cache_dir"]) / model_path.stem))
            providers.insert(0, (provider, trt))
        try:
            session, printed = self._session(str(model_path), providers,
                                             options.intra_op_threads)
        except Exception as e:  # onnxruntime's own Fail/InvalidGraph/... classes
            raise ModelError(f"onnxruntime-gpu cannot load {model_path}: {e}") from e
        got = session.get_providers()
        if provider not in got:
            raise BackendError(
                f"onnxruntime-gpu will not run {model_path} on the CPU: {provider} is "
                f"unusable ({why_not_on_gpu(printed)}); the session got {', '.join(got)}",
                ErrorCode.UNAVAILABLE)
        model = OrtModel(session, model_path)
        model.device = f"cuda:{s['device_id']}" + (" (TensorRT)" if "Tensorrt" in provider
                                                   else "")
        return model

    @staticmethod
    def _settings(raw: dict[str, Any]) -> dict[str, Any]:
        """``[onnxruntime-gpu]`` with defaults, checked; ModelError names the key."""
        s: dict[str, Any] = {"device_id": 0, "provider": "cuda", "fp16": False,
                             "trt_engine_cache": True, "cache_dir": CACHE_DIR}
        for key, value in raw.items():
            where = f"model.toml [onnxruntime-gpu] {key} = {value!r}"
            if key not in OPTION_KEYS:
                raise ModelError(f"model.toml [onnxruntime-gpu] {key}: unknown key; known "
                                 f"keys: {', '.join(OPTION_KEYS)}", ErrorCode.INTERNAL)
            bad = {
                "device_id": isinstance(value, bool) or not isinstance(value, int)
                or value < 0,
                "provider": value not in PROVIDERS,
                "fp16": not isinstance(value, bool),
                "trt_engine_cache": not isinstance(value, bool),
                "cache_dir": not (isinstance(value, str) and value.startswith("/")),
            }[key]
            if bad:
                expected = {"device_id": "an integer >= 0",
                            "provider": f"one of {', '.join(PROVIDERS)}",
                            "fp16": "true or false", "trt_engine_cache": "true or false",
                            "cache_dir": "an absolute directory path"}[key]
                raise ModelError(f"{where}: expected {expected}", ErrorCode.INTERNAL)
            s[key] = value
        return s


def _cuda_device_count() -> int:
    """GPUs the CUDA runtime sees (0 if it cannot be asked): for the device list only."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cudart.cudaGetDeviceCount(ctypes.byref(count)) == 0:
            return count.value
    return 0


def create_backend() -> Backend:
    """The factory the plugin loader calls."""
    return OnnxRuntimeGpuBackend()
