"""libinferd's reply handling against a fake ROUTER (a Python ROUTER socket plays the
daemon): a bounded fuzz of random and mutated replies, each judged by the C library and
by the Python client's ``decode_reply`` and required to agree; out-of-order replies;
the client's in-flight limit; shared-memory tensors as docs/protocol.md describes them
(the router serves the registration socket too). Run as built and under ASan + UBSan
(fast group)."""

from __future__ import annotations

import array
import json
import mmap
import os
import random
import re
import struct
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.ipc.dtypes import WIRE_DTYPES, dtype_name, wire_size
from inferd.ipc.errors import ErrorCode, ProtocolError
from inferd.ipc.header import parse as parse_header
from inferd.ipc.protocol import TAG, decode_reply
from tests.ipc import libinferd_kit as kit

CASES = {"plain": 4000, "sanitize": 1500}
"""Fuzz cases per build (each a round trip through real sockets; a few seconds)."""


@pytest.fixture(scope="module", params=["plain", "sanitize"])
def peer(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, kit.build(request.param) / "router_peer"


# ---------------------------------------------------------------- generated replies


def fnv1a(data: bytes) -> str:
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def strings_frame(words: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(w.encode())) + w.encode() for w in words)


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.randrange(-2**63, 2**63)
    if kind == 1:
        return rng.choice([0.5, -1e300, 3.141592653589793, 1e-310, rng.random()])
    if kind == 2:
        return rng.choice(["", "x", "Zürich", "\u65e5", "\U0001f600", "a\"b\\c\n"])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.randrange(0, 1000)
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def random_output(rng: random.Random, name: str) -> tuple[dict[str, Any], bytes]:
    dtype = rng.choice(WIRE_DTYPES)
    shape = [rng.randrange(4) for _ in range(rng.randrange(4))]
    count = int(np.prod(shape))
    if dtype == "string":
        words = [rng.choice(["", "a", "Zürich", "\u65e5\u672c", "\U0001f600"]) for _ in
                 range(count)]
        return {"name": name, "dtype": dtype, "shape": shape}, strings_frame(words)
    data = bytes(rng.randrange(256) for _ in range(wire_size(dtype, count)))
    return {"name": name, "dtype": dtype, "shape": shape}, data


def valid_reply(rng: random.Random, rid: str) -> tuple[dict[str, Any], list[bytes]]:
    """A header and its tensor frames, as the daemon could send them."""
    kind = rng.randrange(3)
    if kind == 0:
        code = rng.choice([c.value for c in ErrorCode] + ["NO_SUCH_CODE"])
        return {"id": rid, "status": "error", "error": {"code": code, "message": rng.choice(
            ["model 'x' not found", "", "Zürich\nline two", "\u0001"])}}, []
    header: dict[str, Any] = {"id": rid, "status": "ok"}
    frames = []
    if kind == 1:
        specs = []
        for i in range(rng.randrange(4)):
            spec, data = random_output(rng, rng.choice([f"y{i}", f"out/{i}", f"名{i}"]))
            specs.append(spec)
            frames.append(data)
        header["outputs"] = specs
    else:
        header["result"] = random_json(rng)
    return header, frames


