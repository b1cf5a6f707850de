"""Hostile input against a real daemon (issue 12): hostile headers, mutated and random
frames, from a client the ``[access]`` allow-list serves and, at the same time, from one
it refuses (another uid). Exactly one reply per message, the right code for every
message whose id is known, no INTERNAL, no daemon death, RSS growth under a bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.fuzz_kit import TAG, Fuzzer

ROOT = Path(__file__).resolve().parents[2]
RSS_GROWTH_BOUND = 64 * 2**20
"""Most the daemon's RSS may grow between the end of the warm-up and the end."""


def _needs_root() -> None:
    if os.getuid() != 0:
        if os.environ.get("INFERD_TEST_ROOT"):
            pytest.fail("the refused-peer fuzz needs root (to run a client as another uid)")
        pytest.skip("needs root: a client of another uid plays the refused peer")


def _daemon(start_daemon, short_tmp: Path, models_dir: Path):
    config = short_tmp / "inferd.toml"
    config.write_text(f"[server]\nsocket_mode = \"0666\"\n[access]\nuids = [{os.getuid()}]\n")
    os.chmod(short_tmp, 0o755)  # the refused peer must reach the socket itself
    return start_daemon("--config", str(config), "--models", str(models_dir))


def _refused_peer(endpoint: str, count: int, seed: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.fuzz_kit", endpoint, str(count), str(seed),
         "refused"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _check(result: dict, who: str) -> None:
    assert result["replies"] == result["sent"], (who, result)
    assert result["missing_count"] == 0, (who, result)
    assert result["problem_count"] == 0, (who, result)
    assert "INTERNAL" not in result["codes"], (who, result)


def _fuzz(start_daemon, short_tmp, models_dir, count: int) -> None:
    _needs_root()
    d = _daemon(start_daemon, short_tmp, models_dir)
    proc = psutil.Process(d.proc.pid)
    refused = _refused_peer(d.endpoint, count // 4, seed=2)
    fuzzer = Fuzzer(d.endpoint, seed=1)
    try:
        warm = fuzzer.run(max(500, count // 10))
        _check(warm, "allowed peer, warm-up")
        rss_warm = proc.memory_info().rss
        fuzzer.problems.clear()
        result = fuzzer.run(count)
        rss_end = proc.memory_info().rss
    finally:
        fuzzer.close()
    out, err = refused.communicate(timeout=600)
    assert refused.returncode == 0, err
    assert d.proc.poll() is None, f"the daemon died:\n{d.log()[-3000:]}"
    _check(result, "allowed peer")
    _check(json.loads(out), "refused peer")
    assert result["codes"].get("INVALID_ARGUMENT", 0) > count // 10
    assert rss_end - rss_warm < RSS_GROWTH_BOUND, (rss_warm, rss_end)
    with d.client(timeout=10) as c:
        assert c.ping()["pong"] is True
    assert "Traceback" not in d.log()
    assert d.stop() == 0


def test_fuzz_fast(start_daemon, short_tmp, models_dir):
    """`make test`'s fuzz: the same checks as the 100,000 below (one reply per message,
    the right codes, no INTERNAL, no death, the RSS bound), on 3,000 messages."""
    _fuzz(start_daemon, short_tmp, models_dir, 3000)


@pytest.mark.slow
@pytest.mark.soak
def test_fuzz_20k(start_daemon, short_tmp, models_dir):
    """The same checks on 20,000 messages (~15 s on 2 cores), in `make soak` beside the
    100,000 below: `make test` has the 3,000 above, and a leak too small for the RSS
    bound over 3,000 messages is the 100,000's to find."""
    _fuzz(start_daemon, short_tmp, models_dir, 20_000)


@pytest.mark.slow
@pytest.mark.soak
def test_fuzz_100k(start_daemon, short_tmp, models_dir):
    """The issue's >= 100,000 messages, in `make soak` (~70 s on 2 cores)."""
    _fuzz(start_daemon, short_tmp, models_dir, 100_000)


@pytest.mark.slow
def test_refused_peer_cannot_kill_the_daemon_with_one_header(start_daemon, short_tmp,
                                                             models_dir):
    """Issue 12 item 1: the headers that killed the daemon through _refuse."""
    _needs_root()
    d = _daemon(start_daemon, short_tmp, models_dir)
    script = (
        "import sys, zmq, json\n"
        "from tests.e2e.fuzz_kit import become_nobody; become_nobody()\n"
        "s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1])\n"
        "for n in (b'9' * 5000, b'[' * 100000 + b']' * 100000):\n"
        "    s.send_multipart([%r, b'{\"id\":\"x\",\"op\":\"ping\",\"n\":' + n + b'}'])\n"
        "    assert s.poll(20000), 'no reply'\n"
        "    print(json.dumps(json.loads(s.recv_multipart()[1])))\n" % TAG)
    out = subprocess.run([sys.executable, "-c", script, d.endpoint], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["id"], r["error"]["code"]) for r in replies] == \
        [("x", "PERMISSION_DENIED")] * 2
    time.sleep(0.2)
    assert d.proc.poll() is None, d.log()
    with d.client(timeout=10) as c:  # the allowed peer, same headers: INVALID_ARGUMENT
        assert c.ping()["pong"] is True
    assert d.stop() == 0
