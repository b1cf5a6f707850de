"""Worker processes without a daemon: the control channel (inline and arena tensors, the
arena growing, descriptors passed), the zygote's spawn and exit reports, and a real
onnxruntime model loaded and run in a worker, killed, and run again."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import mmap
import os
import signal
import subprocess
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.daemon.workers.channel import INLINE_BYTES, Channel, Gone, pair
from inferd.daemon.workers.pool import LoadCall, WorkerDied, WorkerModel, WorkerPool
from inferd.daemon.workers.zygote import Zygote, describe_status
from inferd.ipc import libc
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.libbackends.contract import LoadedModel, LoadOptions
from inferd.libbackends.customops.contract import OpRegistry
from inferd.libbackends.loader import _onnxruntime_cpu
from inferd.libbackends.registry import Registry
from tests.e2e.test_cache_reload import poll


def test_the_channel_carries_small_and_big_tensors_of_every_dtype():
    a, b = pair()
    ours, theirs = Channel(a), Channel(b)
    rng = np.random.default_rng(0)
    tensors = {
        "small": rng.random((3, 4), dtype=np.float32),
        "half": rng.random(7).astype(np.float16),
        "flags": np.array([True, False, True]),
        "scalar": np.array(16000, np.int64),
        "empty": np.zeros((0, 512), np.float32),
        "big": rng.random((1, 3, 256, 256), dtype=np.float32),  # through the arena
        "strided": rng.random((64, 64), dtype=np.float64)[:, ::2],
    }
    import ml_dtypes

    tensors["bf16"] = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16)
    tensors["int4"] = np.array([-8, 7, 0], dtype=ml_dtypes.int4)  # "|V1" to numpy
    tensors["f8"] = np.array([1, 2], np.float32).astype(ml_dtypes.float8_e5m2)  # "<f1"
    tensors["text"] = np.array(["a", "", "ünï"], dtype=object)
    assert tensors["big"].nbytes >= INLINE_BYTES
    for _ in range(2):  # the arena is reused the second time
        ours.send({"op": "x", "n": 1}, tensors)
        header, got, fds = theirs.receive()
        assert header == {"op": "x", "n": 1} and fds == []
        assert list(got) == list(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
    bigger = {"big": rng.random((4, 3, 256, 256), dtype=np.float32)}  # the arena grows
    ours.send({}, bigger)
    _, got, _ = theirs.receive(copy=True)
    np.testing.assert_array_equal(got["big"], bigger["big"])
    assert got["big"].flags.writeable  # copied: the receiver's own
    ours.close()
    with pytest.raises(Gone):
        theirs.receive()
    theirs.close()


def test_the_channel_passes_descriptors():
    a, b = pair()
    r, w = os.pipe()
    Channel(a).send({"op": "fd"}, fds=[w])
    os.close(w)
    _, _, fds = Channel(b, trusted=True).receive()  # a worker's end: from the daemon
    os.write(fds[0], b"hi")
    os.close(fds[0])
    assert os.read(r, 2) == b"hi"
    os.close(r)
    a.close()
    b.close()


def test_a_channel_waits_no_longer_than_its_limit_and_its_socket_stays_blocking():
    a, b = pair()
    ours, theirs = Channel(a), Channel(b)
    ours.settimeout(0.05)
    assert a.gettimeout() is None  # the kernel keeps the limit: no poll before each call
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="0.05 s"):
        ours.receive()
    assert 0.04 < time.monotonic() - started < 5
    theirs.send({"n": 1}, {"x": np.arange(3, dtype=np.float32)})
    header, got, _ = ours.receive(copy=True)
    assert header == {"n": 1} and got["x"].tolist() == [0, 1, 2]
    ours.settimeout(None)  # for ever again: the peer's end closing still ends the wait
    theirs.close()
    with pytest.raises(Gone):
        ours.receive()
    ours.close()


def test_status_words():
    assert describe_status(signal.SIGABRT) == "died of SIGABRT"
    assert describe_status(3 << 8) == "exited with status 3"


def _echo_worker(sock: socket.socket, name: str) -> int:
    ch = Channel(sock)
    while True:
        try:
            header, tensors, _ = ch.receive()
        except Gone:
            return 0
        if header.get("die"):
            # the default action, whatever handler this process inherited from pytest's
            # (faulthandler's prints this expected stack, and re-raised the signal into
            # an inherited handler: "DID NOT RAISE Gone" in larger runs)
            faulthandler.disable()
            signal.signal(header["die"], signal.SIG_DFL)
            os.kill(os.getpid(), header["die"])
        ch.send({"name": name, **header}, tensors)


def _signal_stack_gone() -> None:
    """Make this thread's alternate signal stack a region that is then unmapped, as
    OpenVINO's CPU plugin leaves the thread that loaded a model when it is destroyed on
    another (ipc/libc.py, kept_signal_stack)."""
    region = mmap.mmap(-1, libc.SIGNAL_STACK_SIZE)
    view = ctypes.c_char.from_buffer(region)
    assert libc._set_signal_stack(ctypes.addressof(view), libc.SIGNAL_STACK_SIZE, 0)
    del view
    region.close()


@pytest.mark.parametrize("forked_from", ["clean", "sigchld-blocked", "signal-stack-gone"])
def test_the_zygote_forks_workers_and_reports_how_they_end(forked_from: str) -> None:
    """Also when the thread that forks the zygote has SIGCHLD blocked (a mask is
    inherited by fork and exec): the zygote starts from an empty mask, or it never wakes
    to reap (the old code: no report in 10 s); or an alternate signal stack that is no
    longer mapped: the zygote has its own, or the kernel cannot run its SIGCHLD handler
    and it dies of SIGSEGV at its first worker's end (the old code; the CI failures of
    stop 39, in test processes that had run OpenVINO)."""
    ended: dict[int, int] = {}
    done = threading.Event()

    def on_exit(pid: int, status: int) -> None:
        ended[pid] = status
        done.set()

    with contextlib.ExitStack() as forking:
        if forked_from == "sigchld-blocked":
            before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            forking.callback(signal.pthread_sigmask, signal.SIG_SETMASK, before)
        elif forked_from == "signal-stack-gone":
            forking.enter_context(libc.kept_signal_stack())  # this thread's, given back
            _signal_stack_gone()
        z = Zygote(_echo_worker, on_exit)
    z.start()
    try:
        a, b = pair()
        pid = z.spawn(b, "w1")
        ch = Channel(a)
        x = np.arange(10, dtype=np.int32)
        ch.send({"op": "echo"}, {"x": x})
        header, got, _ = ch.receive()
        assert header == {"name": "w1", "op": "echo"}
        np.testing.assert_array_equal(got["x"], x)
        ch.send({"die": int(signal.SIGSEGV)})
        with pytest.raises(Gone):
            ch.receive()
        assert done.wait(10)
        assert describe_status(ended[pid]) == "died of SIGSEGV"
    finally:
        z.close()


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch /tmp/inferd-zygote-pwned",))


def test_a_pickle_from_the_zygote_is_read_under_the_allow_list(caplog):
    """What the zygote sends is read as a worker's words are (daemon/workers/pickles.py):
    a message naming a global off the list runs nothing in the daemon; it is logged, and
    the zygote is taken as ended (a spawn then says so at once)."""
    import pickle

    z = Zygote(_echo_worker, lambda pid, status: None)
    mine, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    real, z.sock = z.sock, mine  # this test plays the zygote
    marker = Path("/tmp/inferd-zygote-pwned")
    marker.unlink(missing_ok=True)
    try:
        z.start()
        zygote_end.send(pickle.dumps(_Boom()))
        a, b = pair()
        with pytest.raises(OSError, match="the worker zygote has ended"):
            z.spawn(b, "w1", timeout=10)
        assert not marker.exists()
        assert "the worker zygote sent a message the daemon refuses to read" in caplog.text
        assert "posix.system" in caplog.text, caplog.text
    finally:
        a.close()
        zygote_end.close()
        z.sock = real
        z.close()


def test_a_zygote_that_dies_is_said_with_how(caplog):
    """Its death is not silent (it was: the daemon's reader ended, and every later start
    failed with "has ended", no cause anywhere): one ERROR with the signal, and each
    start that fails names it."""
    z = Zygote(_echo_worker, lambda pid, status: None)
    z.start()
    try:
        os.kill(z.pid, signal.SIGKILL)  # the zygote is not waited for: still its pid
        a, b = pair()
        poll(lambda: "the worker zygote" in caplog.text, 10)
        with pytest.raises(OSError, match=r"^the worker zygote has ended \(died of SIGKILL\)$"):
            z.spawn(b, "w1", timeout=10)
        a.close()
        assert (f"the worker zygote (pid {z.pid}) died of SIGKILL; no worker process can "
                "start until inferd is restarted") in caplog.text
    finally:
        z.close()
    assert caplog.text.count("the worker zygote (pid") == 1  # close() says nothing more


def _collecting_worker(sock: socket.socket, name: str) -> int:
    sock.send(str(gc.collect()).encode())  # a full collection, then its answer
    return 0


def test_a_worker_never_collects_what_the_daemon_had_when_the_zygote_was_forked(
        models_dir):
    """An engine's object left in a cycle in the forking process (an OpenVINO compiled
    model and its request here) is garbage the zygote and its workers inherit; a full
    collection there ran its destructor in a copy without its threads. The old code:
    this worker's gc.collect() never returned (OpenVINO waits for its threads). Now what
    was there at the fork is frozen there. (Not the cause of the zygotes that died of
    SIGSEGV in test processes that ran engines in-process: that was OpenVINO's signal
    stack, test_the_zygote_forks_workers_and_reports_how_they_end[signal-stack-gone].)"""
    ov = pytest.importorskip("openvino")
    model = ov.Core().compile_model(str(models_dir / "ocr-cls" / "1" / "model.onnx"), "CPU")
    model(np.zeros((1, 3, 48, 192), np.float32))
    cycle: list[Any] = [model, model.create_infer_request()]
    cycle.append(cycle)
    del model
    gc.collect()  # the cycle, still held, moves to the oldest generation
    del cycle  # garbage there now, until the next full collection
    z = Zygote(_collecting_worker, lambda pid, status: None)
    z.start()
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        z.spawn(b, "w1")
        a.settimeout(30)
        assert int(a.recv(64)) >= 0  # old code: TimeoutError
        a.close()
    finally:
        z.close()
    gc.collect()  # here, where its threads are


def new_pool(**settings: Any) -> WorkerPool:
    """A started pool with onnxruntime registered (the ``pool`` fixture's); ``settings``
    (``idle_exit_s``...) override its own."""
    registry = Registry()
    registry.register(_onnxruntime_cpu())
    p = WorkerPool(registry, OpRegistry(),
                   **{"kill_after_s": 30.0, "restart_backoff_s": 0.05, **settings})
    p.start()
    return p


@pytest.fixture
def pool():
    p = new_pool()
    yield p
    p.close()


def vad_call(models_dir: Path) -> LoadCall:
    path = models_dir / "vad" / "1" / "model.onnx"
    return LoadCall("onnxruntime", path, LoadOptions(), "vad version 1", models_dir / "vad",
                    (), {}, 10.0, key="onnxruntime")


VAD = {"input": np.random.default_rng(3).random((2, 512), dtype=np.float32),
       "state": np.zeros((2, 2, 128), np.float32), "sr": np.array(16000, np.int64)}


def test_a_model_in_a_worker_runs_as_in_process(pool, models_dir):
    backend = _onnxruntime_cpu()
    local = backend.load(models_dir / "vad" / "1" / "model.onnx", LoadOptions())
    try:
        expected = local.run(VAD)
    finally:
        local.unload()
    model = WorkerModel(pool, vad_call(models_dir), 60.0)
    try:
        assert [s.name for s in model.inputs] == ["input", "state", "sr"]
        got = model.run(VAD)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k])
        assert model.memory_bytes() and model.memory_bytes() > 0
        assert model.describe()["worker"]["pid"] == model.pid != os.getpid()
    finally:
        model.unload()


def _cpus_allowed(pid: int, tid: int) -> str:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to tell a pinned thread from a free one")
def test_a_pinned_models_load_and_runs_keep_to_its_cores_in_the_worker(pool, models_dir):
    # model.toml cpu_affinity reaches the worker: the engine's own threads started at the
    # load inherit the cores, and a worker thread that goes from a pinned model to a free
    # one (they share the backend's worker) is let go to every core again
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1]
    free = WorkerModel(pool, vad_call(models_dir), 60.0)
    pid = free.pid
    before = set(os.listdir(f"/proc/{pid}/task"))
    call = vad_call(models_dir)
    pinned = WorkerModel(pool, LoadCall(
        call.backend, call.path, LoadOptions(intra_op_threads=2), "vad version 1 pinned",
        call.model_dir, (), {}, 10.0, key=call.key, cores=(core,)), 60.0)
    try:
        assert pinned.pid == pid  # one worker for the backend
        started = set(os.listdir(f"/proc/{pid}/task")) - before  # onnxruntime's pool
        assert started, "onnxruntime started no thread for intra_op_threads = 2"
        assert {_cpus_allowed(pid, int(t)) for t in started} == {str(core)}
        pinned.run(VAD)
        ((tid, allowed),) = pinned.threads()
        assert allowed == [core] and _cpus_allowed(pid, tid) == str(core)
        free.run(VAD)  # the same caller: the same channel, so the same worker thread
        assert free.threads() == [(tid, cores)] and pinned.threads() == []
        pinned.run(VAD)
        assert pinned.threads() == [(tid, [core])]
    finally:
        pinned.unload()
        free.unload()


def test_a_killed_worker_fails_the_run_it_held_and_the_model_loads_again(pool, models_dir):
    model = WorkerModel(pool, vad_call(models_dir), 60.0)
    first = model.run(VAD)
    pid = model.pid
    os.kill(pid, signal.SIGKILL)
    poll(lambda: not model.worker.alive, 10)
    # the next run starts a new worker and loads the model again
    again = model.run(VAD)
    assert model.pid != pid
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    assert pool.restarts[("onnxruntime", "signal")] == 1
    # a run in progress when its worker dies gets the reason
    big = dict(VAD, input=np.zeros((20000, 512), np.float32),
               state=np.zeros((2, 20000, 128), np.float32))
    try:
        for _ in range(10):  # until a kill lands inside a run
            w = model.worker
            model.run(big)  # loaded again if the last kill landed between runs
            killer = threading.Timer(0.02, lambda: os.kill(w.pid, signal.SIGKILL))
            killer.start()
            try:
                model.run(big)
            except WorkerDied as e:
                assert e.code is ErrorCode.UNAVAILABLE
                assert e.message == (f"engine onnxruntime (worker {w.pid}) died of SIGKILL "
                                     f"while running vad version 1")
                break
            finally:
                killer.join()
        else:
            pytest.fail("no kill landed inside a run")
    finally:
        model.unload()


def _bystander() -> subprocess.Popen:
    """A process of this test's that plays whoever got a reaped worker's pid next (a
    number is reused once pids wrap: at 32,768 by default, within one suite run)."""
    return subprocess.Popen(["sleep", "60"])


def _ended_by(p: subprocess.Popen) -> int:
    """The signal ``p`` ended of after this SIGTERM: SIGKILL if one was sent it before
    (the kernel fixes a process's end when a SIGKILL is sent, whatever comes after)."""
    p.terminate()
    return -p.wait(timeout=30)


def test_killing_a_worker_whose_end_was_reported_signals_nobody(pool, models_dir):
    """A worker is signalled through its pidfd only; once its end is reported its pid
    may be another process's. The old code fell back to os.kill(pid) there, from every
    path that kills (a broken channel, kill_after_s, the memory limit, a stop)."""
    model = WorkerModel(pool, vad_call(models_dir), 60.0)
    model.run(VAD)
    w = model.worker
    os.kill(w.pid, signal.SIGKILL)
    poll(lambda: not w.alive, 10)
    other = _bystander()
    try:
        w.pid = other.pid  # its number taken by another process
        pool.kill(w, "was killed: its channel broke")
        assert _ended_by(other) == signal.SIGTERM
    finally:
        other.kill()
        other.wait()


def test_a_zygote_closed_twice_signals_nobody_the_second_time():
    z = Zygote(_echo_worker, lambda pid, status: None)
    z.start()
    z.close()
    other = _bystander()
    try:
        z.pid = other.pid  # reaped: its number taken by another process
        z.close()
        assert _ended_by(other) == signal.SIGTERM
    finally:
        other.kill()
        other.wait()


def test_a_worker_models_working_memory_is_measured_in_the_worker(pool, models_dir):
    from inferd.daemon.memory import METER

    model = WorkerModel(pool, vad_call(models_dir), 60.0)
    try:
        meter = METER.for_engine(lambda: model)
        big = dict(VAD, input=np.zeros((4000, 512), np.float32),
                   state=np.zeros((2, 4000, 128), np.float32))
        model.run(VAD)
        out, used, alone = meter.measure(lambda: model.run(big))
        assert alone and out["output"].shape == (4000, 1)
        # the run's activations live in the worker: several MiB there (8 MiB of input
        # alone is read in place from the arena, which is the daemon's memory)
        assert used > 8 * 2**20, used
        _, here, _ = METER.measure(lambda: model.run(big))
        assert here < used / 2, (here, used)  # the daemon's own heap hardly moves
        assert meter.rss() > 20 * 2**20 and meter.rss() != METER.rss()
    finally:
        model.unload()


def test_a_worker_with_no_model_ends_after_idle_exit_s_unless_a_load_comes(models_dir):
    p = new_pool(idle_exit_s=1.0)
    try:
        model = WorkerModel(p, vad_call(models_dir), 60.0)
        pid = model.pid
        model.unload()
        again = WorkerModel(p, vad_call(models_dir), 60.0)  # within the grace: same one
        assert again.pid == pid
        again.run(VAD)
        again.unload()
        poll(lambda: not again.worker.alive, 20)
        assert p.pids() == {}
        assert p.restarts == {}  # an expected end, not a death
    finally:
        p.close()


def test_a_measuring_worker_ends_as_soon_as_its_candidate_is_unloaded(models_dir):
    """Not after idle_exit_s: its memory beside the serving workers made the peak."""
    import dataclasses

    from inferd.daemon.workers.pool import MEASURING

    p = new_pool(idle_exit_s=600.0)
    try:
        call = dataclasses.replace(vad_call(models_dir), key="vad@onnxruntime" + MEASURING)
        rival = WorkerModel(p, call, 60.0)
        serving = WorkerModel(p, vad_call(models_dir), 60.0)
        rival.run(VAD)
        rival.unload()
        poll(lambda: not rival.worker.alive, 20)  # well within idle_exit_s
        serving.unload()
        assert serving.worker.alive  # a serving worker still waits idle_exit_s
        assert p.pids() == {"onnxruntime": serving.pid}
        assert p.restarts == {}  # an expected end, not a death
    finally:
        p.close()


def test_the_activations_of_a_model_in_a_worker_are_sized_there(pool, models_dir):
    from inferd.daemon.activations import Activations

    path = models_dir / "vad" / "1" / "model.onnx"
    shapes = {"input": (8, 512), "state": (2, 8, 128), "sr": ()}
    values = {"sr": np.array(16000, np.int64)}
    model = WorkerModel(pool, vad_call(models_dir), 60.0)
    try:
        assert model.peak(shapes, values) == Activations(path).peak(shapes, values)
    finally:
        model.unload()


def test_a_message_the_worker_cannot_read_is_answered_not_left_hanging(pool, models_dir):
    model = WorkerModel(pool, vad_call(models_dir), 60.0)
    try:
        import pickle
        import struct

        w = model.worker
        channel = pool._channel(w, "a test")
        body = pickle.dumps(({"op": "run", "handle": model.handle},
                             [("x", "<zz9", (1,), True, 0, 0)], None))  # no such dtype
        channel.sock.sendmsg([struct.pack("<I", len(body)), body])
        channel.settimeout(20.0)
        reply, _, _ = channel.receive()
        assert reply["error"][1] == "INTERNAL" and "zz9" in reply["error"][2], reply
        channel.close()
        # a dtype the daemon itself cannot name is refused before anything is sent
        odd = {"input": np.zeros(2, np.dtype([("a", "<i4"), ("b", "<f4")]))}  # a record
        with pytest.raises(InferdError) as e:
            model.run(odd)
        assert not isinstance(e.value, WorkerDied), e.value.message
        model.run(VAD)  # and the worker serves on
    finally:
        model.unload()


def unary_model(repo: Path, name: str, op: str) -> Path:
    """``repo/name/1/model.onnx``: the one ONNX node ``op`` (Identity, Neg...) from
    float32 ``x`` [a, b] to ``y``; its path."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], name, [x], [y])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = repo / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(m, path)
    return path


def identity_call(tmp_path: Path) -> LoadCall:
    """An onnxruntime Identity on float32 [a, b], loaded in the pool's onnxruntime worker."""
    path = unary_model(tmp_path, "identity", "Identity")
    return LoadCall("onnxruntime", path, LoadOptions(), "identity version 1",
                    path.parents[1], (), {}, 10.0, key="onnxruntime")


def test_reply_tensors_lent_the_worker_arena_are_never_written_over(pool, tmp_path):
    """A run's big outputs are views of the worker's arena, not copies (issue 30, item
    2); its channel carries no call while any of them lives. Hostile: replies held while
    many more big runs go, from one thread and from several at once, each compared bit
    for bit with its input at the end."""
    from inferd.daemon.workers.pool import LENT_MAX

    model = WorkerModel(pool, identity_call(tmp_path), 60.0)
    rng = np.random.default_rng(11)
    try:
        # distinct sizes and values (>= INLINE_BYTES: through the arena): a reply
        # written over by a later one cannot compare equal
        xs = [rng.random((64, 1024 + i), dtype=np.float32) for i in range(LENT_MAX + 3)]
        held = [model.run({"x": x})["y"] for x in xs]
        w = model.worker
        assert sum(c.lent() for c in w.lent) == LENT_MAX
        # lent: views (no copy), writable as copies are; past LENT_MAX copied out
        assert [not y.flags.owndata for y in held] == [True] * LENT_MAX + [False] * 3
        assert all(y.flags.writeable for y in held)
        for x, y in zip(xs, held):
            assert y.shape == x.shape and y.tobytes() == x.tobytes()
        channels = len(w.idle) + len(w.lent)
        assert channels == LENT_MAX + 1
        del held, y
        for x in xs:  # their tensors gone: the lent channels serve again, none is made
            assert model.run({"x": x})["y"].tobytes() == x.tobytes()
        assert len(w.idle) + len(w.lent) == channels

        failures: list[str] = []
        views: list[int] = []
        all_ran = threading.Barrier(6, timeout=60)

        def client(k: int) -> None:
            mine = np.random.default_rng(100 + k)
            kept = []
            for i in range(12):  # one shape after the first runs: the engine writes
                # its outputs into the arena itself (their shapes known from a run)
                x = mine.random((32 + k, 2048 + min(i, 2)), dtype=np.float32)
                y = model.run({"x": x})["y"]
                if i % 3:  # some held to the end, some dropped at once
                    kept.append((x, y))
                elif y.tobytes() != x.tobytes():
                    failures.append(f"client {k} run {i}: wrong at once")
            views.append(sum(not y.flags.owndata for _, y in kept))
            all_ran.wait()  # every client's kept replies alive at once
            for i, (x, y) in enumerate(kept):
                if y.tobytes() != x.tobytes():
                    failures.append(f"client {k} kept {i}: written over")

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        assert 1 <= sum(views) <= LENT_MAX  # 48 kept, at most LENT_MAX of them lent
    finally:
        model.unload()


def _arenas(pid: int) -> int:
    """Channel arenas a process maps (each end maps its own and its peer's)."""
    return sum("inferd-worker-arena" in line
               for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_channels_unused_for_channel_idle_s_are_closed_with_their_arenas(tmp_path):
    """Calls in flight at once open a channel each, and each keeps an arena at both
    ends as large as its largest message: after a burst, those left unused for
    ``channel_idle_s`` are closed, their arenas unmapped in the worker and here, the
    worker's threads that served them ended; a run afterwards opens a channel again and
    is right. Before, every channel a burst opened stayed, arenas resident, for as long
    as the worker lived."""
    p = new_pool(channel_idle_s=0.5)
    model = WorkerModel(p, identity_call(tmp_path), 60.0)
    try:
        w = model.worker
        threads_before = len(os.listdir(f"/proc/{w.pid}/task"))
        here_before = _arenas(os.getpid())  # another test's, still viewed, if any
        x = np.random.default_rng(5).random((256, 1024), dtype=np.float32)  # 1 MiB
        started = threading.Barrier(4, timeout=60)
        wrong: list[int] = []

        def burst(k: int) -> None:
            started.wait()
            for _ in range(20):
                if model.run({"x": x + k})["y"].tobytes() != (x + k).tobytes():
                    wrong.append(k)
        runners = [threading.Thread(target=burst, args=(k,)) for k in range(4)]
        for t in runners:
            t.start()
        for t in runners:
            t.join(60)
        assert wrong == []
        opened = len(w.idle) + len(w.lent)
        assert opened >= 2, "the burst ran its calls one at a time"
        assert _arenas(w.pid) >= 2 * opened  # its own and the daemon's, per channel
        poll(lambda: not w.idle and not w.lent and _arenas(w.pid) == 0, 30)
        assert _arenas(os.getpid()) == here_before
        poll(lambda: len(os.listdir(f"/proc/{w.pid}/task")) < threads_before + opened, 30)
        assert model.run({"x": x})["y"].tobytes() == x.tobytes()  # a channel again
        assert len(w.idle) + len(w.lent) == 1
    finally:
        model.unload()
        p.close()


def test_channels_closed_while_calls_come_and_go_lose_no_call(tmp_path):
    """Hostile timing: channels shed every few milliseconds (``channel_idle_s`` 5 ms)
    while three threads run calls with pauses of about that length between them, big
    (through the arenas) and small: every run answered, right; none fails for a channel
    closed under it."""
    p = new_pool(channel_idle_s=0.005)
    model = WorkerModel(p, identity_call(tmp_path), 60.0)
    try:
        failures: list[str] = []

        def client(k: int) -> None:
            rng = np.random.default_rng(k)
            for i in range(60):
                x = rng.random((64 if i % 2 else 1, 1024), dtype=np.float32)
                try:
                    if model.run({"x": x})["y"].tobytes() != x.tobytes():
                        failures.append(f"client {k} run {i}: wrong")
                except Exception as e:  # noqa: BLE001  every failure is one to report
                    failures.append(f"client {k} run {i}: {e!r}")
                time.sleep(float(rng.random()) * 0.01)
        runners = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in runners:
            t.start()
        for t in runners:
            t.join(120)
        assert not any(t.is_alive() for t in runners)
        assert failures == []
        w = model.worker
        poll(lambda: not w.idle and not w.lent, 30)
        assert model.worker.alive
    finally:
        model.unload()
        p.close()


def nonzero_call(tmp_path: Path) -> LoadCall:
    """NonZero: outputs whose shape depends on the input's values."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1, "k"])
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "nz", [x], [y])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = tmp_path / "nonzero" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(m, path)
    return LoadCall("onnxruntime", path, LoadOptions(), "nonzero version 1",
                    path.parents[1], (), {}, 10.0, key="onnxruntime")


def test_outputs_of_another_shape_than_the_last_run_are_still_right(pool, tmp_path):
    """An engine writes outputs into the arena at the shapes the last run of the same
    input shapes gave; NonZero's depend on the values: the bound run is refused by
    onnxruntime and the run answered plainly, right each time."""
    model = WorkerModel(pool, nonzero_call(tmp_path), 60.0)
    rng = np.random.default_rng(5)
    try:
        for zeros in (0.5, 0.2, 0.2, 0.7, 0.5):
            x = (rng.random(200_000) > zeros).astype(np.float32) * 3
            y = model.run({"x": x})["y"]
            expected = np.stack(np.nonzero(x))
            assert y.shape == expected.shape and y.tobytes() == expected.tobytes()
    finally:
        model.unload()


def test_an_engine_writes_outputs_asked_into_a_region_there_itself(tmp_path):
    """The worker's side (no process): a client that asks its outputs into its region
    (outputs_into) has onnxruntime write the big ones straight into its slot from the
    second run of a shape on, at the offsets the slot's rule gives (those _place
    reports), so that nothing copies them there; small ones are copied after them, and
    one that does not fit goes back through the channel."""
    import mmap

    from inferd.daemon.workers.process import WorkerProcess, _address

    backend = _onnxruntime_cpu()
    model = backend.load(identity_call(tmp_path).path, LoadOptions())
    worker = WorkerProcess("t", Registry(), None)
    worker.models[1] = model
    size = 4 * 2**20
    fd = os.memfd_create("region")
    os.ftruncate(fd, size)
    worker._map([(7, size, True)], [os.dup(fd)])
    view = mmap.mmap(fd, size)  # the client's own mapping of its region
    rng = np.random.default_rng(4)
    try:
        base = _address(worker._regions[7][0])
        for run in range(3):
            x = rng.random((256, 512), dtype=np.float32)  # 512 KiB: a big output
            header = {"into": (7, 100, size), "outputs": None}
            out = worker._outputs.run(1, model, {"x": x}, None, worker._slot(header))
            in_place = out["y"].__array_interface__["data"][0] == base + 128
            assert in_place == (run > 0), run  # the first run's shapes learnt
            reply: dict = {}
            rest = worker._place(header, out, reply)
            assert rest == {} and reply["placed"]["y"][0] == 128  # 100 aligned up to 64
            assert view[128:128 + x.nbytes] == x.tobytes()
            del out, rest
        # a slot too small for the output: no room reserved, it goes back as it came
        x = rng.random((256, 512), dtype=np.float32)
        header = {"into": (7, 0, x.nbytes - 1), "outputs": None}
        out = worker._outputs.run(1, model, {"x": x}, None, worker._slot(header))
        reply = {}
        rest = worker._place(header, out, reply)
        assert list(rest) == ["y"] and reply["placed"] == {}
        assert rest["y"].tobytes() == x.tobytes()
        assert 1 not in worker._outputs._plain
    finally:
        del out, rest
        model.unload()
        worker._forget([7])
        view.close()
        os.close(fd)


def test_an_engine_writes_its_outputs_into_the_arena_and_they_are_sent_in_place(tmp_path):
    """The worker's side (no process): the second run of a shape has onnxruntime write
    its big outputs into the channel's arena (IOBinding), and sending them copies
    nothing; the peer reads them right. A model whose engine does not write there is
    asked once."""
    from inferd.daemon.workers.process import OutputsInArena, _arena

    backend = _onnxruntime_cpu()
    model = backend.load(identity_call(tmp_path).path, LoadOptions())
    a, b = pair()
    ours, theirs = Channel(a), Channel(b)
    outputs = OutputsInArena()
    rng = np.random.default_rng(9)
    try:
        copied = []
        for _ in range(3):
            x = rng.random((256, 512), dtype=np.float32)
            before = ours.arena_bytes
            out = outputs.run(1, model, {"x": x}, None, _arena(ours))
            ours.send({"ok": True}, out)
            copied.append(ours.arena_bytes - before)
            _, got, _ = theirs.receive(copy=True)
            assert got["y"].tobytes() == x.tobytes()
        assert copied == [x.nbytes, 0, 0]  # the first run's shapes learnt, then in place

        class Plain(LoadedModel):  # an engine without run_into: the contract's default
            def run(self, inputs, outputs=None):
                return model.run(inputs, outputs)

            def unload(self):
                pass

        for _ in range(3):
            x = rng.random((256, 512), dtype=np.float32)
            out = outputs.run(2, Plain(), {"x": x}, None, _arena(ours))
            assert out["y"].tobytes() == x.tobytes()
        assert 2 in outputs._plain  # asked once, then run plainly
    finally:
        model.unload()
        ours.close()
        theirs.close()
