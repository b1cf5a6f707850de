"""Sizes, durations and core lists as the configuration files write them (``"256MiB"``,
``"40%"``, ``"5m"``, ``"forever"``, ``[0, 1]``): parsed here for inferd.toml, model.toml
and graph.toml alike."""

from __future__ import annotations

import math
import os
import re
from typing import Any

import psutil

from inferd.ipc.errors import ErrorCode, ModelError

PROCESS_CORES = frozenset(os.sched_getaffinity(0))
"""The cores this process may use, read at start-up before any thread is pinned."""

UNLIMITED = ("unlimited", "none", "0")
FOREVER = ("forever", "never", "inf")
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30}


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as ``"256MiB"``; raises ValueError."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", value, re.IGNORECASE)
        if m:
            size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
            if size > 0:
                return size
    raise ValueError


def parse_budget(value: Any) -> int | None:
    """Bytes of the cache budget, or None for no limit.

    Accepts a size (``536870912``, ``"512MiB"``), a share of physical memory
    (``"40%"``), or ``"unlimited"``. Raises ValueError otherwise.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in UNLIMITED:
            return None
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
        if m:
            share = float(m.group(1))
            if not 0 < share <= 100:
                raise ValueError
            return int(psutil.virtual_memory().total * share / 100)
    return parse_size(value)


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as ``"30s"``, ``"5m"``, ``"1h"``.

    A negative number or ``"forever"`` means never (``math.inf``); 0 means at once.
    Raises ValueError otherwise.
    """
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int | float):
        if math.isnan(value):
            raise ValueError
        return math.inf if value < 0 else float(value)
    if isinstance(value, str):
        if value.strip().lower() in FOREVER:
            return math.inf
        m = _DURATION.fullmatch(value)
        if m:
            return float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    raise ValueError


def parse_affinity(cores: Any) -> list[int]:
    """A checked, sorted core list; raises ValueError saying what is wrong."""
    if (not isinstance(cores, list) or not cores
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                       for c in cores)):
        raise ValueError("expected a non-empty list of core numbers")
    missing = sorted(set(cores) - PROCESS_CORES)
    if missing:
        raise ValueError(f"cores {missing} are not usable by this process (it may use "
                         f"{sorted(PROCESS_CORES)})")
    return sorted(set(cores))


def request_keep_alive(params: dict[str, Any]) -> float | None:
    """The ``keep_alive`` a request's header asks for, in seconds, or None.

    Raises:
        ModelError (INVALID_ARGUMENT): not a duration.
    """
    value = params.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError:
        raise ModelError(f"keep_alive = {value!r}: expected seconds or a duration such "
                         f"as '5m', or 'forever'", ErrorCode.INVALID_ARGUMENT) from None


def positive_int(v: Any) -> int:
    """A config value check: an integer > 0 (not a bool); raises ValueError."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    raise ValueError


def positive_float(v: Any) -> float:
    """A number > 0 (not a bool); raises ValueError."""
    if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
        return float(v)
    raise ValueError


def non_negative(v: Any) -> float:
    """A number >= 0 (not a bool); raises ValueError."""
    if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0:
        return float(v)
    raise ValueError


def boolean(v: Any) -> bool:
    """true or false; raises ValueError."""
    if isinstance(v, bool):
        return v
    raise ValueError


def string_list(v: Any) -> list[str]:
    """A list of non-empty strings; raises ValueError."""
    if isinstance(v, list) and all(isinstance(x, str) and x for x in v):
        return list(v)
    raise ValueError
