"""What the daemon takes from a worker (daemon/workers/pickles.py, the channel's daemon
end, a step's values): every allowed global round-trips, a pickle naming any other is
refused before it is called (a marker file the payload would make is never made), and a
hostile worker of a real pool (a user processor that writes its own reply on its
channel) costs its call and its process, never the daemon, which serves on."""

from __future__ import annotations

import array
import io
import os
import pickle
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.daemon.processors import Context, ProcessorRegistry, release
from inferd.daemon.workers import pickles
from inferd.daemon.workers.channel import Channel, Gone, Unreadable, pair
from inferd.daemon.workers.pool import WorkerDied
from inferd.daemon.workers.steps import RemoteSteps, pack, unpack
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import BatchSizes, LoadOptions, TensorSpec
from tests.daemon.test_workers import new_pool
from tests.e2e.test_cache_reload import poll

# ----------------------------------------------------------------- the allow-list

ALLOWED_VALUES: list[Any] = [
    ({"ok": True, "took": 0.001}, [("y", "<f4", (1, 4), True, 0, 16)], None),  # a run's
    TensorSpec("x", "float32", (1, "n", None)), BatchSizes(frozenset({1, 8}), 2),
    np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5], ">f8"),
    np.array(["un", "deux"]), np.array([b"a", b"bc"]), np.array(["ü", b"raw"], dtype=object),
    np.float32(3.5), np.int64(-2), np.bool_(True), np.complex64(1 + 2j), np.dtype("<u2"),
    np.zeros(2, dtype=[("a", "<f4"), ("b", "<i2")]),
    {"set": {1, 2}, "frozen": frozenset({"a"}), "complex": 1 - 1j, "bytes": b"\x00",
     "bytearray": bytearray(b"xy"), "nested": [(1, 2.5, None, "s")]},
]


