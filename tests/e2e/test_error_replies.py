"""Every path from an exception to a reply goes through ``inferd.ipc.errors.failure``:
an exception that is not an InferdError, raised where a request is being served, is a
coded INTERNAL reply carrying the request's id (and a logged traceback), never a
request left without an answer (issue 12 item 9, issue 14 item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.ipc import ErrorCode
from inferd.ipc.protocol import Op

# A user processor whose factory fails with an exception inferd does not expect
# (RuntimeError is not among the parameter errors the registry turns into a load error).
BROKEN = '''
def make_exploding(**params):
    raise RuntimeError("boom while building the step")

PROCESSORS = {"exploding": make_exploding}
'''

GRAPH = '''
inputs = ["x"]
[outputs]
y = "bad.y"

[[nodes]]
name = "bad"
processor = "exploding"
inputs = { x = "input.x" }
'''


def _daemon_with_broken_graph(start_daemon, short_tmp: Path):
    (short_tmp / "processors").mkdir()
    (short_tmp / "processors" / "broken.py").write_text(BROKEN)
    (short_tmp / "repo" / "g").mkdir(parents=True)
    (short_tmp / "repo" / "g" / "graph.toml").write_text(GRAPH)
    config = short_tmp / "inferd.toml"
    config.write_text(f'[models]\nrepository = "{short_tmp / "repo"}"\n'
                      f'[processors]\ndirectory = "{short_tmp / "processors"}"\n')
    return start_daemon("--config", str(config))


@pytest.mark.slow
def test_unexpected_exception_in_a_graph_load_is_an_internal_reply_with_the_id(
        start_daemon, short_tmp: Path) -> None:
    d = _daemon_with_broken_graph(start_daemon, short_tmp)
    with d.client(timeout=20) as c:
        for op in (Op.LOAD, Op.UNLOAD, Op.LOAD):
            pending = c.submit(op, "g")
            reply = pending.reply()
            if op is Op.UNLOAD:  # nothing loaded: unloading is a no-op that succeeds
                assert reply.ok, reply
                continue
            assert reply.id == pending.id  # before the fix: no reply, a timeout
            assert reply.error is not None and reply.error.code is ErrorCode.INTERNAL, reply
            assert "RuntimeError: boom while building the step" in reply.error.message
        assert c.ping()["pong"]  # the control thread survived
        row = next(m for m in c.models() if m["name"] == "g")
        assert row["state"] == "failed" and "RuntimeError: boom" in row["error"]
    log = d.log()
    assert "graph g failed to load: graph g: RuntimeError: boom while building" in log
    assert "Traceback" in log
