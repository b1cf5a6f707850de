"""A client's shared-memory region and the engines' worker process, through a real
daemon ([workers] isolation = "backend"): the input is read by the worker in place (the
worker maps the client's memfd) and the outputs asked into the region are written there
by the worker (its mapping is writable); unregistered, the region is unmapped and closed
in the worker; a worker killed from outside serves region inputs again; hostile use (an
offset past the region, a client that closes with a request in flight, a region
released while requests using it are queued) is a clear error or a right answer, and no
descriptor is left behind in the daemon or the worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import Client, ErrorCode, Region, RequestError
from tests.daemon.test_workers import unary_model
from tests.daemon.test_workers_shm import fds, links, mappings
from tests.e2e.test_cache_reload import poll
from tests.e2e.test_error_codes import raw
from tests.e2e.test_workers import worker_pids

pytestmark = pytest.mark.slow

X = np.random.default_rng(5).random((256, 1024), dtype=np.float32)  # 1 MiB


def neg_model(repo: Path) -> None:
    unary_model(repo, "neg", "Neg")


@pytest.fixture
def daemon(start_daemon, short_tmp: Path):
    repo = short_tmp / "repo"
    neg_model(repo)
    conf = short_tmp / "inferd.toml"
    conf.write_text('[workers]\nisolation = "backend"\n[metrics]\ntextfile = ""\n')
    return start_daemon("--config", str(conf), "--models", str(repo), "--preload", "neg")


def steady(pid: int) -> int:
    """``pid``'s descriptors on files and memfds (a region's kind), less the worker
    channels' arenas: sockets, eventfds and epolls (libzmq's per connection, and one
    more channel per caller thread running at once) grow with connections and
    concurrency, not with regions."""
    return sum(t.startswith("/") and "inferd-worker-arena" not in t for t in links(pid))


def worker(d) -> int:
    return worker_pids(d.log(), "onnxruntime")[-1]


def raw_error(endpoint: str, header: str) -> str:
    """One request sent as is from this process; its reply's error message."""
    reply = raw(endpoint, [b"INFERD/1", header.encode()])
    assert reply.error is not None
    return reply.error.message


def test_a_region_is_read_and_written_by_the_worker_and_released_there(daemon) -> None:
    d = daemon
    with d.client() as c:
        c.infer("neg", {"x": X[:1]})  # its worker and channel exist: counted from here
        pid = worker(d)
        before = (steady(d.proc.pid), steady(pid))
        region = c.register(Region(8 * 2**20, name="inferd-e2e"))
        x = region.ndarray(X.shape, np.float32)
        x[...] = X
        y = c.infer("neg", {"x": x}, outputs_into=region)["y"]
        np.testing.assert_array_equal(y, -X)
        assert np.shares_memory(y, np.frombuffer(region.buffer, np.uint8))
        # the worker maps the client's memfd, writable: the outputs were its writes
        assert mappings(pid, "inferd-e2e") == ["rw-s"] and fds(pid, "inferd-e2e") == 1
        assert fds(d.proc.pid, "inferd-e2e") == 1  # one descriptor in the daemon
        # hostile: bounds are the daemon's, checked before anything reaches the worker
        message = raw_error(d.endpoint, '{"id":"h","op":"infer","model":"neg","inputs":[{"name":'
                      f'"x","dtype":"float32","shape":[256,1024],"region":"{region.token}",'
                      f'"offset":{8 * 2**20 - 64}}}]}}')
        assert "past the end of its region" in message
        with pytest.raises(RequestError, match="the outputs need more") as e:
            c.infer("neg", {"x": x}, outputs_into=(region, 2**20, 4096))
        assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED
        # a worker killed from outside: the next request maps the region again
        os.kill(pid, signal.SIGKILL)
        poll(lambda: len(worker_pids(d.log(), "onnxruntime")) == 2, 10)
        for _ in range(3):  # its death's own request may be refused; then served
            try:
                y = c.infer("neg", {"x": x}, outputs_into=region)["y"]
                break
            except RequestError as e:
                assert e.code is ErrorCode.UNAVAILABLE
        np.testing.assert_array_equal(y, -X)
        pid = worker(d)
        assert mappings(pid, "inferd-e2e") == ["rw-s"]
        before = (before[0], steady(pid) - 1)  # the new worker's own (its region's aside)
        # released: unmapped and closed in the worker, closed in the daemon
        del y
        c.unregister(region)
        poll(lambda: not mappings(pid, "inferd-e2e"), 10)
        assert fds(pid, "inferd-e2e") == 0
        poll(lambda: fds(d.proc.pid, "inferd-e2e") == 0, 10)
        assert (steady(d.proc.pid), steady(pid)) == before
        # a region released while requests naming it are queued, then a client that
        # closes with requests in flight: each answered or refused, nothing left behind
        other = Region(8 * 2**20, name="inferd-e2e2")
        c.register(other)
        x2 = other.ndarray(X.shape, np.float32)
        x2[...] = X
        pending = [c.submit("infer", "neg", {"x": x2}) for _ in range(8)]
        c.unregister(other)
        for p in pending:
            try:
                np.testing.assert_array_equal(p.result()["y"], -X)
            except RequestError as e:  # named after its release
                assert "unknown shared-memory region" in e.message
    gone = Client(d.endpoint, timeout=10)
    last = Region(8 * 2**20, name="inferd-e2e3")
    gone.register(last)
    x3 = last.ndarray(X.shape, np.float32)
    x3[...] = X
    for _ in range(8):
        gone.submit("infer", "neg", {"x": x3})
    gone.close()
    last.close()
    with d.client() as c:  # the daemon serves on
        np.testing.assert_array_equal(c.infer("neg", {"x": X[:2]})["y"], -X[:2])
    for name in ("inferd-e2e2", "inferd-e2e3"):
        poll(lambda: not mappings(pid, name) and not fds(d.proc.pid, name), 10)
    poll(lambda: (steady(d.proc.pid), steady(pid)) == before, 10)


