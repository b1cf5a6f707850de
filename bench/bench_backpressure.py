"""Backpressure and fairness (issue 12, item 5b), measured in this run:

1. fairness: a polite client (one request at a time) on ocr-cls with its shipped
   model.toml (max_batch 32, adaptive batching), alone and beside a greedy client process
   with 500 requests in flight: the polite p99 ratio (target <= 3, issue 20) and the
   greedy requests served while each polite one waited (a FIFO would serve all ~500);
   the same with the greedy client batched at a fixed 32 rows (the fair batch alone);
2. the shipped defaults under bursts: asyncio.gather of 200 infers on one AsyncClient,
   and 8 client processes with 32 in flight each: requests refused (target 0);
3. a client that sends 10,000 ocr-cls requests and never reads: the daemon's RSS before,
   at the peak and once the burst is over (the limits bound it, malloc_trim returns it).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, DaemonProcess, cpu_note, pct, verdict  # noqa: E402

from inferd.ipc import AsyncClient, Client, RequestError  # noqa: E402
from inferd.ipc.protocol import Op, Request, encode_request  # noqa: E402

X = np.zeros((1, 3, 48, 192), np.float32)


def greedy(endpoint: str, served: Any, started: Any, stop: Any) -> None:
    with Client(endpoint, timeout=300, max_in_flight=500) as g:
        window = [g.submit("infer", "cls", {"x": X}) for _ in range(500)]
        started.set()
        while not stop.is_set():
            r = window.pop(0).reply()
            if r.error is None:
                with served.get_lock():
                    served.value += 1
            window.append(g.submit("infer", "cls", {"x": X}))
        for p in window:
            p.reply()


def polite_beside_greedy(toml: str) -> tuple[list[float], list[float], list[int], str]:
    """The polite client's latencies alone and beside the greedy one, the greedy requests
    served during each polite one, and the model's batching as `models -v` shows it."""
    repo = Path("/tmp") / f"inferd-bb-{time.time_ns()}"
    (repo / "cls").mkdir(parents=True)
    shutil.copytree(MODELS / "ocr-cls" / "1", repo / "cls" / "1")
    (repo / "cls" / "model.toml").write_text(toml)
    d = DaemonProcess("--models", str(repo), "--preload", "cls")
    ctx = mp.get_context("spawn")
    served, started, stop = ctx.Value("i", 0), ctx.Event(), ctx.Event()
    try:
        with Client(d.endpoint, timeout=120) as polite:
            alone = []
            for _ in range(200):
                t0 = time.perf_counter()
                polite.infer("cls", {"x": X})
                alone.append(time.perf_counter() - t0)
            proc = ctx.Process(target=greedy, args=(d.endpoint, served, started, stop))
            proc.start()
            started.wait(120)
            loaded, overtaken = [], []
            for _ in range(200):
                before = served.value
                t0 = time.perf_counter()
                polite.infer("cls", {"x": X})
                loaded.append(time.perf_counter() - t0)
                overtaken.append(served.value - before)
            batching = next(m for m in polite.models() if m["name"] == "cls")["batching"]
            stop.set()
            proc.join(300)
    finally:
        d.stop()
        shutil.rmtree(repo, ignore_errors=True)
    shown = (f"limit {batching.get('limit')} rows ({batching.get('why')})"
             if batching.get("mode") == "adaptive" else str(batching.get("mode")))
    return alone, loaded, overtaken, shown


def fairness() -> None:
    shipped = (MODELS / "ocr-cls" / "model.toml").read_text()
    for label, toml in (("shipped model.toml (max_batch 32, adaptive)", shipped),
                        ("max_batch 32, batching fixed", shipped + 'batching = "fixed"\n')):
        alone, loaded, overtaken, shown = polite_beside_greedy(toml)
        ratio = pct(loaded, 0.99) / pct(alone, 0.99)
        print(f"1. {label}: polite p99 alone {pct(alone, 0.99) * 1000:.1f} ms, beside a "
              f"greedy client with 500 in flight {pct(loaded, 0.99) * 1000:.1f} ms: "
              f"{verdict(ratio, 3.0, higher_is_better=False)}; greedy requests served per "
              f"polite one: median {sorted(overtaken)[len(overtaken) // 2]}, "
              f"max {max(overtaken)} (a FIFO: ~500); batching: {shown}")


def burst_client(endpoint: str) -> int:
    refused = 0
    with Client(endpoint, timeout=120) as c:
        for _ in range(8):
            for p in [c.submit("infer", "ocr-cls", {"x": X}) for _ in range(32)]:
                refused += p.reply().error is not None
    return refused


def bursts() -> None:
    d = DaemonProcess("--models", str(MODELS), "--preload", "ocr-cls")
    try:
        async def gather() -> int:
            async with AsyncClient(d.endpoint, timeout=120) as c:
                rs = await asyncio.gather(*(c.infer("ocr-cls", {"x": X}) for _ in range(200)),
                                          return_exceptions=True)
            return sum(isinstance(r, RequestError) for r in rs)
        refused_gather = asyncio.run(gather())
        with mp.get_context("spawn").Pool(8) as pool:
            refused_8 = sum(pool.map(burst_client, [d.endpoint] * 8))
    finally:
        d.stop()
    print(f"2. shipped defaults: gather of 200 on one AsyncClient: {refused_gather} refused "
          f"(before: 136); 8 clients x 32 in flight x 8 rounds: {refused_8} of 2048 refused "
          f"(before: 16,792 of 24,000)")


def non_reader() -> None:
    d = DaemonProcess("--models", str(MODELS), "--preload", "ocr-cls")
    try:
        with Client(d.endpoint, timeout=60) as c:
            for _ in range(20):
                c.infer("ocr-cls", {"x": X})
            before = d.rss()
            ctx = zmq.Context()
            rude = ctx.socket(zmq.DEALER)
            rude.setsockopt(zmq.LINGER, 0)
            rude.connect(d.endpoint)
            peak = before
            for i in range(10_000):
                rude.send_multipart(encode_request(Request(f"r{i}", Op.INFER, "ocr-cls",
                                                           inputs={"x": X})), copy=False)
                if i % 500 == 0:
                    peak = max(peak, d.rss())
            rude.close(0)
            ctx.term()
            while c.status()["clients_in_flight"] > 1:
                peak = max(peak, d.rss())
                time.sleep(0.1)
            after = d.rss()
    finally:
        d.stop()
    print(f"3. a client sending 10,000 ocr-cls requests (1.1 GB) and never reading: RSS "
          f"{before / 2**20:.0f} MiB before, {peak / 2**20:.0f} MiB at the peak, "
          f"{after / 2**20:.0f} MiB after (before the limits: 106 -> 439 -> 439 MiB)")


def main() -> None:
    print(f"{cpu_note()}, load average {os.getloadavg()[0]:.2f} at the start")
    parts = set(sys.argv[1:]) or {"fairness", "bursts", "non_reader"}
    if "fairness" in parts:
        fairness()
    if "bursts" in parts:
        bursts()
    if "non_reader" in parts:
        non_reader()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
