"""The fuzzer of the hostile-input tests: builds hostile, mutated and random messages,
sends them over a raw DEALER socket with a bounded window in flight and checks the
replies. Runnable as a child process (``python -m tests.e2e.fuzz_kit ENDPOINT COUNT SEED
EXPECT``), so a client of another uid can be the one that sends.

Every message gets exactly one reply. Messages whose id the test knows (``k-<n>``: the
hostile headers of issue 12 and valid requests) must get exactly one reply with that id
and the expected code; no reply at all may be INTERNAL.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import zmq

TAG = b"INFERD/1"
NOBODY = 65534
VAD = [{"name": "input", "dtype": "float32", "shape": [1, 512]},
       {"name": "state", "dtype": "float32", "shape": [2, 1, 128]},
       {"name": "sr", "dtype": "int64", "shape": []}]
VAD_FRAMES = [np.zeros((1, 512), np.float32).tobytes(),
              np.zeros((2, 1, 128), np.float32).tobytes(), np.array(16000, np.int64).tobytes()]


def _infer(spec: str) -> bytes:
    return b'"op":"infer","model":"ocr-cls","inputs":[' + spec.encode() + b"]}"


# The rest of each hostile header after '{"id":"<id>",' and its tensor frames.
HOSTILE: list[tuple[str, bytes, list[bytes]]] = [
    ("5000 digits", b'"op":"ping","n":' + b"9" * 5000 + b"}", []),
    ("-5000 digits", b'"op":"ping","n":-' + b"9" * 5000 + b"}", []),
    ("1000-deep array", b'"op":"ping","n":' + b"[" * 1000 + b"]" * 1000 + b"}", []),
    ("100,000-deep array", b'"op":"ping","n":' + b"[" * 100_000 + b"]" * 100_000 + b"}", []),
    ("deep objects", b'"op":"ping","n":' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}", []),
    ("unterminated", b'"op":"ping","n":' + b"[" * 5000, []),
    ("NaN", b'"op":"ping","timeout_ms":NaN}', []),
    ("Infinity", b'"op":"ping","timeout_ms":Infinity}', []),
    ("-Infinity", b'"op":"infer","model":"vad","timeout_ms":-Infinity}', []),
    ("1e400", b'"op":"ping","timeout_ms":1e400}', []),
    ("keep_alive 10**400", b'"op":"infer","model":"vad","keep_alive":1' + b"0" * 400 + b"}",
     []),
    ("dim 2**62", _infer('{"name":"x","dtype":"float32","shape":[%d]}' % 2**62), [b""]),
    ("dims overflow", _infer('{"name":"x","dtype":"uint8","shape":[%d,%d,0]}'
                             % (2**62, 2**62)), [b""]),
    ("rank 70", _infer('{"name":"x","dtype":"float32","shape":[%s]}'
                       % ",".join(["1"] * 70)), [b""]),
    ("string 2e8", _infer('{"name":"s","dtype":"string","shape":[200000000]}'), [b""]),
    ("string lies", _infer('{"name":"s","dtype":"string","shape":[2]}'),
     [b"\xff\xff\xff\x7f" + b"x" * 8]),
    ("missing op", b'"model":"vad"}', []),
    ("op list", b'"op":["ping"]}', []),
    ("header 100 KiB", b'"op":"ping","pad":"' + b"x" * 100_000 + b'"}', []),
    ("shape floats", _infer('{"name":"x","dtype":"float32","shape":[1.5]}'), [b""]),
    ("frames missing", _infer('{"name":"x","dtype":"float32","shape":[1,3,48,192]}'), []),
    ("wrong shape", b'"op":"infer","model":"ocr-cls","inputs":[{"name":"x","dtype":'
                    b'"float32","shape":[1]}]}', [b"\0" * 4]),
    ("bad keep_alive", b'"op":"infer","model":"vad","keep_alive":"soon"}', []),
    ("bad version", b'"op":"infer","model":"vad","version":-1}', []),
    ("bad name", b'"op":"infer","model":"../../etc/passwd"}', []),
]


def _header(rid: str, rest: bytes) -> bytes:
    return b'{"id":"' + rid.encode() + b'",' + rest


def _valid(rid: str, rng: random.Random) -> tuple[list[bytes], set[str]]:
    """A valid request and the codes its reply may have."""
    r = rng.random()
    if r < 0.5:
        return [TAG, _header(rid, b'"op":"ping"}')], {"ok"}
    if r < 0.6:
        return [TAG, _header(rid, b'"op":"models"}')], {"ok"}
    head = {"id": rid, "op": "infer", "model": "vad", "inputs": VAD}
    # A full queue or a per-peer limit may refuse it: that is a reply too.
    return [TAG, json.dumps(head).encode(), *VAD_FRAMES], {"ok", "RESOURCE_EXHAUSTED"}


def _mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    out = list(frames)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(8)
        i = rng.randrange(len(out)) if out else 0
        if kind <= 2 and out:  # flip bytes
            b = bytearray(out[i])
            for _ in range(rng.randint(1, 4)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            out[i] = bytes(b)
        elif kind == 3 and out:  # truncate
            out[i] = out[i][:rng.randrange(len(out[i]) + 1)]
        elif kind == 4 and out:  # insert junk
            pos = rng.randrange(len(out[i]) + 1)
            junk = rng.choice([b"[", b"{", b'"', b"\\", b"9" * 30, b"\xff", b",", b"null"])
            out[i] = out[i][:pos] + junk * rng.randint(1, 50) + out[i][pos:]
        elif kind == 5 and out:  # drop a frame
            del out[i]
        elif kind == 6:  # add a frame
            out.insert(i, rng.randbytes(rng.randrange(64)))
        else:  # an empty first frame (a REQ-style delimiter)
            out.insert(0, b"")
    return out or [b""]


def _random(rng: random.Random) -> list[bytes]:
    frames = [rng.randbytes(rng.randrange(48)) for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.5:
        frames[0] = TAG
    return frames


class Fuzzer:
    """Sends ``count`` messages; ``refused`` means every reply must be PERMISSION_DENIED."""

    def __init__(self, endpoint: str, seed: int, refused: bool = False,
                 window: int = 48) -> None:
        self.rng = random.Random(seed)
        self.refused = refused
        self.window = window
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.expect: dict[str, set[str]] = {}
        self.got: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.problems: list[str] = []
        self.sent = self.replies = 0
        self._n = 0

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def _message(self) -> list[bytes]:
        self._n += 1
        rid = f"k-{self._n}"
        r = self.rng.random()
        if r < 0.3:
            name, rest, tensors = self.rng.choice(HOSTILE)
            # Only a well-formed request with the wrong shape reaches a model's queue.
            self.expect[rid] = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"} \
                if name == "wrong shape" else {"INVALID_ARGUMENT"}
            frames = [TAG, _header(rid, rest), *tensors]
        elif r < 0.5:
            frames, codes = _valid(rid, self.rng)
            self.expect[rid] = codes
        elif r < 0.85:
            base, _ = _valid(f"m-{self._n}", self.rng)
            if self.rng.random() < 0.3:
                _, rest, tensors = self.rng.choice(HOSTILE)
                base = [TAG, _header(f"m-{self._n}", rest), *tensors]
            return _mutate(base, self.rng)
        else:
            return _random(self.rng)
        if self.refused:
            self.expect[rid] = {"PERMISSION_DENIED"}
        return frames

    def _receive(self, timeout_ms: int) -> bool:
        if not self.sock.poll(timeout_ms):
            return False
        frames = self.sock.recv_multipart()
        if frames and frames[0] == b"":
            frames = frames[1:]
        self.replies += 1
        if len(frames) < 2 or frames[0] != TAG:
            self.problems.append(f"malformed reply {frames[:2]!r}")
            return True
        head = json.loads(frames[1])
        code = head["error"]["code"] if head.get("status") == "error" else "ok"
        self.codes[code] += 1
        rid = head.get("id", "")
        if code == "INTERNAL":
            self.problems.append(f"INTERNAL for {rid!r}: {head['error']['message'][:200]}")
        if self.refused and code != "PERMISSION_DENIED":
            self.problems.append(f"refused peer got {code} for {rid!r}")
        if rid in self.expect:
            self.got[rid] += 1
            if self.got[rid] > 1:
                self.problems.append(f"second reply for {rid}")
            elif code not in self.expect[rid]:
                self.problems.append(f"{rid}: {code} not in {sorted(self.expect[rid])}: "
                                     f"{json.dumps(head)[:200]}")
        return True

    def run(self, count: int, deadline_s: float = 600.0) -> dict[str, Any]:
        end = time.monotonic() + deadline_s
        while self.sent < count:
            while self.sent - self.replies >= self.window:
                if not self._receive(30_000):
                    self.problems.append("no reply within 30 s")
                    return self.result()
            self.sock.send_multipart(self._message(), copy=False)
            self.sent += 1
            while self._receive(0):
                pass
        while self.replies < self.sent and time.monotonic() < end:
            if not self._receive(30_000):
                break
        return self.result()

    def result(self) -> dict[str, Any]:
        missing = [rid for rid in self.expect if self.got[rid] != 1]
        return {"sent": self.sent, "replies": self.replies, "codes": dict(self.codes),
                "known": len(self.expect), "known_without_one_reply": missing[:20],
                "missing_count": len(missing), "problems": self.problems[:20],
                "problem_count": len(self.problems)}


def become_nobody() -> None:
    """Drop to uid/gid 65534 after the imports (the interpreter may live where nobody
    cannot read); the socket's peer credentials are taken at connect, after this."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


if __name__ == "__main__":
    endpoint, count, seed, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if mode == "refused":
        become_nobody()
    fuzzer = Fuzzer(endpoint, seed, refused=mode == "refused")
    try:
        print(json.dumps(fuzzer.run(count)))
    finally:
        fuzzer.close()