def test_replies_libzmq_still_holds_are_never_written_over(start_daemon,
                                                           short_tmp: Path) -> None:
    """A run's big outputs go from the worker's arena into the reply frame without a
    copy (issue 30, item 2): hostile, a client that sends many big requests and does not
    read, so that libzmq holds every reply frame while the next runs go; each request
    gets exactly one reply, bit for bit its own."""
    import zmq

    from inferd.daemon.workers.pool import LENT_MAX
    from inferd.ipc.protocol import Op, Request, decode_reply, encode_request

    repo = short_tmp / "repo"
    neg_model(repo)
    conf = short_tmp / "inferd.toml"
    conf.write_text('[workers]\nisolation = "backend"\n[placement]\nmode = "first"\n'
                    '[server]\nmax_message_bytes = "8MiB"\n[metrics]\ntextfile = ""\n')
    d = start_daemon("--config", str(conf), "--models", str(repo), "--preload", "neg")
    n = 2 * LENT_MAX
    rng = np.random.default_rng(23)
    xs = {f"r{i}": rng.random((256, 1024 + 16 * i), dtype=np.float32) for i in range(n)}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)  # libzmq here takes one reply, the kernel a little
    sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        for rid, x in xs.items():
            sock.send_multipart(encode_request(Request(rid, Op.INFER, "neg",
                                                       inputs={"x": x})), copy=False)
        # the daemon holds replies unsent: their frames view arenas of the worker (one
        # per channel, LENT_MAX at most; then copies), its own arenas one per channel
        poll(lambda: len(mappings(d.proc.pid, "inferd-worker-arena")) >= LENT_MAX, 30)
        got: dict[str, bytes] = {}
        for _ in range(n):
            reply = decode_reply(sock.recv_multipart(copy=False))
            assert reply.error is None, reply.error
            assert reply.id in xs and reply.id not in got
            got[reply.id] = reply.outputs["y"].tobytes()
        assert not sock.poll(200)  # exactly one reply each
    finally:
        sock.close(0)
        ctx.term()
    for rid, x in xs.items():
        assert got[rid] == (-x).tobytes(), rid
    with d.client() as c:  # and the channels serve on
        np.testing.assert_array_equal(c.infer("neg", {"x": X})["y"], -X)
