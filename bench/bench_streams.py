"""Stateful streams (issue 32): 16 Silero VAD streams at real time, three ways, in one run.

Each way runs 16 client processes (separate applications, as in the field), each
feeding its own audio at real time: 512 samples (32 ms at 16 kHz) every 32 ms on an
absolute schedule (a late chunk is sent at once, never skipped), for ``SECONDS`` of audio.

1. **in-process**: 16 loops, each with its own onnxruntime session (1 thread) carrying
   the state and the 64-sample context itself, as silero-vad's ``OnnxWrapper`` does:
   the baseline;
2. **before**: the same 16 streams through the daemon with each client carrying its
   state and context (the way before streams, on a copy of the model without its
   model.toml, as the demo model was): it sends ``input`` [1, 576] (context + chunk),
   ``state`` [2, 1, 128] and ``sr`` and gets ``output`` and ``stateN`` back;
3. **stream**: the same through the daemon's streams (``client.stream("vad",
   sr=16000)``): the client sends the 512 new samples and gets one probability.

The daemon's two ways run three times: with every stream's chunks due at the same moment
(all clients start at one barrier: a burst of 16 chunks every 32 ms, the worst case for
latency and the best for batching); *staggered*, each stream's schedule shifted by 1/16
of the period; and at a *random phase*, each stream's schedule shifted by its own
offset drawn uniformly within one period (seeded: :data:`PHASE_SEED`; the offsets are
printed), as real microphones, opened at unrelated moments, are.

Printed for each way: CPU per chunk of the daemon (its process, and the zygote and
workers under it: psutil, user + system), of the clients (each its own
``time.process_time``), and in all; p50 / p99 latency of a
chunk (the client's round trip, or the loop's run; the p99 also past the first 2 s,
while the adaptive batcher is still measuring); then the ratios the issue targets
(the stream's total CPU <= 2x the in-process loops' and below the before figure; its
p99 <= 5 ms, beside the burst's CPU spread over this machine's cores, which the
p99 of chunks due at once cannot beat) and the bytes on the wire per chunk each way
(frames as encoded by ipc/protocol.py, headers included). The load average is printed
beside them: on this shared 2-core machine the figures move with it.

Run: ``.venv/bin/python bench/bench_streams.py`` (about 80 s).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, ROOT, DaemonProcess, cpu_note, pct, verdict  # noqa: E402

from inferd.ipc import Client  # noqa: E402
from inferd.ipc.protocol import (  # noqa: E402
    Op, Reply, Request, StreamRef, encode_reply, encode_request,
)

STREAMS = 16
SECONDS = 10.0
CHUNK = 512
CONTEXT = 64
PERIOD = CHUNK / 16000  # 32 ms
SETTLE_S = 2.0
"""The p99 is printed also without the first seconds of each stream, while the daemon's
adaptive batcher measures what batches cost (the slow chunks cluster there)."""
SR = np.array(16000, np.int64)


def audio(seed: int, chunks: int) -> np.ndarray:
    """CHUNKS chunks of speech-like noise bursts, different for each stream."""
    rng = np.random.default_rng(seed)
    t = np.arange(chunks * CHUNK) / 16000
    bursts = (np.sin(2 * np.pi * (0.3 + 0.05 * seed) * t) > 0).astype(np.float32)
    voice = 0.3 * np.sin(2 * np.pi * (120 + 10 * seed) * t)
    return (bursts * voice + 0.01 * rng.standard_normal(t.size)).astype(np.float32) \
        .reshape(chunks, 1, CHUNK)


PHASE_SEED = 32
"""The seed of the random-phase arm's offsets (numpy's default_rng)."""

ALL_AT_ONCE = [0.0] * STREAMS
STAGGERED = [seed * PERIOD / STREAMS for seed in range(STREAMS)]
RANDOM_PHASE = [float(v) for v in np.random.default_rng(PHASE_SEED).uniform(0, PERIOD,
                                                                          STREAMS)]
PHASES = ALL_AT_ONCE
"""Each stream's offset from the barrier, in seconds: all due at once (a burst of
STREAMS chunks every period, the worst case for latency), spread evenly, or at random
within the period. Set by run_way before it forks the clients."""


def paced(chunks: np.ndarray, step: Any, seed: int) -> list[float]:
    """``step(chunk)`` for each chunk at real time; the seconds each took."""
    times = []
    t0 = time.perf_counter() + PHASES[seed]
    for k, x in enumerate(chunks):
        wait = t0 + k * PERIOD - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        a = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - a)
    return times


def measure(data: np.ndarray, step: Any, seed: int, results: Any, barrier: Any) -> None:
    """One warm-up chunk, then, once every client is ready, ``data`` at real time: puts
    (this process's CPU seconds, each chunk's seconds) on ``results``."""
    step(data[0])
    barrier.wait()
    cpu = time.process_time()
    times = paced(data, step, seed)
    results.put((time.process_time() - cpu, times))


def in_process(seed: int, chunks: int, results: Any, barrier: Any) -> None:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    session = ort.InferenceSession(str(MODELS / "vad" / "1" / "model.onnx"), so,
                                   providers=["CPUExecutionProvider"])
    carried = {"state": np.zeros((2, 1, 128), np.float32),
               "context": np.zeros((1, CONTEXT), np.float32)}

    def step(x: np.ndarray) -> None:
        full = np.concatenate([carried["context"], x], axis=1)
        _, carried["state"] = session.run(None, {"input": full, "state": carried["state"],
                                                 "sr": SR})
        carried["context"] = full[:, -CONTEXT:]

    measure(audio(seed, chunks), step, seed, results, barrier)


def before(endpoint: str, seed: int, chunks: int, results: Any, barrier: Any) -> None:
    data = audio(seed, chunks)
    with Client(endpoint, timeout=60) as c:
        carried = {"state": np.zeros((2, 1, 128), np.float32),
                   "context": np.zeros((1, CONTEXT), np.float32)}

        def step(x: np.ndarray) -> None:
            full = np.concatenate([carried["context"], x], axis=1)
            out = c.infer("vad-carried", {"input": full, "state": carried["state"],
                                          "sr": SR})
            carried["state"] = out["stateN"]
            carried["context"] = full[:, -CONTEXT:]

        measure(data, step, seed, results, barrier)


def streamed(endpoint: str, seed: int, chunks: int, results: Any, barrier: Any) -> None:
    data = audio(seed, chunks)
    with Client(endpoint, timeout=60) as c, c.stream("vad", sr=16000) as s:
        def step(x: np.ndarray) -> None:
            s.infer({"input": x})

        measure(data, step, seed, results, barrier)


def daemon_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the daemon process, and of every process under it (the zygote
    and the workers, where the engines run)."""
    import psutil

    root = psutil.Process(pid)
    own = root.cpu_times()
    below = 0.0
    for p in root.children(recursive=True):
        try:
            t = p.cpu_times()
            below += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return own.user + own.system, below


