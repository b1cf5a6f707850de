"""Helpers for the tests that run the rknn backend in simulator mode: where the
simulator's virtual environment is, and the rknn plugin copied into a backends folder.

The simulator lives in its own virtual environment (`make venv-rknn` -> .venv-rknn/,
about 1.5 GB). Without it these tests skip with the reason; `.ci/run` builds it and sets
INFERD_TEST_RKNN=1, which turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "packaging" / "backends" / "rknn"
REQUIRE = "INFERD_TEST_RKNN"


def simulator_python() -> str:
    """The simulator venv's interpreter; skips (or fails, under CI) when it is absent."""
    python = os.environ.get("INFERD_RKNN_PYTHON") or str(ROOT / ".venv-rknn" / "bin" / "python")
    if not Path(python).is_file():
        reason = f"the RKNN simulator's venv is absent ({python}): run `make venv-rknn`"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {reason}")
        pytest.skip(reason)
    return python


def install_plugin(backends: Path) -> Path:
    """Copy the rknn plugin (packaging/backends/rknn) into the folder ``backends``."""
    dest = backends / "rknn"
    shutil.copytree(PLUGIN, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest
