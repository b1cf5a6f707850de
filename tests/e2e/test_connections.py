"""Connections a local process can open to the daemon (issue 18, defects 1 and 9): the
open-files limit raised at start, a bound on connections beyond which new ones are
closed (no count of connections may stop the daemon), memory returned when they go."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psutil
import pytest


def _prlimit(soft: int, hard: int) -> list[str]:
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux)")
    return ["prlimit", f"--nofile={soft}:{hard}", "--"]


def test_the_open_files_limit_is_raised_to_the_hard_one(start_daemon: Any,
                                                         short_tmp: Path) -> None:
    d = start_daemon(wrap=_prlimit(1024, 4096))
    assert psutil.Process(d.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (4096, 4096)
    assert "open-files limit raised from 1024 to 4096" in d.log()
