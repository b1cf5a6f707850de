"""Logging: the journal-or-stderr decision, the native journal protocol (with a datagram
socket standing in for journald's), structured fields, per-module levels."""

from __future__ import annotations

import io
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.daemon import logs
from inferd.daemon.logs import (
    FIELDS, JournalHandler, decode_journal, encode_journal, journal_stream_matches,
    set_levels, setup_logging,
)


@pytest.fixture
def journald(short_tmp: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(short_tmp / "journal"))
    sock.settimeout(10)
    yield sock
    sock.close()


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    lg = logging.getLogger("inferd.test.logs")
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    yield lg
    for h in list(lg.handlers):
        lg.removeHandler(h)
        h.close()
    lg.propagate = True


def test_journal_stream_must_match_stderr_device_and_inode(tmp_path, monkeypatch):
    with open(tmp_path / "err", "w") as stream, open(tmp_path / "other", "w") as other:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert journal_stream_matches(stream)
        assert not journal_stream_matches(other)  # e.g. stderr redirected by the admin
        monkeypatch.setenv("JOURNAL_STREAM", "garbage")
        assert not journal_stream_matches(stream)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not journal_stream_matches(stream)
    assert not journal_stream_matches(io.StringIO())  # no file descriptor at all


def test_records_reach_journald_with_priority_and_structured_fields(journald, logger):
    logger.addHandler(JournalHandler(journald.getsockname()))
    logger.warning("model %s failed to load", "ocr-det",
                   extra={"MODEL": "ocr-det", "BACKEND": "onnxruntime", "CODE": "NOT_FOUND",
                          "REQUEST_ID": "", "lowercase": "never sent"})
    entry = decode_journal(journald.recv(65536))
    assert entry["MESSAGE"] == "model ocr-det failed to load"
    assert entry["PRIORITY"] == "4"
    assert entry["SYSLOG_IDENTIFIER"] == "inferd"
    assert entry["MODEL"] == "ocr-det" and entry["BACKEND"] == "onnxruntime"
    assert entry["CODE"] == "NOT_FOUND"
    assert "REQUEST_ID" not in entry  # empty fields are left out
    assert entry["LOGGER"] == "inferd.test.logs"
    assert entry["CODE_FUNC"] == "test_records_reach_journald_with_priority_and_structured_fields"
    # journald drops a whole message that has a field name outside [A-Z0-9_]
    assert all(k.replace("_", "").isalnum() and k.isupper() for k in entry), entry


@pytest.mark.parametrize("level, priority", [(logging.DEBUG, "7"), (logging.INFO, "6"),
                                             (logging.WARNING, "4"), (logging.ERROR, "3"),
                                             (logging.CRITICAL, "2")])
def test_levels_map_to_syslog_priorities(journald, logger, level, priority):
    logger.addHandler(JournalHandler(journald.getsockname()))
    logger.log(level, "x")
    assert decode_journal(journald.recv(65536))["PRIORITY"] == priority


def test_tracebacks_travel_in_the_binary_safe_form(journald, logger):
    logger.addHandler(JournalHandler(journald.getsockname()))
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logger.exception("request %s failed", "r-1", extra={"REQUEST_ID": "r-1"})
    data = journald.recv(65536)
    assert b"MESSAGE\n" in data  # length-prefixed, since the value has newlines
    entry = decode_journal(data)
    assert entry["MESSAGE"].startswith("request r-1 failed\nTraceback")
    assert "ValueError: bad\nvalue" in entry["MESSAGE"]
    assert entry["REQUEST_ID"] == "r-1" and entry["PRIORITY"] == "3"


def test_encode_journal_round_trip():
    fields = {"MESSAGE": "a=b\nc", "MODEL": "ocr-det", "STAGE": "opened"}
    assert decode_journal(encode_journal(fields)) == fields


def test_plain_lines_carry_the_fields_at_the_end(logger):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.PlainFormatter())
    logger.addHandler(handler)
    logger.info("plugin skipped", extra={"PLUGIN_PATH": "/usr/lib/inferd/backends/x.py",
                                         "STAGE": "opened"})
    line = stream.getvalue().strip()
    assert " INFO inferd.test.logs: plugin skipped " in line
    assert line.endswith("[PLUGIN_PATH=/usr/lib/inferd/backends/x.py STAGE=opened]")


@pytest.fixture
def clean_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    if logs._installed is not None:
        logs._installed.close()
        logs._installed = None
    set_levels("warning", {})
    root.handlers[:] = handlers
    root.setLevel(level)


def test_setup_logging_picks_the_journal_only_when_stderr_is_the_journal(
        tmp_path, monkeypatch, clean_root):
    with open(tmp_path / "err", "w") as stream:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        plain = setup_logging("info", stream=stream)
        assert isinstance(plain, logging.StreamHandler)
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        handler = setup_logging("info", stream=stream)
        assert isinstance(handler, JournalHandler)
        root = logging.getLogger().handlers
        assert root.count(handler) == 1 and plain not in root  # replaced, not added