def mutate(rng: random.Random, header: dict[str, Any], frames: list[bytes],
           rid: str) -> list[bytes]:
    """The reply's frames after zero or one structural mutation and maybe byte noise."""
    tag = TAG
    m = rng.randrange(40)
    specs = header.get("outputs")
    if m == 0:
        tag = rng.choice([b"", b"INFERD/2", b"INFERD/1 ", b"x" * 100])
    elif m == 1:
        frames = frames + [rng.randbytes(rng.randrange(5))]
    elif m == 2 and frames:
        frames = frames[:-1]
    elif m == 3:
        header["id"] = rng.choice([None, 5, [rid], rid + "x", ""])
    elif m == 4:
        del header["id"]
    elif m == 5 and specs:
        rng.choice(specs)["dtype"] = rng.choice(["float128", "", 5, None, "FLOAT32"])
    elif m == 6 and specs:
        rng.choice(specs)["shape"] = rng.choice(
            [[-1], [1.0], [True], "3", None, [2**48 + 1], [2**24, 2**25], [1] * 33, [[1]]])
    elif m == 7 and specs:
        i = rng.randrange(len(specs))
        frames[i] = frames[i] + b"\0" if rng.random() < 0.5 or not frames[i] else frames[i][:-1]
    elif m == 8 and len(specs or []) > 1:
        specs[1]["name"] = specs[0]["name"]
    elif m == 9 and specs:
        rng.choice(specs)["name"] = rng.choice(["", "n" * 257, "é" * 256, "é" * 257, 7, None])
    elif m == 10:
        header["outputs"] = rng.choice([{}, "y", None, [1], [[]]])
    elif m == 11 and specs:
        i = rng.randrange(len(specs))
        specs[i] = {"name": f"s{i}", "dtype": "string", "shape": [2]}
        frames[i] = rng.choice([b"\x01\0\0\0a", b"\x01\0\0\0a\x05\0\0\0abc",
                                b"\x01\0\0\0\xff\x00\0\0\0", b"\x00\0\0\0\x00\0\0\0\0",
                                b"\x02\0\0\0\xc3\xbc\x01\0\0\0\xed\xa0\x80",
                                b"\xff\xff\xff\xff", b"\x00\x00"])
    elif m == 12:
        header["status"] = rng.choice(["error", "ok", None, "weird", 1])
    elif m == 13 and header.get("status") == "error":
        header["error"] = rng.choice([{}, {"code": 5}, {"message": "m"}, {"code": None},
                                      {"code": "NOT_FOUND", "message": 42}, []])
    elif m == 14:
        return [tag, rng.choice([b"[]", b"\"x\"", b"5", b"null", b"", b"{", b"{}}",
                                 b'{"id": "' + rid.encode() + b'" }', b"\xff\xfe",
                                 b'{"id":"' + rid.encode() + b'","x":' + b"[" * 33 +
                                 b"]" * 33 + b"}",
                                 b'{"id":"' + rid.encode() + b'","x":NaN}',
                                 b'{"id":"' + rid.encode() + b'","x":1e400}',
                                 b'{"id":"' + rid.encode() + b'","x":Infinity}'])] + frames
    elif m == 15:
        return [rng.randbytes(rng.randrange(12)) for _ in range(rng.randrange(5))]
    raw = json.dumps(header, ensure_ascii=rng.random() < 0.5,
                     separators=(",", ":") if rng.random() < 0.7 else None).encode()
    if m >= 30:  # byte noise in the header
        raw = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            op, at = rng.randrange(3), rng.randrange(len(raw) + 1)
            if op == 0 and at < len(raw):
                raw[at] = rng.randrange(256)
            elif op == 1:
                raw.insert(at, rng.choice(b'{}[]",:\\0123456789e.-ntfu\x00\xc3'))
            elif at < len(raw):
                del raw[at]
        raw = bytes(raw)
    return [tag, raw, *frames]


# jansson and Python's json differ on a few things no daemon writes; such cases are
# counted, not compared: lone surrogates and NUL in \u escapes (jansson refuses them),
# integers past int64 (jansson refuses), number literals over 64 characters (inferd's
# header parser refuses them).
_DIVERGENT = re.compile(rb"\\u0000|[-+.eE\d]{65,}")
_SURROGATES = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|"
                         rb"\\u[dD][89a-fA-F]")
_LONG_INT = re.compile(rb"-?\d{19,}")


def divergent(frames: list[bytes]) -> bool:
    if len(frames) < 2:
        return False
    lone = any(len(m) < 12 for m in _SURROGATES.findall(frames[1]))  # a pair is 12 bytes
    return lone or bool(_DIVERGENT.search(frames[1])) or any(
        not -2**63 <= int(m) < 2**63 for m in _LONG_INT.findall(frames[1]))


def expected(frames: list[bytes], rid: str) -> dict[str, Any] | None:
    """What the library must make of FRAMES for the call RID, judged by ipc/protocol.py
    (None: the Python client itself fails on it other than with ProtocolError)."""
    try:
        reply = decode_reply(frames)
    except ProtocolError:
        try:  # can the id be read? (the frames' checks come first, then the header)
            assert len(frames) >= 2 and frames[0] == TAG
            head = parse_header(frames[1], "reply", max_bytes=None)
        except (AssertionError, ProtocolError):
            return {"verdict": "dropped"}
        return {"verdict": "protocol" if head.get("id") == rid else "dropped"}
    except (AttributeError, TypeError):
        return None  # e.g. an "error" that is not an object: the Python client raises
    if reply.id != rid:
        return {"verdict": "dropped"}
    if reply.error is not None:
        err = json.loads(frames[1]).get("error") or {}
        message = err.get("message", "")
        return {"verdict": "error", "code": str(reply.error.code),
                "message": message if isinstance(message, str) else None}
    outputs = []
    for (name, value), frame in zip(reply.outputs.items(), frames[2:]):
        outputs.append({"name": name, "dtype": dtype_name(value), "shape": list(value.shape),
                        "hash": fnv1a(bytes(frame))})
    return {"verdict": "ok", "outputs": outputs, "result": reply.result}


