"""A client's shared-memory region and a worker process (issue 30, item 2; issue 31,
item 4), without a daemon: a tensor decoded from a region crosses to the worker by
reference (its descriptor passed once, no copy into the channel's arena), outputs asked
into a region are written there by the worker and claimed by the reply without a copy, a
released region is unmapped and closed in the worker, a worker started again gets the
descriptor again, and a region released before its request runs is still answered (by a
copy). Descriptors are counted in both processes before and after."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from inferd.daemon.workers.pool import OUTPUTS_INTO, LoadCall, WorkerModel, WorkerPool
from inferd.ipc.protocol import Reply, Slot, encode_reply, plan_tensors
from inferd.ipc.shm import map_region, shared_of
from inferd.libbackends.contract import LoadOptions
from tests.daemon.test_workers import new_pool
from tests.e2e.test_cache_reload import poll

SIZE = 8 * 2**20
X = np.random.default_rng(7).random((256, 1024), dtype=np.float32)  # 1 MiB: not inline


@pytest.fixture
def pool():
    p = new_pool()
    yield p
    p.close()


@pytest.fixture
def model(pool: WorkerPool, tmp_path: Path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["a", "b"])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"]),
                               helper.make_node("Abs", ["x"], ["z"])], "g", [x], [y, z])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = tmp_path / "neg" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(m, path)
    call = LoadCall("onnxruntime", path, LoadOptions(), "neg version 1", path.parents[1],
                    (), {}, 10.0, key="onnxruntime")
    wm = WorkerModel(pool, call, 60.0)
    yield wm
    wm.unload()


def region(name: str) -> tuple[np.ndarray, object]:
    """A sealed memfd mapped as the registration service maps it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return map_region(fd, SIZE)


def decoded(data: np.ndarray, offset: int) -> np.ndarray:
    """X written into the region at ``offset`` and decoded from a request header, as the
    server decodes it (a view of the region)."""
    np.frombuffer(data, np.float32, X.size, offset)[...] = X.reshape(-1)
    planned, _ = plan_tensors([{"name": "x", "dtype": "float32", "shape": list(X.shape),
                                "region": "t", "offset": offset}], [], "request inputs",
                              lambda token: memoryview(data))
    return planned["x"]


def links(pid: int) -> list[str]:
    """What ``pid``'s descriptors are open on."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def fds(pid: int, name: str | None = None) -> int:
    """Descriptors of ``pid`` (open on memfd ``name`` if given)."""
    return sum(name is None or t == f"/memfd:{name} (deleted)" for t in links(pid))


def mappings(pid: int, name: str) -> list[str]:
    """``pid``'s mappings of memfd ``name`` (their permissions)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.split()[1] for line in f if f"/memfd:{name} " in line]


def arena_bytes(model: WorkerModel) -> int:
    """Bytes the daemon copied into its arenas, on every channel of ``model``'s worker
    (those lent to a run's outputs too)."""
    return sum(c.arena_bytes for c in (*model.worker.idle, *model.worker.lent))


