"""Helpers shared by the benchmarks: a daemon process, an identity model, statistics."""

from __future__ import annotations

import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def make_identity_model(repo: Path, name: str = "identity", rank: int = 1,
                        then_cast: bool = False) -> Path:
    """A one-node ONNX model (Identity on float32, dynamic dims of the given rank) at
    repo/name/1/model.onnx; ``then_cast``: followed by a Cast to float32, which
    onnxruntime drops, but which is no address-free op (the backend aligns the input)."""
    import onnx
    from onnx import TensorProto, helper

    dims = [f"d{i}" for i in range(rank)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    nodes = [helper.make_node("Identity", ["x"], ["t" if then_cast else "y"])]
    if then_cast:
        nodes.append(helper.make_node("Cast", ["t"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, name, [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = repo / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


class DaemonProcess:
    """``inferd`` in a child process on a private ipc socket, ready when constructed.

    Args:
        args: more command-line arguments (``--models DIR``, ``--preload M``...).
        config: the config file; default an empty one (the built-in defaults), never the
            host's /etc/inferd/inferd.toml.
    """

    def __init__(self, *args: str, config: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="inferd-b", dir="/tmp"))
        self.endpoint = f"ipc://{self.dir}/inferd.sock"
        if config is None:
            config = self.dir / "inferd.toml"
            config.touch()
        self.log_path = self.dir / "inferd.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inferd.daemon.main", "--socket", self.endpoint,
                 "--config", str(config), "--log-level", "warning", *args],
                stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        from inferd.ipc import Client, RequestError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with Client(self.endpoint, timeout=1) as c:
                    if c.ping()["ready"]:
                        return
            except RequestError:
                time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        raise SystemExit(f"inferd did not become ready (exit {self.proc.returncode}):\n"
                         f"{self.log_path.read_text(errors='replace')}")

    def rss(self) -> int:
        import psutil
        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def settle_placement(endpoint: str, work: Any, timeout: float = 900.0) -> tuple[float, int]:
    """Call ``work(client)`` (a few requests: the first requests whose inputs measured
    placement measures on), then wait until no model of the daemon at ``endpoint`` is
    still being measured (``placement_status``), calling ``work`` again only while a
    model has not been measured for 30 s (its requests may not have come): the
    one-off cost of measured placement, once per model per machine. Returns the
    seconds it took and how many times ``work`` ran."""
    from inferd.ipc import Client

    started, n = time.monotonic(), 0
    last = -math.inf
    with Client(endpoint, timeout=300) as c:
        while True:
            if time.monotonic() - last > 30:
                work(c)
                n += 1
                last = time.monotonic()
            if not any(m.get("placement_status") == "measuring" for m in c.models()):
                return time.monotonic() - started, n
            if time.monotonic() - started > timeout:
                raise SystemExit(f"placement still measuring after {timeout:.0f} s")
            time.sleep(0.5)


def placements(endpoint: str, why: bool = False) -> dict[str, str]:
    """``model: backend (N threads) [status]`` of every loaded model; with ``why``, the
    placement's whole ``chosen`` text instead (the measured figures)."""
    from inferd.ipc import Client

    with Client(endpoint, timeout=60) as c:
        return {m["name"]: (m["chosen"] if why else f"{m['backend']}"
                            + (f" ({m['engine_threads']} threads)"
                               if m.get("engine_threads") else "")
                            + f" [{m.get('placement_status')}]")
                for m in c.models() if m.get("backend")}


def toml_with(text: str, table: str, line: str) -> str:
    """``text`` (a model.toml) with ``line`` (``key = value``) added to its ``[table]``,
    made at the end when it has none (a second ``[table]`` header is a TOML error, and
    the shipped model.toml may have one: ocr-det's ``[openvino]``)."""
    header = f"[{table}]\n"
    if header in text:
        return text.replace(header, header + line + "\n", 1)
    return text + ("\n" if text and not text.endswith("\n") else "") + header + line + "\n"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:8.1f} µs"


def verdict(ratio: float, target: float, higher_is_better: bool) -> str:
    ok = ratio >= target if higher_is_better else ratio <= target
    sign = ">=" if higher_is_better else "<="
    return f"ratio {ratio:.2f} (target {sign} {target}) {'MET' if ok else 'MISSED'}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def cpu_note() -> str:
    return f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}"


def rapidocr(batch: list[Any], **options: Any) -> tuple[float, list[list[str]]]:
    """RapidOCR 1.4.4 (``options`` for its constructor), warmed on the first image, then
    run over ``batch`` one image at a time: (seconds, the texts of each image)."""
    from rapidocr_onnxruntime import RapidOCR

    engine = RapidOCR(**options)
    engine(batch[0])
    t0 = time.perf_counter()
    texts = []
    for im in batch:
        result, _ = engine(im)
        texts.append([r[1] for r in result] if result else [])
    return time.perf_counter() - t0, texts


def ocr_stream(client: Any, batch: list[Any]) -> tuple[float, list[list[str]]]:
    """The OCR graph over ``batch`` with every image in flight at once (``client``: a
    connected inferd Client): (seconds, the texts of each image), as :func:`rapidocr`."""
    t0 = time.perf_counter()
    pending = [client.submit("infer", "ocr", inputs={"image": im}) for im in batch]
    texts = [p.result()["texts"].tolist() for p in pending]
    return time.perf_counter() - t0, texts


def cls_client(endpoint: str, x: Any, n: int, barrier: Any) -> None:
    """A client process of :func:`run_client_processes`: one ocr-cls request to warm
    up, the start barrier, then ``n`` requests one at a time."""
    from inferd.ipc import Client

    with Client(endpoint, timeout=60) as c:
        c.infer("ocr-cls", {"x": x})
        barrier.wait()
        for _ in range(n):
            c.infer("ocr-cls", {"x": x})


def run_client_processes(target: Any, arg_lists: list[tuple[Any, ...]]) -> float:
    """Run ``target(*args, barrier)`` in one forked process per ``args`` (separate
    applications, as in the field: threads of one Python process would measure that
    process's GIL more than the daemon). Each calls ``barrier.wait()`` once warmed up;
    returns the seconds from that moment until all have finished."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(arg_lists) + 1)
    procs = [ctx.Process(target=target, args=(*args, barrier)) for args in arg_lists]
    for p in procs:
        p.start()
    while barrier.n_waiting < len(procs):  # a client that fails while warming up never
        failed = [p for p in procs if p.exitcode not in (None, 0)]  # reaches the barrier
        if failed:
            barrier.abort()
            for p in procs:
                p.kill()
                p.join()
            raise SystemExit(f"a benchmark client failed before the start (exit "
                             f"{failed[0].exitcode})")
        time.sleep(0.01)
    barrier.wait()
    t0 = time.perf_counter()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - t0
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("a benchmark client failed")
    return elapsed