# ---------------------------------------------------------------- the fake daemon


class Router:
    """A ROUTER on an ipc path in its own thread; HANDLE(socket, identity, frames) answers
    each request."""

    def __init__(self, folder: Path, handle: Callable[..., None]) -> None:
        self.endpoint = f"ipc://{folder}/router.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(self.endpoint)
        self.handle = handle
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="fake-router", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while not self.stop.is_set():
                if self.sock.poll(50):
                    ident, *frames = self.sock.recv_multipart()
                    self.handle(self.sock, ident, frames)
        except BaseException as e:  # reported by close()
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close()
        self.ctx.term()
        if self.error is not None:
            raise self.error


def run_peer(program: Path, kind: str, *args: str, timeout: float = 300) -> str:
    out = subprocess.run([str(program), *args], capture_output=True, text=True, timeout=timeout,
                         env=kit.program_env(kind))
    assert out.returncode == 0, f"router_peer {' '.join(args)} ({kind}) exited " \
                                f"{out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout


def request_id(frames: list[bytes]) -> str:
    assert frames[0] == TAG, frames[:1]
    return json.loads(frames[1])["id"]


def test_fuzzed_replies_are_judged_as_the_python_client_does(peer, short_tmp):
    kind, program = peer
    n = CASES[kind]
    rng = random.Random(2323 + n)
    sent: list[tuple[str, list[bytes]]] = []

    def handle(sock: zmq.Socket, ident: bytes, frames: list[bytes]) -> None:
        rid = request_id(frames)
        header, tensors = valid_reply(rng, rid)
        reply = mutate(rng, header, tensors, rid) if rng.random() < 0.85 else \
            [TAG, json.dumps(header).encode(), *tensors]
        sent.append((rid, reply))
        sock.send_multipart([ident, *reply])
        sentinel = {"id": rid, "status": "ok", "result": {"sentinel": len(sent)}}
        sock.send_multipart([ident, TAG, json.dumps(sentinel).encode()])

    router = Router(short_tmp, handle)
    try:
        lines = run_peer(program, kind, router.endpoint, "fuzz", str(n)).splitlines()
    finally:
        router.close()
    assert len(lines) == len(sent) == n
    tally: dict[str, int] = {}
    skipped = {"python fails": 0, "json dialects": 0}
    for line, (rid, frames) in zip(lines, sent):
        got = json.loads(line)
        want = expected(frames, rid)
        if want is None or divergent(frames):
            skipped["python fails" if want is None else "json dialects"] += 1
            continue
        tally[want["verdict"]] = tally.get(want["verdict"], 0) + 1
        where = f"case {got['case']}: frames {frames!r:.600}"
        assert got["verdict"] == want["verdict"], f"{where}\nC: {got}\nPython: {want}"
        if want["verdict"] == "ok":
            assert got["outputs"] == want["outputs"], where
            assert got["result"] == want["result"], where
        elif want["verdict"] == "error":
            assert got["code"] == want["code"], where
            if want["message"] is not None:
                assert got["message"] == want["message"], where
    print(f"libinferd fuzz ({kind}): {n} replies, {tally}, not compared: {skipped}")
    assert sum(skipped.values()) < n // 20
    assert min(tally.get(v, 0) for v in ("ok", "error", "protocol", "dropped")) >= n // 50


