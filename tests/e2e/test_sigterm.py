"""SIGTERM with work still queued past the grace period (issue 12, item 2): every request
is answered, the daemon exits 0 (never SIGABRT from a native thread at exit) and removes
its socket file."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from inferd.ipc import Client, RequestError
from inferd.ipc.errors import ErrorCode

pytestmark = pytest.mark.slow

RUNS = int(os.environ.get("SIGTERM_RUNS", "20"))
QUEUED = 200
SHUTDOWN = ("inferd stopped before this request finished",  # in flight at the grace's end
            "inferd is shutting down")  # read after the SIGTERM


def _sigterm_with_work_queued(start_daemon, short_tmp, models_dir, run: int) -> None:
    work = short_tmp / f"run{run}"
    work.mkdir()
    config = work / "inferd.toml"
    config.write_text("[server]\nshutdown_grace_s = 2\nmax_bytes_per_client = \"512MiB\"\n"
                      "[models]\nqueue_size = 512\n"
                      "preload = [\"ocr-rec\"]\n")
    d = start_daemon("--config", str(config), "--models", str(models_dir), workdir=work)
    # Wide lines: each run takes tens of ms, so 200 of them outlast the 2 s grace.
    x = np.random.default_rng(run).random((1, 3, 48, 1600), dtype=np.float32)
    # max_in_flight: all 200 are sent at once, not 64 at a time (the default).
    with Client(d.endpoint, timeout=60, max_in_flight=QUEUED) as c:
        pending = [c.submit("infer", "ocr-rec", {"x": x}) for _ in range(QUEUED)]
        first = pending[0].reply()  # the daemon is busy with them now
        assert first.ok, first.error
        d.proc.send_signal(signal.SIGTERM)
        codes = [first]
        for p in pending[1:]:
            reply = p.reply()  # raises RequestError(DEADLINE_EXCEEDED) if never answered
            codes.append(reply)
    # What each request got: one model instance serves one client's requests in order,
    # so the first ones are answered with the recogniser's output for x, and from the
    # end of the grace period on every other one is refused as the shutdown says.
    ok = sum(r.ok for r in codes)
    assert [r.ok for r in codes] == [True] * ok + [False] * (QUEUED - ok), \
        [i for i, r in enumerate(codes) if r.ok]
    assert 0 < ok < QUEUED, f"{ok} of {QUEUED} answered: no work was left past the grace"
    want = first.outputs
    for i, r in enumerate(codes[:ok]):
        assert r.outputs.keys() == want.keys(), (i, list(r.outputs))
        for name, value in want.items():
            np.testing.assert_array_equal(r.outputs[name], value, err_msg=f"reply {i}")
    for i, r in enumerate(codes[ok:], ok):
        assert r.error is not None and r.error.code is ErrorCode.UNAVAILABLE, (i, r.error)
        assert r.error.message in SHUTDOWN, (i, r.error)
    rc = d.proc.wait(60)
    log = d.log()
    assert rc == 0, f"exit status {rc}:\n{log[-3000:]}"
    assert "terminate called" not in log and "Socket operation on non-socket" not in log, log
    assert not d.socket_path.exists()
    assert "inferd exited cleanly" in log


def _runs(start_daemon, short_tmp, models_dir, runs: int) -> None:
    for run in range(runs):
        try:
            _sigterm_with_work_queued(start_daemon, short_tmp, models_dir, run)
        except (AssertionError, RequestError) as e:
            raise AssertionError(f"run {run + 1} of {runs}: {e}") from e


def test_sigterm_with_200_queued_and_2s_grace_3_times(start_daemon, short_tmp, models_dir):
    """What every run proves; the 20 runs of the issue are the soak test below."""
    _runs(start_daemon, short_tmp, models_dir, 3)


@pytest.mark.soak
def test_sigterm_with_200_queued_and_2s_grace_20_times(start_daemon, short_tmp, models_dir):
    """The exit races this caught (SIGABRT from a native thread, a reply sent on a closed
    socket) came in some runs only: 20 runs (SIGTERM_RUNS), in `make soak`."""
    _runs(start_daemon, short_tmp, models_dir, RUNS)
