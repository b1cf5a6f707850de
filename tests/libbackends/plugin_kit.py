"""Helpers shared by the backend tests: the expected result of the test model, and the
"zoo" directory of one good plugin of each form beside one plugin of each broken kind."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray


def expected_relu_sigmoid(x: NDArray[Any]) -> NDArray[Any]:
    """What the test model computes, in numpy."""
    return (1.0 / (1.0 + np.exp(-np.maximum(x, 0)))).astype(np.float32)


def copy_into(src: Path, directory: Path, name: str | None = None) -> Path:
    """Copy ``src`` into ``directory`` (as ``name``)."""
    directory.mkdir(parents=True, exist_ok=True)
    dst = directory / (name or src.name)
    shutil.copy(src, dst)
    return dst


# Python plugins broken in one way each: file name -> source.
BROKEN_PYTHON = {
    "bad_syntax.py": "def create_backend(:\n    pass\n",
    "import_raises.py": "raise RuntimeError('boom at import')\n",
    "no_factory.py": "def make_backend():\n    return None\n",
    "factory_raises.py": "def create_backend():\n    raise ValueError('no licence key')\n",
    "missing_method.py": (
        "from inferd.libbackends.contract import DeviceKind, Probe\n"
        "class Half:\n"
        "    id, version, kind = 'half', '0.1', DeviceKind.CPU\n"
        "    def probe(self):\n"
        "        return Probe(True, devices=('cpu',))\n"
        "    def supports(self, path):\n"
        "        return True, ''\n"
        "def create_backend():\n"
        "    return Half()\n"),
}

# entry name -> (stage, status, words the reason contains)
ZOO_EXPECTED = {
    "bad_syntax.py": ("opened", "failed", "SyntaxError"),
    "import_raises.py": ("opened", "failed", "import raised RuntimeError: boom at import"),
    "no_factory.py": ("contract checked", "failed", "no factory function create_backend()"),
    "factory_raises.py": ("contract checked", "failed",
                          "create_backend() raised ValueError: no licence key"),
    "missing_method.py": ("contract checked", "failed", "lacks method load()"),
    "libnotelf_backend.so": ("opened", "failed", "dlopen failed"),
    "libnogetter_backend.so": ("contract checked", "failed",
                               "symbol inferd_backend_get is not exported"),
    "libmajor_backend.so": ("contract checked", "failed",
                            "API version 2.0 is incompatible with the daemon's 1.0"),
    "libminor_backend.so": ("contract checked", "failed",
                            "API version 1.7 is newer than the daemon's 1.0"),
    "libsegv_backend.so": ("contract checked", "failed",
                           "crashed with SIGSEGV while calling inferd_backend_get()"),
    "libhang_backend.so": ("probed", "failed", "hung: no answer within"),
    "libabort_backend.so": ("probed", "failed", "crashed with SIGABRT while calling probe()"),
    "libnodevice_backend.so": ("probed", "unavailable", "no device node /dev/fake-npu0"),
    "zz_duplicate.py": ("registered", "failed",
                        "id 'onnx-reference' already registered by"),
    "libgone_backend.so": ("found", "failed", "dangling symlink to"),
    # Tests run as root, who can read any regular file: the unreadable entry is a FIFO
    # (opening it would block), which the loader refuses before opening it.
    "libfifo_backend.so": ("opened", "failed", "cannot read it: it is a FIFO"),
    "libadir_backend.so": ("opened", "failed", "cannot read it: it is a directory"),
    "libzz_alias_backend.so": ("found", "skipped", "same file as"),
    "libhelper.so": ("found", "ignored", "a native plugin is named lib<name>_backend.so"),
    "onnx_reference.py": ("registered", "registered", ""),
    "libelementwise_backend.so": ("registered", "registered", ""),
}


def make_plugin_zoo(directory: Path, broken_so: Any, python_example: Path,
                    elementwise_so: Path) -> dict[str, tuple[str, str, str]]:
    """Fill ``directory`` with the two good example plugins beside one plugin of each
    broken kind; return ZOO_EXPECTED (entry name -> stage, status, reason words)."""
    import os

    directory.mkdir(parents=True, exist_ok=True)
    for name, source in BROKEN_PYTHON.items():
        (directory / name).write_text(source)
    copy_into(python_example, directory)
    copy_into(python_example, directory, "zz_duplicate.py")
    copy_into(elementwise_so, directory)
    (directory / "libnotelf_backend.so").write_text("#!/bin/sh\necho not an ELF file\n")
    natives = {
        "nogetter": ("NO_GETTER",),
        "major": ("API_VERSION_VALUE=0x20000",),
        "minor": ("API_VERSION_VALUE=0x10007",),
        "segv": ("SEGV_IN_GETTER",),
        "hang": ('PLUGIN_ID="hang"', "HANG_IN_PROBE"),
        "abort": ('PLUGIN_ID="abort"', "ABORT_IN_PROBE"),
        "nodevice": ('PLUGIN_ID="fake-npu"', "PLUGIN_KIND=INFERD_KIND_NPU", "UNAVAILABLE"),
    }
    for name, defines in natives.items():
        copy_into(broken_so(name, *defines), directory)
    os.symlink("/nonexistent/libgone_backend.so", directory / "libgone_backend.so")
    os.mkfifo(directory / "libfifo_backend.so")
    (directory / "libadir_backend.so").mkdir()
    os.symlink("libelementwise_backend.so", directory / "libzz_alias_backend.so")
    (directory / "libhelper.so").write_bytes(b"\x7fELF but a helper library")
    (directory / "README.txt").write_text("not a plugin, not a candidate\n")
    (directory / "__pycache__").mkdir()
    return dict(ZOO_EXPECTED)