def test_per_module_levels_and_their_reset_on_reload(clean_root):
    stream = io.StringIO()
    setup_logging("warning", {"inferd.ipc.server": "debug"}, stream=stream, journal=False)
    logging.getLogger("inferd.ipc.server").debug("new client: uid 1000")
    logging.getLogger("inferd.daemon.models").info("hidden at warning")
    assert "new client: uid 1000" in stream.getvalue()
    assert "hidden at warning" not in stream.getvalue()
    set_levels("info", {})  # a reload that drops the module entry
    assert logging.getLogger("inferd.ipc.server").level == logging.NOTSET
    assert logging.getLogger("inferd.ipc.server").getEffectiveLevel() == logging.INFO


def test_fields_are_the_documented_uppercase_names():
    assert FIELDS == ("MODEL", "BACKEND", "REQUEST_ID", "PLUGIN_PATH", "STAGE", "CODE")


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_a_missing_journald_does_not_raise(short_tmp, logger, capsys):
    handler = JournalHandler(str(short_tmp / "no-journald"))
    logger.addHandler(handler)
    logger.error("still fine")  # logging's handleError reports on stderr, no exception
    assert "still fine" in capsys.readouterr().err


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limited(logger: logging.Logger) -> tuple[io.StringIO, logs.RepeatFilter, _Clock]:
    out, clock = io.StringIO(), _Clock()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    repeats = logs.RepeatFilter(handler, window=10.0, burst=5, clock=clock,
                                background=False)
    handler.addFilter(repeats)
    logger.addHandler(handler)
    return out, repeats, clock


def test_a_flood_of_one_cause_is_five_lines_then_one_summary_per_interval(logger):
    """Issue 18, defect 6: the first records of a cause in full, then a count."""
    out, repeats, clock = _limited(logger)
    for i in range(4218):
        logger.error("graph %s failed to load: cycle %d", "g", i, extra={"MODEL": "g"})
    logger.warning("another cause")  # not held back by the first one's flood
    assert out.getvalue().splitlines() == [
        *(f"ERROR graph g failed to load: cycle {i}" for i in range(5)),
        "WARNING another cause"]
    clock.now += 10
    repeats.flush_due()
    assert out.getvalue().splitlines()[-1] == (
        "ERROR … 4,213 more like this in the last 10 s: graph g failed to load: cycle 4217")
    # The flood goes on: only a summary per interval, no line in full.
    for _ in range(3):
        for i in range(100):
            logger.error("graph %s failed to load: cycle %d", "g", i, extra={"MODEL": "g"})
        clock.now += 10
        repeats.flush_due()
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 + 1 + 3
    assert all(line.startswith("ERROR … 100 more like this in the last 10 s")
               for line in lines[-3:])
    # Quiet for an interval: the next one is written in full again.
    clock.now += 10
    repeats.flush_due()
    clock.now += 10
    logger.error("graph %s failed to load: cycle %d", "g", 1, extra={"MODEL": "g"})
    assert out.getvalue().splitlines()[-1] == "ERROR graph g failed to load: cycle 1"


def test_causes_are_told_apart_by_format_level_model_and_code(logger):
    out, _, _ = _limited(logger)
    for _ in range(10):
        for model in ("a", "b"):
            logger.error("model %s failed", model, extra={"MODEL": model})
        logger.warning("model %s failed", "a", extra={"MODEL": "a"})
        logger.info("refused %s", "x", extra={"CODE": "PERMISSION_DENIED"})
        logger.debug("new client %s", "x")  # asked for on purpose: never held back
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 * 4 + 10


def test_a_held_back_traceback_is_summed_up_without_it(logger):
    out, repeats, clock = _limited(logger)
    for _ in range(7):
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError:
            logger.exception("graph ocr: node det_pre failed")
    assert out.getvalue().count("Traceback") == 5
    clock.now += 10
    logger.error("graph ocr: node det_pre failed")  # the flood goes on: held back too
    lines = out.getvalue().splitlines()
    assert lines[-1] == ("ERROR … 2 more like this in the last 10 s: graph ocr: node "
                         "det_pre failed")
    assert lines[-2] == "ZeroDivisionError: division by zero"  # the fifth, in full


def test_the_summary_thread_writes_when_the_interval_ends(logger):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    repeats = logs.RepeatFilter(handler, window=0.2, burst=1)
    handler.addFilter(repeats)
    logger.addHandler(handler)
    for _ in range(3):
        logger.error("same")
    deadline = time.monotonic() + 30
    while "2 more like this" not in out.getvalue():
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.02)
    repeats.close()


def test_a_different_plugin_or_backend_is_a_different_cause(logger):
    """One WARNING per broken plugin at boot (17 of them): the same format string, each
    naming its own PLUGIN_PATH, none held back."""
    out, _, _ = _limited(logger)
    for i in range(17):
        logger.warning("backend candidate %s failed at stage %r", f"p{i}.py", "opened",
                       extra={"PLUGIN_PATH": f"/plugins/p{i}.py", "STAGE": "opened"})
    for i in range(7):  # the request id is not a cause: every request has its own
        logger.warning("refused %s", "x", extra={"REQUEST_ID": str(i)})
    lines = out.getvalue().splitlines()
    assert len(lines) == 17 + 5, lines
