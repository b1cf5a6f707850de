"""A graph's processor node whose step kills the processors worker, through a real
daemon: the death is charged to the request's client as a model's ``[[pre]]`` step's is
(daemon/workers/quarantine.py, ``ModelCaller.charge`` in daemon/executors.py), so a
client whose graph requests keep killing it is refused for that graph, and served the
models still."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import ErrorCode, RequestError
from tests.e2e.test_processors_worker import _daemon

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("executor", ["pipeline", "task"])
def test_a_client_whose_graph_node_keeps_killing_the_processors_worker_is_refused(
        executor: str, start_daemon, short_tmp: Path) -> None:
    """A processor node's deaths are charged as a [[pre]] step's are, once per request
    (the graph's other processor node may be in the worker too): the client is refused
    for the graph at the second; the models (neg, whose own step is the same processor)
    still serve it."""
    d = _daemon(start_daemon, short_tmp, "refuse_client_after = 2\n")
    graph = short_tmp / "repo" / "g" / "graph.toml"  # loaded at its first request
    graph.write_text(f'executor = "{executor}"\n' + graph.read_text())
    ok = np.full((1, 4), 10, np.float32)
    with d.client() as c:
        np.testing.assert_array_equal(c.infer("g", {"x": ok})["y"], -(ok + 2))
        for _ in range(2):
            with pytest.raises(RequestError) as e:
                c.infer("g", {"x": np.full((1, 4), 1, np.float32)})
            # the node that tells may be the other one, in the worker as it died: running
            # its step, or building it (its first call in a worker started again)
            assert re.fullmatch(r"graph g: node (crashy|shrink): processors \(worker \d+\) "
                                r"died of SIGABRT while running (the build of )?processor "
                                r"(crashy|image\.resize)", e.value.message), e.value.message
        with pytest.raises(RequestError) as e:
            c.infer("g", {"x": ok})
        assert e.value.code is ErrorCode.UNAVAILABLE
        assert e.value.message.startswith(f"model g: uid {os.getuid()} is refused for "), \
            e.value.message
        np.testing.assert_array_equal(c.infer("neg", {"x": ok})["y"], -(ok + 1))
    assert re.search(rf"model g: uid {os.getuid()} refused for 60 s", d.log()), d.log()


def test_a_graph_whose_node_kills_the_worker_for_several_clients_is_set_aside(
        start_daemon, short_tmp: Path) -> None:
    """Two clients (uids) whose graph requests killed the processors worker: the graph is
    set aside for everyone, shown FAILED with the reason in ``models`` (as a model set
    aside is), until a reload."""
    from tests.e2e.test_workers import _need_root, set_aside_by_two_clients

    _need_root()
    os.chmod(short_tmp, 0o755)  # the other uid reaches the socket
    # the [server] table rides in after [workers]' keys: _daemon writes no [server]
    d = _daemon(start_daemon, short_tmp, 'refuse_client_after = 5\nset_aside_after = 2\n'
                '[server]\nsocket_mode = "0666"\n')
    ok, bad = np.full((1, 4), 10, np.float32), np.full((1, 4), 1, np.float32)
    with d.client() as c:
        row = set_aside_by_two_clients(d, c, "g", bad, ok, "UNAVAILABLE: graph g: node ")
        assert row["kind"] == "graph", row
        np.testing.assert_array_equal(c.infer("neg", {"x": ok})["y"], -(ok + 1))
        c.call("reload")
        np.testing.assert_array_equal(c.infer("g", {"x": ok})["y"], -(ok + 2))
        row = next(m for m in c.models() if m["name"] == "g")
        assert row["state"] == "ready" and row["error"] is None, row
    assert "ERROR inferd.daemon.workers.quarantine: model g set aside" in d.log()
