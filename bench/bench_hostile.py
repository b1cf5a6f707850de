"""A shared daemon beside a hostile local process (issue 18), measured in this run:

1. inline ops: a well-behaved client's ocr-cls p50 alone and beside a process that
   floods ``metrics``, ``status``, ``models`` or infers of an unknown name as fast as it
   can (target: ratio <= 2); and how many of the flood's requests were served a second
   (each client runs at most inline.RATE of them, after a burst);
2. connections: the daemon's RSS per open connection (what the default of
   ``server.max_connections`` costs), and what is left of it once they closed;
3. bytes: 100 connections each sending one 19.7 MB ocr-det request with
   ``server.max_bytes_in_flight = 128MiB``: answers by code, the RSS growth while the
   admitted ones run, and the transient peak while libzmq receives them all at once.

The load average is printed beside the figures: other work on the machine moves them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, ROOT, DaemonProcess, cpu_note, pct, verdict  # noqa: E402

from inferd.ipc import Client, RequestError  # noqa: E402
from inferd.ipc.protocol import Op  # noqa: E402

X = {"x": np.zeros((1, 3, 48, 192), np.float32)}
ROUNDS = 3
POLITE = 300


def flood(endpoint: str, kind: str, stop: Any, count: Any) -> None:
    with Client(endpoint, timeout=60) as c:
        while not stop.is_set():
            try:
                if kind == "metrics":
                    c.call(Op.METRICS)
                elif kind == "status":
                    c.status()
                elif kind == "models":
                    c.models()
                else:
                    c.infer("no-such-model", X)
            except RequestError:
                pass
            with count.get_lock():
                count.value += 1


def polite_p50(endpoint: str) -> float:
    with Client(endpoint, timeout=60) as c:
        lat = []
        for _ in range(POLITE):
            t0 = time.perf_counter()
            c.infer("ocr-cls", X)
            lat.append(time.perf_counter() - t0)
    return pct(lat, 0.5)


def inline_ops() -> None:
    d = DaemonProcess("--models", str(MODELS), "--preload", "ocr-cls")
    ctx = mp.get_context("spawn")
    try:
        polite_p50(d.endpoint)  # warm
        for kind in ("metrics", "status", "models", "unknown name"):
            ratios, rates = [], []
            for _ in range(ROUNDS):
                alone = polite_p50(d.endpoint)
                stop, count = ctx.Event(), ctx.Value("i", 0)
                proc = ctx.Process(target=flood, args=(d.endpoint, kind, stop, count))
                proc.start()
                while count.value < 5:
                    time.sleep(0.01)
                t0, n0 = time.perf_counter(), count.value
                beside = polite_p50(d.endpoint)
                rates.append((count.value - n0) / (time.perf_counter() - t0))
                stop.set()
                proc.join(60)
                ratios.append(beside / alone)
                last = (alone, beside)
            ratio = sorted(ratios)[len(ratios) // 2]
            print(f"  polite p50 beside a {kind} flood: {last[1] * 1e3:.2f} ms vs "
                  f"{last[0] * 1e3:.2f} ms alone (median of {ROUNDS} rounds) -> "
                  f"{verdict(ratio, 2.0, higher_is_better=False)}; the flood got "
                  f"{sorted(rates)[len(rates) // 2]:.0f} answers/s", flush=True)
    finally:
        d.stop()


def _kit(endpoint: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.e2e.connections_kit", endpoint,
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    return json.loads(out)


def connections() -> None:
    d = DaemonProcess()
    proc = psutil.Process(d.proc.pid)
    try:
        base = proc.memory_info().rss
        kit = subprocess.Popen([sys.executable, "-m", "tests.e2e.connections_kit",
                                d.endpoint, "2000", "3", "ping"], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        peak = 0
        while kit.poll() is None:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.05)
        time.sleep(3)  # the idle trim, 2 s after the last connection closed
        after = proc.memory_info().rss
        per = (peak - base) / 2000
        print(f"  2,000 connections: +{(peak - base) / 2**20:.0f} MiB "
              f"({per / 1024:.1f} KiB each; the default bound of 2,048 costs "
              f"{2048 * per / 2**20:.0f} MiB); {(after - base) / 2**20:+.0f} MiB 3 s "
              f"after they closed", flush=True)
    finally:
        d.stop()


def held_bytes() -> None:
    config = Path("/tmp") / f"inferd-bh-{time.time_ns()}.toml"
    config.write_text('[server]\nmax_bytes_in_flight = "128MiB"\n[cache]\n'
                      'max_memory = "1536MiB"\n')
    d = DaemonProcess("--models", str(MODELS), "--preload", "ocr-det", config=config)
    proc = psutil.Process(d.proc.pid)
    try:
        with Client(d.endpoint, timeout=300) as c:
            c.infer("ocr-det", {"x": np.zeros((1, 3, 1280, 1280), np.float32)})
        base = proc.memory_info().rss
        kit = subprocess.Popen([sys.executable, "-m", "tests.e2e.connections_kit",
                                d.endpoint, "100", "1", "big", "all"], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        samples = []
        while kit.poll() is None:
            samples.append(proc.memory_info().rss - base)
            time.sleep(0.05)
        result = json.loads(kit.stdout.read() if kit.stdout else "{}")
        peak = max(samples)
        i = samples.index(peak)
        later = sorted(samples[i + 20:]) or [0]  # from 1 s after the peak
        print(f"  100 x 19.7 MB at once, bound 128 MiB: {result['codes']}; RSS +"
              f"{later[len(later) // 2] / 2**20:.0f} MiB (median) while the admitted ones "
              f"ran; transient peak +{peak / 2**20:.0f} MiB while libzmq received them",
              flush=True)
    finally:
        d.stop()
        config.unlink(missing_ok=True)


def main() -> None:
    print(f"bench_hostile ({cpu_note()}; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    print("1. inline ops beside a flood from another process")
    inline_ops()
    print("2. connections")
    connections()
    print("3. request bytes held")
    held_bytes()
    print(f"(load average {', '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
