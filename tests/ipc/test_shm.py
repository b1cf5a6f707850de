"""Shared-memory tensors (issue 19, item 7) on a real server loop and real sockets: a
sealed memfd passed once over the registration socket (SCM_RIGHTS); inputs named by
region + offset are read in place, outputs written into the client's slot; and the
rules: only the registering process may name a region, offsets are bounded, an
unsealed memfd or another kind of file is refused, a region is forgotten on unregister
and when its client goes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import zmq

from inferd.ipc import Client, Region, RequestError
from inferd.ipc.errors import ErrorCode
from inferd.ipc.protocol import Reply, Request, decode_reply
from inferd.ipc.replies import Ticket
from inferd.ipc.shm import Registration, shm_path
from inferd.ipc.server import Server

ROOT = Path(__file__).resolve().parents[2]


class Echo:
    """A server whose handler answers each infer with its inputs (on the I/O thread)."""

    def __init__(self, tmp: Path) -> None:
        self.seen: list[dict[str, np.ndarray]] = []
        self.server = Server(f"ipc://{tmp}/s.sock", self.handle, max_message_bytes=2**26,
                             grace_s=0.2)
        self.server.bind()
        self.thread = threading.Thread(target=self.server.run, name="test-io")
        self.thread.start()

    def handle(self, request: Request, ticket: Ticket) -> Reply:
        self.seen.append(request.inputs)
        return Reply(request.id, outputs=dict(request.inputs))

    def close(self) -> None:
        self.server.stop()
        self.thread.join(30)
        self.server.close()


@pytest.fixture
def echo(short_tmp: Path):
    e = Echo(short_tmp)
    yield e
    e.close()


def test_inputs_by_reference_and_outputs_into_the_slot(echo: Echo) -> None:
    with Client(echo.server.endpoint, timeout=10) as c:
        region = c.register(Region(1 << 20))
        x = region.ndarray((3, 5), np.float32)
        x[...] = np.arange(15).reshape(3, 5)
        s = np.array(["a", "b"], dtype=object)  # strings still travel as frames
        out = c.infer("m", {"x": x, "s": s}, outputs_into=region)
        seen = echo.seen[-1]["x"]
        assert not seen.flags.owndata and seen.base is not None  # read in place
        np.testing.assert_array_equal(out["x"], x)
        offset = region.locate(out["x"])  # written into the region, after x
        assert offset is not None and offset >= x.nbytes and offset % 64 == 0
        assert out["s"].tolist() == ["a", "b"]
        x[0, 0] = 42  # the daemon's view is the client's memory
        assert seen[0, 0] == 42


def test_another_process_cannot_name_my_region(echo: Echo) -> None:
    with Client(echo.server.endpoint, timeout=10) as c:
        region = c.register(Region(4096))
        header = ('{"id":"t","op":"infer","model":"m","inputs":[{"name":"x","dtype":'
                  f'"uint8","shape":[4],"region":"{region.token}","offset":0}}]}}')
        code = ("import zmq, sys\n"
                "from inferd.ipc.protocol import decode_reply\n"
                "s = zmq.Context().socket(zmq.DEALER)\n"
                "s.setsockopt(zmq.RCVTIMEO, 10000)\n"
                f"s.connect({echo.server.endpoint!r})\n"
                f"s.send_multipart([b'INFERD/1', {header!r}.encode()])\n"
                "r = decode_reply(s.recv_multipart())\n"
                "print(r.error.code, r.error.message)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.stdout.startswith("INVALID_ARGUMENT unknown shared-memory region"), \
            r.stdout + r.stderr
        assert c.infer("m", {"x": region.ndarray((4,), np.uint8)})["x"].shape == (4,)


def test_offsets_are_bounded(echo: Echo) -> None:
    with Client(echo.server.endpoint, timeout=10) as c:
        region = c.register(Region(4096))
        x = region.ndarray((1000,), np.float32)
        with pytest.raises(RequestError, match="pass the end of the region") as e:
            c.infer("m", {"x": x}, outputs_into=(region, 4000, 1000))
        assert e.value.code is ErrorCode.INVALID_ARGUMENT
        # an input described past the end (from this process: its regions)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(echo.server.endpoint)
        for offset, words in ((3000, "past the end of its region"),
                              (-1, "'offset' must be a non-negative integer")):
            header = ('{"id":"t","op":"infer","model":"m","inputs":[{"name":"x","dtype":'
                      f'"float32","shape":[1000],"region":"{region.token}",'
                      f'"offset":{offset}}}]}}')
            sock.send_multipart([b"INFERD/1", header.encode()])
            reply = decode_reply(sock.recv_multipart())
            assert reply.error is not None and words in reply.error.message, reply
        sock.close(0)
        ctx.term()
        with pytest.raises(RequestError, match="the outputs need more") as e:
            c.infer("m", {"x": x}, outputs_into=(region, 4000, 96))
        assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED


def test_only_a_sealed_memfd_is_taken(echo: Echo) -> None:
    assert echo.server.regions is not None
    reg = Registration(echo.server.regions.path)
    try:
        fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        with pytest.raises(Exception, match="F_SEAL_SHRINK"):
            reg._call({"op": "register"}, [fd])
        os.close(fd)
        with tempfile.TemporaryFile() as f:  # a plain file: no seals at all
            f.truncate(4096)
            with pytest.raises(Exception, match="memfd"):
                reg._call({"op": "register"}, [f.fileno()])
        with pytest.raises(Exception, match="exactly one file descriptor"):
            reg._call({"op": "register"})
    finally:
        reg.close()
    assert echo.server.regions.count() == 0


def test_forgotten_on_unregister_and_when_the_client_goes(echo: Echo) -> None:
    regions = echo.server.regions
    assert regions is not None
    c = Client(echo.server.endpoint, timeout=10)
    kept = c.register(Region(4096))
    gone = c.register(Region(4096))
    assert regions.count() == 2
    c.unregister(gone)
    assert regions.count() == 1
    x = kept.ndarray((2,), np.uint8)
    assert c.infer("m", {"x": x})["x"].shape == (2,)
    c.close()
    deadline = 200
    while regions.count() and deadline:  # the registration thread sees the close
        threading.Event().wait(0.01)
        deadline -= 1
    assert regions.count() == 0
    assert shm_path(Path(echo.server.endpoint.removeprefix("ipc://"))).is_socket()
