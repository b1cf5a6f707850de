"""Helpers for the ncnn tests: what they need (ncnn, pnnx, a Vulkan device), the ncnn
plugin copied into a backends folder, and lavapipe's threads bounded.

Here the Vulkan device is Mesa's lavapipe (Debian's mesa-vulkan-drivers): a real,
conformant Vulkan implementation that runs on the CPU, 20-50x slower than onnxruntime;
the tests keep their inputs small. Without ncnn, pnnx or a Vulkan device the tests skip
with the reason; `.ci/run` sets INFERD_TEST_VULKAN=1, which turns the skip into a
failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "packaging" / "backends" / "ncnn"
REQUIRE = "INFERD_TEST_VULKAN"
LP_THREADS = "2"
"""lavapipe otherwise starts a worker per core for every Vulkan device it makes."""

os.environ.setdefault("LP_NUM_THREADS", LP_THREADS)


def _missing(reason: str) -> None:
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but {reason}")
    pytest.skip(reason)


def require_ncnn() -> None:
    """ncnn and pnnx are installed (make setup), else skip (or fail under CI)."""
    import importlib.util

    from inferd.libbackends.ncnn_convert import pnnx_binary

    if importlib.util.find_spec("ncnn") is None:
        _missing("pip ncnn is not installed (make setup)")
    if pnnx_binary() is None:
        _missing("pnnx is not installed (make setup: pip install --no-deps pnnx)")


def require_vulkan() -> None:
    """A Vulkan device is there (lavapipe: apt-get install mesa-vulkan-drivers)."""
    require_ncnn()
    import ncnn

    from inferd.libbackends.ncnn_backend import list_vulkan_devices

    if not list_vulkan_devices(ncnn.__file__):
        _missing("ncnn finds no Vulkan device (apt-get install mesa-vulkan-drivers)")


def install_plugin(backends: Path) -> Path:
    """Copy the ncnn plugin (packaging/backends/ncnn) into the folder ``backends``."""
    dest = backends / "ncnn"
    shutil.copytree(PLUGIN, dest, ignore=shutil.ignore_patterns("__pycache__", "vendor"))
    return dest
