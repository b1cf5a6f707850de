"""Two builds of inferd side by side: the same requests, in interleaved blocks, to a
daemon of another checkout ("before") and to one of this checkout ("after"), each
with its engines in workers; p50/p90 latency and the CPU of each daemon (its process,
the zygote and the workers) per request.

A before/after figure for one change, on a host whose speed drifts: on the shared
2-core machines of this project the raw pyzmq echo read 232 us p50 at one moment and
620 us twenty minutes later, so two bench runs taken one after the other compare the
host more than the builds. Interleaving the two daemons' blocks puts both under the
same drift. Not part of ``make bench`` (it needs the other checkout).

Run: ``.venv/bin/python bench/compare_builds.py BEFORE_CHECKOUT [ocr-cls|identity]``,
BEFORE_CHECKOUT a checkout with its own ``.venv`` (``git worktree add ../before REV``
then ``make setup`` there, or a venv whose site-packages hold this one's dependencies
and ``pip install --no-deps -e .`` of that checkout).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_workers import daemon, repo_with_identity  # noqa: E402

from inferd.ipc import Client  # noqa: E402

BLOCKS, PER_BLOCK, WARM = 12, 100, 60


def cpu_seconds(pid: int) -> float:
    """User + system seconds of ``pid`` and every process under it."""
    top = psutil.Process(pid)
    total = 0.0
    for p in [top, *top.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass  # a worker that ended meanwhile
    return total


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    before = Path(sys.argv[1]).resolve()
    model = sys.argv[2] if len(sys.argv) > 2 else "ocr-cls"
    python = before / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} missing: the before checkout needs its own .venv")
    repo = repo_with_identity()
    x = (np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
         if model == "ocr-cls" else np.ones(4, np.float32))
    arms = {}
    own = sys.executable
    try:
        for name, exe in (("before", str(python)), ("after", own)):
            sys.executable = exe  # bench/common.py's DaemonProcess starts this one
            arms[name] = daemon(repo, "backend")
    finally:
        sys.executable = own
    try:
        clients = {n: Client(d.endpoint, timeout=60) for n, d in arms.items()}
        for c in clients.values():
            for _ in range(WARM):
                c.infer(model, {"x": x})
        lat: dict[str, list[float]] = {n: [] for n in arms}
        cpu = dict.fromkeys(arms, 0.0)
        for _ in range(BLOCKS):
            for n, c in clients.items():
                c0 = cpu_seconds(arms[n].proc.pid)
                for _ in range(PER_BLOCK):
                    t0 = time.perf_counter()
                    c.infer(model, {"x": x})
                    lat[n].append(time.perf_counter() - t0)
                cpu[n] += cpu_seconds(arms[n].proc.pid) - c0
        print(f"{model}, one client, {BLOCKS} interleaved blocks of {PER_BLOCK}; before = "
              f"{before}")
        for n in arms:
            s = sorted(lat[n])
            print(f"  {n:7s} p50 {s[len(s) // 2] * 1e6:7.0f} us  p90 "
                  f"{s[int(len(s) * 0.9)] * 1e6:7.0f} us  daemon+workers CPU per request "
                  f"{cpu[n] / len(s) * 1e6:6.0f} us")
        for c in clients.values():
            c.close()
    finally:
        for d in arms.values():
            d.stop()


if __name__ == "__main__":
    main()
