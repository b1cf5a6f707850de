"""A backend for the backend-host tests, run inside a real host process: it computes
the test model (Relu then Sigmoid, in numpy) and misbehaves on request, so that the
host's failure modes are real ones: a crash (SIGSEGV sent to itself), a hang, an exit.

A first input element of 1001 crashes the host, 1002 hangs it, 1003 makes it exit with
status 3. ``$HOSTED_TEST_FAIL`` = ``factory`` makes create_backend() raise, ``probe``
makes probe() say the device is absent.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferd.ipc.errors import ModelError
from inferd.libbackends.contract import (
    Backend, DeviceKind, LoadedModel, LoadOptions, Probe, TensorSpec,
)


class Model(LoadedModel):
    device = "test cpu 0"

    def __init__(self) -> None:
        self.inputs = (TensorSpec("x", "float32", (None, 4)),)
        self.outputs = (TensorSpec("y", "float32", (None, 4)),)

    def run(self, inputs: dict[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        x = inputs["x"]
        first = float(x.reshape(-1)[0]) if x.size else 0.0
        if first == 1001:
            os.kill(os.getpid(), signal.SIGSEGV)
        elif first == 1002:
            time.sleep(3600)
        elif first == 1003:
            os._exit(3)
        return {"y": (1.0 / (1.0 + np.exp(-np.maximum(x, 0)))).astype(np.float32)}

    def unload(self) -> None:
        pass


class Misbehaving(Backend):
    id = "hosted-test"
    version = "0.1"
    kind = DeviceKind.CPU

    def probe(self) -> Probe:
        if os.environ.get("HOSTED_TEST_FAIL") == "probe":
            return Probe(False, "no device node /dev/hosted-test0")
        return Probe(True, devices=("cpu",))

    def supports(self, model_path: Path) -> tuple[bool, str]:
        if model_path.suffix != ".onnx":
            return False, f"{model_path.name} is not an .onnx file"
        return True, ""

    def load(self, model_path: Path, options: LoadOptions) -> LoadedModel:
        if not model_path.is_file() or model_path.read_bytes()[:2] == b"\x08\x07":
            raise ModelError(f"hosted-test cannot load {model_path}: not a model")
        if options.options.get("crash_on_load"):
            os.kill(os.getpid(), signal.SIGSEGV)
        return Model()


def create_backend() -> Backend:
    if os.environ.get("HOSTED_TEST_FAIL") == "factory":
        raise RuntimeError("licence server unreachable")
    return Misbehaving()
