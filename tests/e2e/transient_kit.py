"""Many connections sending one big request each, all at once (issue 31 item 9):
``python -m tests.e2e.transient_kit ENDPOINT COUNT client|raw`` prints a JSON summary of
what each connection got. The model is ``max`` (:func:`max_model`: ``x`` [N, M] float32
-> ``y``, the largest of each row).

- ``client``: COUNT threads, each with a :class:`~inferd.ipc.Client` of its own, start
  together (a barrier) and infer ``max`` on one 1x4915200 float32 tensor (19.7 MB, the
  bytes of an ocr-det request of 1x3x1280x1280); the codes of the replies, and how many
  results were right.
- ``raw``: COUNT DEALER sockets, as a client with only libzmq, each send the same request
  in frames; each is watched until it gets a reply or its connection is closed by the
  daemon (a socket monitor's ``EVENT_DISCONNECTED``), up to 120 s.

:class:`Peak` measures what a flood makes the daemon hold (the test and
``bench/bench_hostile.py``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from inferd.ipc import Client, RequestError
from inferd.ipc.protocol import Op, Request, decode_reply, encode_request

X = np.arange(4_915_200, dtype=np.float32).reshape(1, -1)  # 19.7 MB
WAIT_S = 120.0
MODEL = "max"


def own_rss(pid: int) -> int:
    """The process's resident bytes of its own: anonymous and file pages, not the shared
    memory it maps (``RssShmem``: the clients' regions)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"] + fields["RssFile"]


class Peak:
    """The peak of :func:`own_rss` of ``pid`` while it runs (a thread sampling every
    2 ms), above what it was when started."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = own_rss(pid)
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="test-rss")
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, own_rss(self.pid))

    def growth(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def max_model(path: Path) -> None:
    """An ONNX model ``x`` [N, M] float32 -> ``y`` [N, 1], the largest element of each row:
    a big request whose reply is small (exact, so a result can be checked bit for bit)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=1)], "max",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "M"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def with_clients(endpoint: str, count: int) -> dict[str, object]:
    codes: Counter[str] = Counter()
    same = 0
    lock = threading.Lock()
    start = threading.Barrier(count)

    def one() -> None:
        nonlocal same
        with Client(endpoint, timeout=WAIT_S, max_in_flight=1) as c:
            c.ping()  # connected before the barrier: the requests go together
            start.wait()
            try:
                y = c.infer(MODEL, {"x": X})["y"]
                code, equal = "OK", np.array_equal(y, X.max(axis=1, keepdims=True))
            except RequestError as e:
                code, equal = str(e.code), False
        with lock:
            codes[code] += 1
            same += equal

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"codes": dict(codes), "identical": same}


def raw(endpoint: str, count: int) -> dict[str, object]:
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * count + 64)
    socks, monitors = [], []
    codes: Counter[str] = Counter()
    try:
        for _ in range(count):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            monitors.append(s.get_monitor_socket(zmq.EVENT_CONNECTED |
                                                 zmq.EVENT_DISCONNECTED))
            s.connect(endpoint)
            socks.append(s)
        poller = zmq.Poller()
        for m in monitors:
            poller.register(m, zmq.POLLIN)
        connected: set[int] = set()
        give_up = time.monotonic() + WAIT_S
        while len(connected) < count and time.monotonic() < give_up:
            for m, _ in poller.poll(100):
                if recv_monitor_message(m)["event"] == zmq.EVENT_CONNECTED:
                    connected.add(monitors.index(m))
        for i, s in enumerate(socks):
            s.send_multipart(encode_request(Request(f"c{i}", Op.INFER, model=MODEL,
                                                    inputs={"x": X})), copy=False)
            poller.register(s, zmq.POLLIN)
        open_ = set(range(count))
        while open_ and time.monotonic() < give_up:
            for sock, _ in poller.poll(100):
                if sock in monitors:
                    i = monitors.index(sock)
                    event = recv_monitor_message(sock)["event"]
                    if event == zmq.EVENT_DISCONNECTED and i in open_:
                        open_.discard(i)
                        codes["closed by the daemon"] += 1
                    continue
                i = socks.index(sock)
                reply = decode_reply(sock.recv_multipart(copy=False))
                if i in open_:
                    open_.discard(i)
                    codes[str(reply.error.code) if reply.error else "OK"] += 1
        codes["no answer"] += len(open_)
    finally:
        for s in socks:
            s.disable_monitor()
            s.close(0)
        for m in monitors:
            m.close(0)
        ctx.term()
    return {"codes": {k: v for k, v in codes.items() if v}}


if __name__ == "__main__":
    endpoint, count, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    run = with_clients if mode == "client" else raw
    print(json.dumps(run(endpoint, count)))