def run_way(target: Any, args: tuple[Any, ...], daemon: DaemonProcess | None,
            chunks: int, phases: list[float] = ALL_AT_ONCE) -> dict[str, Any]:
    """STREAMS processes of ``target(*args, seed, chunks, results, barrier)``, stream
    ``seed`` starting ``phases[seed]`` seconds after the barrier; the figures of the
    measured window (after every process warmed up)."""
    global PHASES
    PHASES = phases  # the forked clients read it
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(STREAMS + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, seed, chunks, results, barrier))
             for seed in range(STREAMS)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    while barrier.n_waiting < STREAMS:
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            barrier.abort()
            for p in procs:
                p.kill()
            raise SystemExit(f"a {target.__name__} client failed before the start")
        time.sleep(0.01)
    m0, w0 = daemon_cpu(daemon.proc.pid) if daemon else (0.0, 0.0)
    barrier.wait()
    t0 = time.perf_counter()
    got = [results.get(timeout=SECONDS * 4 + 60) for _ in procs]
    wall = time.perf_counter() - t0
    m1, w1 = daemon_cpu(daemon.proc.pid) if daemon else (0.0, 0.0)
    for p in procs:
        p.join()
    n = STREAMS * chunks
    latencies = [t for _, times in got for t in times]
    settled = [t for _, times in got for t in times[int(SETTLE_S / PERIOD):]]
    client = sum(cpu for cpu, _ in got)
    d = m1 - m0 + w1 - w0
    return {"daemon": d / n, "main": (m1 - m0) / n, "workers": (w1 - w0) / n,
            "clients": client / n, "total": (d + client) / n,
            "p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99),
            "p99_settled": pct(settled, 0.99), "wall": wall,
            "late": sum(t > PERIOD for t in latencies)}