class _Recording(pickles.Unpickler):
    """The allow-list's unpickler, noting each global it is asked for."""

    def __init__(self, data: bytes, named: set[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self.named = named

    def find_class(self, module: str, name: str) -> Any:
        self.named.add((module, name))
        return super().find_class(module, name)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return bool(type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape
                    and a.tolist() == b.tolist())
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def test_every_allowed_global_round_trips() -> None:
    named: set[tuple[str, str]] = set()
    for value in ALLOWED_VALUES:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        assert _same(value, pickles.loads(data)), value
        _Recording(data, named).load()
    # each object the list allows is used by one of these (the other names of one:
    # where numpy 1 pickled it)
    assert {id(pickles.ALLOWED[g]) for g in named} == {id(v) for v in pickles.ALLOWED.values()}


MARKER_CMD = "touch {marker}"


def _crafted(marker: Path) -> dict[str, bytes]:
    """Pickles that would make ``marker`` (or run other code) if their global were
    called, each naming it its own way."""

    class System:
        def __reduce__(self) -> Any:
            return os.system, (MARKER_CMD.format(marker=marker),)

    class Popen:
        def __reduce__(self) -> Any:
            return subprocess.Popen, (["touch", str(marker)],)

    class Eval:
        def __reduce__(self) -> Any:
            return eval, (f"open({str(marker)!r}, 'w')",)

    cmd = MARKER_CMD.format(marker=marker).encode()
    return {
        "posix.system": pickle.dumps(System(), protocol=5),  # os.system's own module
        "subprocess.Popen": pickle.dumps(Popen(), protocol=5),
        "builtins.eval": pickle.dumps(Eval(), protocol=5),
        # protocol 0, as an attacker writes it by hand: GLOBAL, then REDUCE / INST
        "os.system": b"cos\nsystem\n(S'" + cmd + b"'\ntR.",
        "builtins.exec": b"(S'open(\"" + str(marker).encode() + b"\", \"w\")'\nibuiltins\nexec\n.",
        # a global nested in data the daemon takes
        "builtins.getattr": pickle.dumps({"ok": True, "x": [getattr]}, protocol=5),
    }


def test_a_pickle_naming_any_other_global_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for name, data in _crafted(marker).items():
        with pytest.raises(pickles.Refused, match=rf"^global {name} is not allowed$"):
            pickles.loads(data)
    assert not marker.exists()
    pickle.loads(_crafted(marker)["os.system"])  # a real payload, which pickle runs
    assert marker.exists()


def test_a_step_s_values_naming_a_global_not_allowed_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for name, data in _crafted(marker).items():
        with pytest.raises(pickles.Refused, match=rf"^global {name} is not allowed$"):
            unpack({"values": np.frombuffer(data, np.uint8)}, None)
    assert not marker.exists()
    # a reference to a tensor the message does not carry
    skeleton = pack({"x": np.zeros(1)})["values"]
    with pytest.raises(pickle.UnpicklingError, match="neither a tensor"):
        unpack({"values": skeleton}, None)


# ----------------------------------------------------------------- the channel's daemon end


def _datagram(body: bytes, inline: bytes = b"") -> list[bytes]:
    return [struct.pack("<I", len(body)), body, inline]


def _fds_open() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def ends():  # type: ignore[no-untyped-def]
    """The daemon's end of a channel, as the pool makes it, and a raw worker socket."""
    a, b = pair()
    daemon_end = Channel(a, writable_peer=True)
    yield daemon_end, b
    daemon_end.close()
    b.close()


def _refused(ends: Any, parts: list[bytes], fds: list[int] | None = None) -> str:
    daemon_end, worker = ends
    if fds:
        worker.sendmsg(parts, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        worker.sendmsg(parts)
    with pytest.raises(Unreadable) as e:
        daemon_end.receive(lend=True)
    assert isinstance(e.value, Gone)  # the pool treats it as a channel that broke
    with pytest.raises(Gone):  # shut down: nothing more is read from it
        daemon_end.receive()
    return str(e.value)


@pytest.mark.parametrize("name", ["os.system", "posix.system", "subprocess.Popen",
                                  "builtins.eval"])
def test_the_daemon_end_refuses_a_header_naming_a_global(ends, tmp_path: Path,
                                                          name: str) -> None:
    marker = tmp_path / "ran"
    why = _refused(ends, _datagram(_crafted(marker)[name]))
    assert why == f"a message the daemon refuses to read: global {name} is not allowed"
    assert not marker.exists()


def test_the_daemon_end_refuses_a_type_it_does_not_list(ends) -> None:
    # what the daemon sends a worker (a load's options) is not what it takes back
    body = pickle.dumps(({"ok": True, "o": LoadOptions()}, [], None), protocol=5)
    assert "global inferd.libbackends.contract.LoadOptions is not allowed" in \
        _refused(ends, _datagram(body))


def test_the_daemon_end_refuses_an_object_dtype(ends) -> None:
    """An object array made from a worker's bytes would be pointers the worker chose."""
    for code in ("|O", "O,i4"):
        a, b = pair()
        body = pickle.dumps(({"ok": True}, [("y", code, (1,), True, 0, 16)], None),
                            protocol=5)
        why = _refused((Channel(a, writable_peer=True), b),
                       _datagram(body, struct.pack("<QQ", 0x4141414141, 0)))
        assert f"dtype {code!r} holds Python objects" in why, why
        a.close()
        b.close()
    # a "pickle" tensor must be an array of strings
    body = pickle.dumps(({"ok": True}, [("y", "pickle", {"not": "an array"}, True, 0, 0)],
                         None), protocol=5)
    assert "a dict where an array of strings goes" in _refused(ends, _datagram(body))


def test_the_daemon_end_takes_no_descriptor_but_a_sealed_arena(ends) -> None:
    before = _fds_open()
    r, w = os.pipe()
    body = pickle.dumps(({"ok": True}, [], None), protocol=5)
    assert "1 descriptors passed with a message without an arena" in _refused(
        ends, _datagram(body), [r])
    os.close(r)
    os.close(w)
    assert _fds_open() == before  # the one passed was closed

    def arena(seal: bool, size: int) -> int:
        fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        if seal:
            import fcntl
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return fd

    for seal, size, said, why in ((False, 8192, 8192, "not sealed against shrinking"),
                                  (True, 4096, 1 << 20, "of 4096 bytes said to be 1048576")):
        a, b = pair()
        fd = arena(seal, size)
        body = pickle.dumps(({"ok": True}, [("y", "<f4", (4,), False, 0, 16)], said),
                            protocol=5)
        before = _fds_open()
        assert why in _refused((Channel(a, writable_peer=True), b), _datagram(body), [fd])
        assert _fds_open() == before  # what it was passed is closed
        os.close(fd)
        a.close()
        b.close()


def test_the_daemon_end_reads_what_a_worker_sends() -> None:
    """A worker's own messages (a run's outputs, strings, a load's reply) pass."""
    a, b = pair()
    daemon_end, worker_end = Channel(a, writable_peer=True), Channel(b, trusted=True)
    big = np.arange(100_000, dtype=np.float32)
    worker_end.send({"ok": True, "inputs": (TensorSpec("x", "float32", (1, None)),),
                     "batch_sizes": BatchSizes(frozenset({1}), 0)},
                    {"y": big, "text": np.array(["a", "b"], dtype=object)})
    header, got, fds = daemon_end.receive(copy=True)
    assert header["batch_sizes"] == BatchSizes(frozenset({1}), 0) and fds == []
    np.testing.assert_array_equal(got["y"], big)
    assert got["text"].tolist() == ["a", "b"]
    daemon_end.close()
    worker_end.close()


# ----------------------------------------------------------------- hostile workers of a pool

HOSTILE = '''
import os
import pickle
import struct
import sys
import time

import numpy as np


class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def _channel():
    """The channel this step answers on: a taken-over worker finds it on its stack."""
    frame = sys._getframe(1)
    while "channel" not in frame.f_locals:
        frame = frame.f_back
    return frame.f_locals["channel"]


def make_hostile(marker, how):
    def step(values):
        if int(values["x"].reshape(-1)[0]) != 1:  # served honestly otherwise
            return {"x": values["x"] + 1}
        payload = _System(f"touch {marker}")
        ch = _channel()
        if how == "header":  # the channel's header pickle
            body = pickle.dumps((payload, [], None), protocol=5)
            ch.sock.sendmsg([struct.pack("<I", len(body)), body])
        else:  # a good header, and values whose pickle names os.system
            skeleton = pickle.dumps({"x": payload}, protocol=5)
            ch.send({"ok": True}, {"values": np.frombuffer(skeleton, np.uint8)})
        time.sleep(600)  # its own answer never comes: the daemon's verdict ends it
    return step


def make_boxer():
    import collections

    def step(values):  # pickled fine, but a type the daemon does not list
        return {"x": values["x"], "box": collections.OrderedDict(a=1)}
    return step


PROCESSORS = {"hostile": make_hostile, "boxer": make_boxer}
'''


@pytest.fixture
def hostile(tmp_path: Path):  # type: ignore[no-untyped-def]
    directory = tmp_path / "processors"
    directory.mkdir()
    (directory / "hostile.py").write_text(HOSTILE)
    pool = new_pool(restart_backoff_s=0.05)
    yield RemoteSteps(pool, str(directory), False, 60.0), tmp_path / "ran"
    pool.close()


@pytest.mark.parametrize("how", ["header", "values"])
def test_a_worker_that_answers_a_hostile_pickle_costs_its_call_and_its_process(
        hostile, how: str) -> None:
    remote, marker = hostile
    step = ProcessorRegistry(remote=remote).build(
        {"op": "hostile", "marker": str(marker), "how": how}, Context(), "graph g: node h")
    try:
        ok = {"x": np.zeros((1, 2), np.float32)}
        assert step(ok)["x"].tolist() == [[1, 1]]
        first = step.worker
        with pytest.raises(WorkerDied) as e:
            step({"x": np.ones((1, 2), np.float32)})
        assert e.value.code is ErrorCode.UNAVAILABLE
        if how == "header":  # killed at once, naming what it sent
            assert e.value.message == (
                f"processors (worker {first.pid}) was killed for a message the daemon "
                f"refuses to read: global posix.system is not allowed while running "
                f"processor hostile")
        else:
            assert e.value.message == (
                f"processors (worker {first.pid}) was killed for values the daemon refuses "
                f"to read (global posix.system is not allowed) while running processor "
                f"hostile")
        poll(lambda: not first.alive, 20)
        assert not marker.exists()
        # built again in a new worker, which serves
        assert step(ok)["x"].tolist() == [[1, 1]]
        assert step.worker is not first and step.worker.alive
        assert remote.pool.restarts == {("processors", "killed"): 1}
    finally:
        release([step])


def test_a_step_that_returns_a_type_the_daemon_does_not_take_fails_in_its_worker(
        hostile) -> None:
    """Not hostile, a step's own mistake: its call fails naming the type, and the worker
    (checking its answer before it sends it) serves on."""
    remote, _ = hostile
    step = ProcessorRegistry(remote=remote).build({"op": "boxer"}, Context(), "graph g: n")
    try:
        with pytest.raises(InferdError) as e:
            step({"x": np.zeros(2)})
        assert e.value.code is ErrorCode.INTERNAL
        assert e.value.message.startswith(
            "returned a value the daemon does not take from a worker: global "
            "collections.OrderedDict is not allowed (it takes numbers, "), \
            e.value.message
        worker = step.worker
        with pytest.raises(InferdError):
            step({"x": np.zeros(2)})
        assert step.worker is worker and worker.alive and remote.pool.restarts == {}
    finally:
        release([step])
