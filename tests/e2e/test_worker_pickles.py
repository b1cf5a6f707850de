"""A taken-over processors worker through a real daemon: a graph node whose step writes a
pickle naming ``os.system`` on its channel (as the header, or as its values) costs that
request and its worker; the command never runs in the daemon, which serves the next
request, a neighbour's model, and the same graph again."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import ErrorCode, RequestError
from tests.daemon.test_worker_pickles import HOSTILE
from tests.daemon.test_workers import unary_model

pytestmark = pytest.mark.slow

GRAPH = '''
inputs = ["x"]
[outputs]
y = "evil.x"

[[nodes]]
name = "evil"
processor = "hostile"
params = {{ marker = "{marker}", how = "{how}" }}
inputs = {{ x = "input.x" }}
'''


@pytest.mark.parametrize("how", ["header", "values"])
def test_a_hostile_processors_worker_costs_one_request_never_the_daemon(
        how: str, start_daemon, short_tmp: Path) -> None:
    repo, processors, marker = short_tmp / "repo", short_tmp / "processors", short_tmp / "ran"
    unary_model(repo, "other", "Identity")
    (repo / "h").mkdir()
    (repo / "h" / "graph.toml").write_text(GRAPH.format(marker=marker, how=how))
    processors.mkdir()
    (processors / "hostile.py").write_text(HOSTILE)
    conf = short_tmp / "inferd.toml"
    conf.write_text(f'[workers]\nisolation = "backend"\nrestart_backoff_s = 0.1\n'
                    f'[processors]\ndirectory = "{processors}"\n'
                    f'[models]\nrepository = "{repo}"\n[metrics]\ntextfile = ""\n')
    d = start_daemon("--config", str(conf))
    ok = np.zeros((1, 4), np.float32)
    with d.client() as c:
        np.testing.assert_array_equal(c.infer("h", {"x": ok})["y"], ok + 1)
        with pytest.raises(RequestError) as e:
            c.infer("h", {"x": np.ones((1, 4), np.float32)})
        assert e.value.code is ErrorCode.UNAVAILABLE, e.value
        why = (r" for a message the daemon refuses to read: global posix\.system is not "
               r"allowed" if how == "header" else
               r" for values the daemon refuses to read \(global posix\.system is not "
               r"allowed\)")
        assert re.fullmatch(rf"graph h: node evil: processors \(worker \d+\) was killed"
                            rf"{why} while running processor hostile", e.value.message), \
            e.value.message
        assert c.ping()["pong"]
        np.testing.assert_array_equal(c.infer("other", {"x": ok})["y"], ok)
        # built again in a new processors worker
        np.testing.assert_array_equal(c.infer("h", {"x": ok})["y"], ok + 1)
    assert not marker.exists()
    assert d.proc.poll() is None
    log = d.log()
    if how == "header":  # the channel says why; the pool, whom it cost
        assert ("ERROR inferd.daemon.workers.channel: a worker sent a message the daemon "
                "refuses to read: global posix.system is not allowed") in log, log
    assert re.search(r"ERROR inferd\.daemon\.workers\.pool: processors \(worker \d+\) was "
                     r"killed", log), log