def test_out_of_order_replies_reach_their_calls(peer, short_tmp):
    kind, program = peer
    n = 60
    pending: list[tuple[bytes, list[bytes]]] = []
    rng = random.Random(5)

    def handle(sock: zmq.Socket, ident: bytes, frames: list[bytes]) -> None:
        pending.append((ident, frames))
        if len(pending) < n:
            return
        rng.shuffle(pending)
        for who, req in pending:
            head = json.loads(req[1])
            assert head["op"] == "infer" and head["model"] == "echo", head
            assert head["inputs"] == [{"name": "x", "dtype": "uint8", "shape": [1]}], head
            assert len(req) == 3 and len(req[2]) == 1
            reply = {"id": head["id"], "status": "ok",
                     "outputs": [{"name": "y", "dtype": "uint8", "shape": [1]}]}
            sock.send_multipart([who, TAG, json.dumps(reply).encode(), req[2]])

    router = Router(short_tmp, handle)
    try:
        out = run_peer(program, kind, router.endpoint, "order", str(n))
    finally:
        router.close()
    assert out.strip() == f"order ok {n}"


def test_no_more_calls_in_flight_than_the_client_allows(peer, short_tmp):
    kind, program = peer
    n, k = 40, 4
    held: list[tuple[bytes, str]] = []
    seen = {"received": 0, "most": 0}

    def handle(sock: zmq.Socket, ident: bytes, frames: list[bytes]) -> None:
        held.append((ident, request_id(frames)))
        seen["received"] += 1
        seen["most"] = max(seen["most"], len(held))
        assert len(held) <= k, f"{len(held)} calls in flight, the client allows {k}"
        # answer only when the client can send no more: at its limit, or when all came
        while held and (len(held) == k or seen["received"] == n):
            who, rid = held.pop(0)
            sock.send_multipart([who, TAG, json.dumps(
                {"id": rid, "status": "ok", "result": {"pong": True, "ready": True}}).encode()])

    router = Router(short_tmp, handle)
    try:
        out = run_peer(program, kind, router.endpoint, "flow", str(n), str(k))
    finally:
        router.close()
    assert out.strip() == f"flow ok {n} {k}"
    assert seen == {"received": n, "most": k}


class Registrations:
    """The daemon's registration socket (ENDPOINT's path + ".shm"), in a thread: each
    register message with one fd is mapped and named; REGIONS holds the mappings."""

    def __init__(self, endpoint: str) -> None:
        self.path = endpoint[len("ipc://"):] + ".shm"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(4)
        self.regions: dict[str, mmap.mmap] = {}
        self.messages: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._serve, name="fake-shm", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while True:
                data, anc, _, _ = conn.recvmsg(4096, socket.CMSG_SPACE(16))
                if not data:
                    return
                fds = array.array("i")
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                msg = json.loads(data)
                self.messages.append(msg)
                if msg["op"] == "register":
                    assert len(fds) == 1, msg
                    size = os.fstat(fds[0]).st_size
                    token = f"r{len(self.regions):04d}"
                    self.regions[token] = mmap.mmap(fds[0], size)
                    os.close(fds[0])
                    conn.send(json.dumps({"region": token, "size": size}).encode())
                else:
                    conn.send(b'{"ok":true}')

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()
        os.unlink(self.path)


def test_shared_memory_on_the_wire(peer, short_tmp):
    kind, program = peer
    seen: list[dict[str, Any]] = []
    holder: dict[str, Registrations] = {}

    def handle(sock: zmq.Socket, ident: bytes, frames: list[bytes]) -> None:
        head = json.loads(frames[1])
        seen.append(head)
        (spec,) = head["inputs"]
        assert len(frames) == 2, "an input in a region has no frame"
        token = spec["region"]
        assert spec == {"name": "x", "dtype": "uint8", "shape": [16], "region": token,
                        "offset": 64}, spec
        assert head["outputs_into"] == {"region": token, "offset": 4096, "size": 1024}, head
        mm = holder["r"].regions[token]
        mm[4096:4112] = bytes(reversed(mm[64:80]))
        out = {"name": "y", "dtype": "uint8", "shape": [16],
               "region": token if len(seen) == 1 else "r9999", "offset": 4096}
        sock.send_multipart([ident, TAG, json.dumps(
            {"id": head["id"], "status": "ok", "outputs": [out]}).encode()])

    router = Router(short_tmp, handle)
    holder["r"] = Registrations(router.endpoint)
    try:
        out = run_peer(program, kind, router.endpoint, "shm")
    finally:
        router.close()
        holder["r"].close()
    assert out.strip() == "shm ok"
    assert [m["op"] for m in holder["r"].messages] == ["register", "unregister"]
    assert len(seen) == 2