def wire_bytes() -> dict[str, tuple[int, int]]:
    """(request, reply) bytes per chunk each way: every frame, tag and header included."""
    def size(frames: list[Any]) -> int:
        return sum(len(memoryview(f).cast("B")) for f in frames)

    x = np.zeros((1, CHUNK), np.float32)
    full = np.zeros((1, CHUNK + CONTEXT), np.float32)
    state = np.zeros((2, 1, 128), np.float32)
    out = np.zeros((1, 1), np.float32)
    rid = "0123abcd-1234"
    carried = encode_request(Request(rid, Op.INFER, "vad", inputs={
        "input": full, "state": state, "sr": SR}, timeout_ms=30000))
    stream = encode_request(Request(rid, Op.INFER, "vad", inputs={"input": x},
                                    timeout_ms=30000, stream=StreamRef("s0123456789abcdef")))
    return {"before": (size(carried), size(encode_reply(Reply(rid, outputs={
                "output": out, "stateN": state})))),
            "stream": (size(stream), size(encode_reply(Reply(rid, outputs={"output": out}))))}


def repo() -> Path:
    path = Path(tempfile.mkdtemp(prefix="inferd-bs", dir="/tmp"))
    shutil.copytree(MODELS / "vad" / "1", path / "vad" / "1")
    # the same model as it was before streams: no model.toml, each client carries it all
    shutil.copytree(MODELS / "vad" / "1", path / "vad-carried" / "1")
    shutil.copyfile(ROOT / "examples" / "models" / "vad" / "model.toml",
                    path / "vad" / "model.toml")
    return path


def show(name: str, f: dict[str, Any]) -> None:
    daemon = (f"daemon {f['daemon'] * 1e6:6.1f} µs (its process {f['main'] * 1e6:5.1f}, "
              f"workers {f['workers'] * 1e6:5.1f}), " if name != "in-process" else " " * 53)
    print(f"   {name:17s} CPU per chunk: {daemon}clients {f['clients'] * 1e6:6.1f} µs, "
          f"total {f['total'] * 1e6:6.1f} µs;  latency p50 {f['p50'] * 1e3:5.2f} ms, "
          f"p99 {f['p99'] * 1e3:5.2f} ms, past the first {SETTLE_S:g} s "
          f"{f['p99_settled'] * 1e3:5.2f} ms ({f['late']} chunks over 32 ms)")


