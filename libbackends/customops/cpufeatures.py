"""The CPU's features, detected once per process: /proc/cpuinfo flags plus AT_HWCAP.

Names follow the kernel's (x86 ``flags``: ``sse4_2``, ``avx2``, ``fma``, ``avx512f``,
``avx512_vnni``...; arm64 ``Features``: ``asimd``, ``asimddp``, ``sve``, ``fphp``...), with
the names Arm Compute Library uses added as aliases (``neon`` for ``asimd``, ``dotprod``
for ``asimddp``, ``fp16`` for ``fphp`` + ``asimdhp``). On arm64 the AT_HWCAP bits of the
auxiliary vector are read too, so a kernel that hides cpuinfo (a container) still says.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
from collections.abc import Iterable

log = logging.getLogger(__name__)

AT_HWCAP = 16
AT_HWCAP2 = 26
# arch/arm64/include/uapi/asm/hwcap.h
ARM64_HWCAP = {1: "asimd", 3: "aes", 6: "crc32", 9: "fphp", 10: "asimdhp", 20: "asimddp",
               22: "sve", 23: "asimdfhm"}
ARM64_HWCAP2 = {1: "sve2", 14: "i8mm", 15: "bf16"}
ALIASES = {"asimd": "neon", "asimddp": "dotprod", "sve": "sve", "asimdfhm": "fhm"}


def parse_cpuinfo(text: str) -> set[str]:
    """The feature words of ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on arm)."""
    found: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            found |= set(value.split())
    return found


def hwcap_features(machine: str, hwcap: int, hwcap2: int) -> set[str]:
    """Feature names from the AT_HWCAP/AT_HWCAP2 words (arm64 only; x86 puts only
    CPUID leaf 1's legacy bits there, which cpuinfo's flags already list)."""
    if machine not in ("aarch64", "arm64"):
        return set()
    return ({name for bit, name in ARM64_HWCAP.items() if hwcap >> bit & 1}
            | {name for bit, name in ARM64_HWCAP2.items() if hwcap2 >> bit & 1})


def with_aliases(names: Iterable[str]) -> frozenset[str]:
    out = set(names)
    out |= {ALIASES[n] for n in names if n in ALIASES}
    if {"fphp", "asimdhp"} <= out:
        out.add("fp16")
    return frozenset(out)


def _getauxval(kind: int) -> int:
    try:
        libc = ctypes.CDLL(None)
        libc.getauxval.restype = ctypes.c_ulong
        libc.getauxval.argtypes = [ctypes.c_ulong]
        return int(libc.getauxval(kind))
    except (OSError, AttributeError):
        return 0


@functools.cache
def detect() -> frozenset[str]:
    """This CPU's features (computed once; logged once)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = parse_cpuinfo(f.read())
    except OSError:
        names = set()
    names |= hwcap_features(platform.machine(), _getauxval(AT_HWCAP), _getauxval(AT_HWCAP2))
    features = with_aliases(names)
    shown = sorted(features & {"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni",
                               "neon", "dotprod", "fp16", "sve", "sve2", "i8mm"})
    log.info("CPU features for custom op kernels: %s (%d in all)", " ".join(shown) or "-",
             len(features))
    return features


def needs(spec: str) -> list[str]:
    """The feature names of a kernel's ``"avx2,fma"`` string."""
    return [f.strip().lower() for f in spec.split(",") if f.strip()]


def choose(kernels: list[tuple[str, str]], have: frozenset[str] | None = None
           ) -> tuple[int | None, str]:
    """The first kernel (name, features) whose features ``have`` holds all of.

    Returns:
        (index, "") or (None, why none fits: each kernel and what it lacks).
    """
    have = detect() if have is None else have
    lacking = []
    for i, (name, spec) in enumerate(kernels):
        missing = [f for f in needs(spec) if f not in have]
        if not missing:
            return i, ""
        lacking.append(f"{name} needs {', '.join(missing)}")
    return None, ("no kernel fits this CPU: " + "; ".join(lacking)) if lacking \
        else "the op has no kernel"
