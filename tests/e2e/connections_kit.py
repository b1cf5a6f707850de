"""A local process that opens many connections to the daemon at once (issue 18, defect
1): ``python -m tests.e2e.connections_kit ENDPOINT COUNT HOLD_S [ping|big] [all] [nobody]``
opens COUNT DEALER connections as fast as it can, with ``ping`` sends a ping on each
(with ``big``, one ocr-det request of 1x3x1280x1280 float32, 19.7 MB),
holds them HOLD_S seconds (collecting replies; with ``all``, until every ping has its
reply, up to 300 s), closes them and prints a JSON summary:
how many opened and the reply codes. ``nobody`` drops to uid 65534 after the imports
(a peer the allow-list refuses). It raises its own open-files limit to the hard one."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter

import numpy as np
import zmq

from inferd.ipc.protocol import Op, Request, decode_reply, encode_request
from tests.e2e.fuzz_kit import become_nobody


BIG = np.zeros((1, 3, 1280, 1280), np.float32)


def main(endpoint: str, count: int, hold: float, send: str | None, every: bool
         ) -> dict[str, object]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, count + 64)
    socks = []
    codes: Counter[str] = Counter()
    started = time.monotonic()
    try:
        for i in range(count):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            if send == "ping":
                s.send_multipart(encode_request(Request(f"c{i}", Op.PING)), copy=False)
            elif send == "big":
                s.send_multipart(encode_request(Request(f"c{i}", Op.INFER, model="ocr-det",
                                                        inputs={"x": BIG})), copy=False)
            socks.append(s)
        opened = time.monotonic() - started
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        end = time.monotonic() + hold
        last = time.monotonic() + 300
        while ((left := end - time.monotonic()) > 0
               or (every and sum(codes.values()) < count and time.monotonic() < last)):
            left = max(left, 0.1)
            for s, _ in poller.poll(left * 1000):
                reply = decode_reply(s.recv_multipart(copy=False))
                codes[str(reply.error.code) if reply.error else "OK"] += 1
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    return {"opened": len(socks), "open_s": round(opened, 3), "codes": dict(codes)}


if __name__ == "__main__":
    args = sys.argv[1:]
    if "nobody" in args:
        become_nobody()
    send = next((a for a in args[3:] if a in ("ping", "big")), None)
    print(json.dumps(main(args[0], int(args[1]), float(args[2]), send, "all" in args)))