def main() -> None:
    chunks = int(SECONDS / PERIOD)
    print(f"bench_streams: {cpu_note()}; {STREAMS} streams x {chunks} chunks of {CHUNK} "
          f"samples at real time ({SECONDS:g} s of audio each); load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    path = repo()
    conf = path / "inferd.toml"
    conf.write_text('[metrics]\ntextfile = ""\n[placement]\nmode = "first"\n')
    figures = {"in-process": run_way(in_process, (), None, chunks)}
    d = DaemonProcess("--models", str(path), "--preload", "vad,vad-carried", config=conf)
    try:
        figures["before"] = run_way(before, (d.endpoint,), d, chunks)
        figures["stream"] = run_way(streamed, (d.endpoint,), d, chunks)
        figures["before, staggered"] = run_way(before, (d.endpoint,), d, chunks, STAGGERED)
        figures["stream, staggered"] = run_way(streamed, (d.endpoint,), d, chunks, STAGGERED)
        figures["before, random"] = run_way(before, (d.endpoint,), d, chunks, RANDOM_PHASE)
        figures["stream, random"] = run_way(streamed, (d.endpoint,), d, chunks, RANDOM_PHASE)
    finally:
        d.stop()
        shutil.rmtree(path, ignore_errors=True)
    print("\n1. CPU per chunk and chunk latency")
    for name, f in figures.items():
        show(name, f)
    s, b, i = figures["stream"], figures["before"], figures["in-process"]
    print("\n2. ratios")
    print(f"   stream total CPU / in-process: {verdict(s['total'] / i['total'], 2.0, False)}")
    print(f"   stream total CPU / before:     {verdict(s['total'] / b['total'], 1.0, False)}")
    print(f"   stream p99 latency: {s['p99'] * 1e3:.2f} ms (target <= 5 ms) "
          f"{'MET' if s['p99'] <= 0.005 else 'MISSED'}; past the first {SETTLE_S:g} s "
          f"{s['p99_settled'] * 1e3:.2f} ms; before p99 {b['p99'] * 1e3:.2f} ms "
          "(all streams' chunks due at once)")
    # The last chunk of a burst is answered no sooner than about the burst's CPU
    # (daemon, workers and the 16 clients, all on this machine's cores) can be spent:
    # a floor under the p99 that no scheduling beats (about: a client's CPU before its
    # send is counted in it, and the work of one burst may run into the next period)
    cores = len(os.sched_getaffinity(0))
    floor = STREAMS * s["total"] / cores
    print(f"   the burst's floor, about: {STREAMS} chunks x {s['total'] * 1e6:.0f} µs of CPU each "
          f"over {cores} cores = {floor * 1e3:.2f} ms before the last chunk can be "
          f"answered (the p99 target needs at most {0.005 * cores / STREAMS * 1e6:.0f} µs "
          f"a chunk in all here; the in-process loops spend {i['total'] * 1e6:.0f})")
    ss, bs = figures["stream, staggered"], figures["before, staggered"]
    print(f"   staggered (each stream's chunks due at its own moment): stream total CPU / "
          f"in-process {verdict(ss['total'] / i['total'], 2.0, False)}, / before "
          f"{verdict(ss['total'] / bs['total'], 1.0, False)}; p99 {ss['p99'] * 1e3:.2f} ms "
          f"{'MET' if ss['p99'] <= 0.005 else 'MISSED'} (before {bs['p99'] * 1e3:.2f} ms)")
    rs, rb = figures["stream, random"], figures["before, random"]
    print(f"   random phase (each stream's offset in ms, seed {PHASE_SEED}: "
          f"{' '.join(f'{v * 1e3:.1f}' for v in RANDOM_PHASE)}): stream total CPU / "
          f"in-process {verdict(rs['total'] / i['total'], 2.0, False)}, / before "
          f"{verdict(rs['total'] / rb['total'], 1.0, False)}; p99 {rs['p99'] * 1e3:.2f} ms "
          f"{'MET' if rs['p99'] <= 0.005 else 'MISSED'}, past the first {SETTLE_S:g} s "
          f"{rs['p99_settled'] * 1e3:.2f} ms (before {rb['p99'] * 1e3:.2f} ms)")
    print("\n3. bytes on the wire per chunk (request + reply, frames as encoded)")
    for name, (req, rep) in wire_bytes().items():
        print(f"   {name:7s} {req:5d} B in + {rep:5d} B out = {req + rep:5d} B")
    print(f"\n(load average {os.getloadavg()[0]:.2f} at the end)")


if __name__ == "__main__":
    main()