def test_a_region_crosses_by_reference_and_outputs_land_where_the_daemon_places_them(
        pool: WorkerPool, model: WorkerModel) -> None:
    model.run({"x": X})  # its channel and both arenas made: counted from here
    copied = arena_bytes(model)
    assert copied == X.nbytes  # (a tensor in frames goes through the arena)
    pid, mine = model.pid, fds(os.getpid())
    theirs = fds(pid)
    data, shared = region("inferd-t1")
    x = decoded(data, 4096)
    assert shared_of(x) == (shared, 4096)
    # 1. the input by reference: no byte of it in the arena, the region mapped read-only
    out = model.run({"x": x})
    np.testing.assert_array_equal(out["y"], -X)
    np.testing.assert_array_equal(out["z"], np.abs(X))
    assert pool.by_reference == X.nbytes and arena_bytes(model) == copied
    assert mappings(pid, "inferd-t1") == ["r--s"] and fds(pid, "inferd-t1") == 1
    del out  # its tensors view the worker's arena: the next run takes the same channel
    model.run({"x": x})  # the descriptor is passed once
    assert fds(pid, "inferd-t1") == 1 and arena_bytes(model) == copied
    # 2. outputs into the region: written by the worker where Slot.place puts them
    slot = Slot("t", memoryview(data), 2 * 2**20 + 8, 4 * 2**20)
    OUTPUTS_INTO.slot = slot
    out = model.run({"x": x})
    assert OUTPUTS_INTO.slot is None  # taken by that run
    assert mappings(pid, "inferd-t1") == ["rw-s"]  # mapped again, writable
    base = data.__array_interface__["data"][0]
    y_at = out["y"].__array_interface__["data"][0] - base
    z_at = out["z"].__array_interface__["data"][0] - base
    assert (y_at, z_at) == (2 * 2**20 + 64, 2 * 2**20 + 64 + X.nbytes)  # 64-aligned
    np.testing.assert_array_equal(np.frombuffer(data, np.float32, X.size, y_at),
                                  -X.reshape(-1))
    frames = encode_reply(Reply("r", outputs=out), slot)
    assert len(frames) == 2 and b'"offset":%d' % y_at in bytes(frames[1])  # claimed
    assert arena_bytes(model) == copied
    # a slot too small: the same error as in-process, the worker alive
    small = Slot("t", memoryview(data), 0, X.nbytes + 10)
    OUTPUTS_INTO.slot = small
    out = model.run({"x": x})
    reply = encode_reply(Reply("r", outputs=out), small)
    assert b"the outputs need more" in bytes(reply[1])
    # 3. released: unmapped and closed in the worker, then in this process
    del out, frames, reply, x, slot, small
    shared.release()
    poll(lambda: not mappings(pid, "inferd-t1"), 10)
    assert fds(pid, "inferd-t1") == 0 and fds(pid) == theirs
    del data, shared
    assert fds(os.getpid(), "inferd-t1") == 0 and fds(os.getpid()) == mine


def test_a_worker_started_again_gets_the_region_again_and_a_released_one_is_copied(
        pool: WorkerPool, model: WorkerModel) -> None:
    data, shared = region("inferd-t2")
    x = decoded(data, 0)
    np.testing.assert_array_equal(model.run({"x": x})["y"], -X)
    first = model.pid
    assert fds(first, "inferd-t2") == 1
    os.kill(first, 9)
    poll(lambda: not model.worker.alive, 10)
    np.testing.assert_array_equal(model.run({"x": x})["y"], -X)  # loaded again
    assert model.pid != first and fds(model.pid, "inferd-t2") == 1
    assert arena_bytes(model) == 0
    # released while its request waits: answered from the daemon's view (copied)
    shared.release()
    poll(lambda: not mappings(model.pid, "inferd-t2"), 10)
    np.testing.assert_array_equal(model.run({"x": x})["y"], -X)
    assert arena_bytes(model) == X.nbytes and not mappings(model.pid, "inferd-t2")
    del x
    del data, shared
    assert fds(os.getpid(), "inferd-t2") == 0


def test_a_region_released_during_its_run_is_forgotten_after_it(
        pool: WorkerPool, model: WorkerModel) -> None:
    """Released while a run reads it: that run is answered right, and the worker unmaps
    the region once the run is out (whichever comes first)."""
    data, shared = region("inferd-t3")
    x = decoded(data, 0)
    big = np.frombuffer(data, np.float32, 2 * 2**20 - 4096, 4096).reshape(-1, 1024)
    big[...] = 1.0
    model.run({"x": x})
    got: dict[str, np.ndarray] = {}
    run = threading.Thread(target=lambda: got.update(model.run({"x": big})))
    run.start()
    shared.release()
    run.join(30)
    assert float(got["y"].min()) == float(got["y"].max()) == -1.0
    poll(lambda: not mappings(model.pid, "inferd-t3"), 10)
    assert fds(model.pid, "inferd-t3") == 0 and not pool._uses and not pool._shared


def test_a_worker_takes_regions_up_to_its_share_of_descriptors_then_copies(
        pool: WorkerPool, model: WorkerModel) -> None:
    pool.region_limit = 1
    first, s1 = region("inferd-t4")
    second, s2 = region("inferd-t5")
    np.testing.assert_array_equal(model.run({"x": decoded(first, 0)})["y"], -X)
    copied = arena_bytes(model)
    np.testing.assert_array_equal(model.run({"x": decoded(second, 0)})["y"], -X)
    assert arena_bytes(model) == copied + X.nbytes  # past the share: copied
    assert fds(model.pid, "inferd-t4") == 1 and fds(model.pid, "inferd-t5") == 0
    s1.release()
    s2.release()
    poll(lambda: not mappings(model.pid, "inferd-t4"), 10)
