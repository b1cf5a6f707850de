"""Reload requests coalesce (issue 18, defect 8): those that arrive while a reload waits
to run join it, so 20 requests behind a running reload cost one more run, not 20, and
each is answered with the outcome of the run that covered it."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from inferd.daemon.reload import ReloadRuns
from inferd.ipc.protocol import Op
from tests.e2e.test_cache_reload import add_version, poll


def test_requests_behind_a_running_reload_collapse_into_one_more_run(
        caplog: pytest.LogCaptureFixture) -> None:
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def reload() -> dict[str, int]:
        runs.append(len(runs) + 1)
        started.set()
        release.wait(30)
        return {"run": len(runs)}

    answers: list[tuple[Any, Any]] = []
    with ThreadPoolExecutor(max_workers=1) as control:
        reloads = ReloadRuns(reload, control.submit)
        reloads.request(lambda r, e: answers.append((r, e)))
        assert started.wait(30)  # the first run is running
        for _ in range(19):
            reloads.request(lambda r, e: answers.append((r, e)))
        reloads.request(None)  # a SIGHUP
        caplog.set_level("INFO", logger="inferd.daemon.reload")
        release.set()  # the second run logs as it starts, before the pool's exit returns
    assert "reload: 20 requests for it arrived while the last one ran; one run serves " \
           "them" in caplog.text  # as docs/configuration.md quotes it
    assert runs == [1, 2]
    assert (reloads.requests, reloads.runs) == (21, 2)
    assert answers[0] == ({"run": 1}, None)
    assert answers[1:] == [({"run": 2}, None)] * 19


def test_a_failed_run_answers_each_of_its_requests_with_the_error() -> None:
    def reload() -> None:
        raise RuntimeError("broken")

    answers: list[Any] = []
    with ThreadPoolExecutor(max_workers=1) as control:
        reloads = ReloadRuns(reload, control.submit)
        for _ in range(3):
            reloads.request(lambda r, e: answers.append(e))
    assert len(answers) == 3 and all(isinstance(e, RuntimeError) for e in answers)


@pytest.mark.slow
def test_twenty_reloads_and_sighups_against_a_daemon(models_dir: Path, short_tmp: Path,
                                                    start_daemon: Any) -> None:
    repo = short_tmp / "repo"
    add_version(repo, models_dir, "ocr-cls", 1)
    d = start_daemon("--models", str(repo))
    with d.client(timeout=120) as c:
        pending = [c.submit(Op.RELOAD) for _ in range(20)]  # all sent at once
        for _ in range(20):
            d.proc.send_signal(signal.SIGHUP)
        add_version(repo, models_dir, "vad", 1)
        c.call(Op.RELOAD)  # sent after the change: the run that answers it sees it
        assert "vad" in {m["name"] for m in c.models()}
        replies = [p.reply(120) for p in pending]
    assert [r.error for r in replies] == [None] * 20
    poll(lambda: d.log().count("configuration reloaded from") >= 2)
    runs = d.log().count("configuration reloaded from")
    assert runs < 41, runs  # one per request and SIGHUP before
    # Whether requests overlap a run here depends on the machine's timing (a reload of this
    # repository takes about a millisecond): the collapse and its log line are shown
    # deterministically by test_requests_behind_a_running_reload_collapse_into_one_more_run.
