"""The placement decisions file (daemon/decisions.py) read as untrusted bytes and written
without following a planted link (issue 31, finding 10).

Each bad file is one that a local user who can write the state directory (or a crash, or
a full disk) can leave: the store must set it aside, log it once and measure again —
never raise at start, hang, balloon or hand a load a decision of the wrong types.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from inferd.daemon.decisions import (
    MAX_BYTES, BadFile, Decision, DecisionKey, DecisionStore, parse, read_bounded,
)

KEY = DecisionKey("sha", ("a 1 cpu", "b 1 cpu"), "cpu", 2, "{}")
DECISION = Decision("b", "cpu", 2, {"a": 2.0, "b (2 threads)": 1.0}, {"c": "wrong"},
                    ("x=1x3",), 1.5, "")


def good_file() -> dict[str, Any]:
    return {"format": 1, "written_at": 0.0,
            "decisions": {"m/1": {"key": KEY.to_json(), "decision": DECISION.to_json()}}}


def warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def assert_set_aside(tmp_path: Path, caplog: Any, why: str) -> None:
    """The file was logged once with ``why``, renamed decisions.json.bad, and a new
    decision is written to a fresh regular file that a new store reads back."""
    said = [m for m in warnings(caplog) if "not a decisions file" in m]
    assert len(said) == 1 and why in said[0], warnings(caplog)
    assert f"set aside as {tmp_path / 'decisions.json.bad'}" in said[0]
    assert os.path.lexists(tmp_path / "decisions.json.bad")
    assert not os.path.lexists(tmp_path / "decisions.json")


def test_a_good_file_round_trips(tmp_path: Path) -> None:
    store = DecisionStore(tmp_path)
    store.put("m", 1, KEY, DECISION)
    assert json.loads((tmp_path / "decisions.json").read_text())["decisions"] == \
        good_file()["decisions"]
    assert DecisionStore(tmp_path).get("m", 1, KEY) == DECISION


def test_deeply_nested_json_is_set_aside_not_a_failed_start(tmp_path: Path,
                                                            caplog: Any) -> None:
    """Before: RecursionError out of the constructor (the daemon exited 1 at start)."""
    (tmp_path / "decisions.json").write_text("[" * 100_000)
    with caplog.at_level(logging.WARNING):
        store = DecisionStore(tmp_path)
    assert store.get("m", 1, KEY) is None
    assert_set_aside(tmp_path, caplog, "not JSON: nested too deep")
    store.put("m", 1, KEY, DECISION)
    assert DecisionStore(tmp_path).get("m", 1, KEY) == DECISION


def test_a_fifo_does_not_block_the_start(tmp_path: Path, caplog: Any) -> None:
    """Before: ``open`` of a FIFO with no writer blocked for good (never ready)."""
    fifo = tmp_path / "decisions.json"
    os.mkfifo(fifo)
    built: list[DecisionStore] = []
    with caplog.at_level(logging.WARNING):
        t = threading.Thread(target=lambda: built.append(DecisionStore(tmp_path)))
        t.start()
        t.join(10)
        blocked = t.is_alive()
        if blocked:  # release the reader (a writer that closes at once) so the test ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join(10)
    assert not blocked, "opening decisions.json (a FIFO) blocked"
    assert built[0].get("m", 1, KEY) is None
    assert_set_aside(tmp_path, caplog, "it is not a regular file")


def test_a_link_to_dev_zero_is_not_followed(tmp_path: Path) -> None:
    """Before: the whole of /dev/zero was read (1.45 GB in 1.2 s at the daemon). In a
    child process under a 1 GiB address-space limit, so that the old code fails with
    MemoryError there instead of ballooning the test run."""
    os.symlink("/dev/zero", tmp_path / "decisions.json")
    script = textwrap.dedent(f"""
        import logging, resource, sys
        from pathlib import Path
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
        from inferd.daemon.decisions import DecisionStore
        store = DecisionStore(Path({str(tmp_path)!r}))
        print("entries", len(store._entries))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "entries 0" in out.stdout
    assert "it is a symbolic link (not followed)" in out.stdout
    assert os.readlink(tmp_path / "decisions.json.bad") == "/dev/zero"


def test_a_link_to_a_good_file_is_not_followed_either(tmp_path: Path, caplog: Any) -> None:
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    (elsewhere / "decisions.json").write_text(json.dumps(good_file()))
    os.symlink(elsewhere / "decisions.json", tmp_path / "decisions.json")
    with caplog.at_level(logging.WARNING):
        store = DecisionStore(tmp_path)
    assert store.get("m", 1, KEY) is None
    assert_set_aside(tmp_path, caplog, "it is a symbolic link (not followed)")


def test_a_file_past_the_bound_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "decisions.json"
    path.write_bytes(b" " * (MAX_BYTES + 1))
    with pytest.raises(BadFile, match=f"larger than {MAX_BYTES} bytes"):
        read_bounded(path)
    path.write_bytes(b" " * 10)
    assert read_bounded(path) == b" " * 10


def _broken(change: str) -> dict[str, Any]:
    raw = good_file()
    entry = raw["decisions"]["m/1"]
    where, _, field = change.partition(".")
    values = {"times_ms": [], "rejected": ["c"], "inputs": "x=1x3", "threads": "2",
              "backend": 3, "kind": None, "measured_at": "soon", "note": 1,
              "model_sha256": 1, "backends": "a 1 cpu", "cpu": [], "cores": "2",
              "settings": {}}
    if field == "":
        entry[where] = "not a table"
    elif field == "missing":
        del entry[where]["backend" if where == "decision" else "cpu"]
    else:
        entry[where][field] = values[field]
    return raw


@pytest.mark.parametrize("change", [
    "decision.times_ms", "decision.rejected", "decision.inputs", "decision.threads",
    "decision.backend", "decision.kind", "decision.measured_at", "decision.note",
    "key.model_sha256", "key.backends", "key.cpu", "key.cores", "key.settings",
    "decision", "key", "decision.missing", "key.missing",
])
def test_a_field_of_the_wrong_type_is_set_aside_not_a_failed_load(
        tmp_path: Path, caplog: Any, change: str) -> None:
    """Before: a load asked for the decision and got AttributeError (``times_ms`` a
    list: INTERNAL, at every retry) or a decision of the wrong types; the file stayed."""
    (tmp_path / "decisions.json").write_text(json.dumps(_broken(change)))
    with caplog.at_level(logging.WARNING):
        store = DecisionStore(tmp_path)
        assert store.get("m", 1, KEY) is None
    assert_set_aside(tmp_path, caplog, "m/1: ")


def test_parse_names_the_entry_and_the_field() -> None:
    with pytest.raises(BadFile, match="m/1: 'times_ms' is a list"):
        parse(json.dumps(_broken("decision.times_ms")).encode())
    with pytest.raises(BadFile, match="m/1: 'cores' is a str"):
        parse(json.dumps(_broken("key.cores")).encode())
    with pytest.raises(BadFile, match="not of format 1"):
        parse(b'{"format": 2, "decisions": {}}')
    assert parse(json.dumps(good_file()).encode()) == {"m/1": (KEY, DECISION)}


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    """Before: ``.decisions.json.<pid>.tmp`` was written with ``write_text`` (follows a
    link, no exclusive create): the file a planted link named was overwritten."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / f".decisions.json.{os.getpid()}.tmp")
    store = DecisionStore(tmp_path)
    store.put("m", 1, KEY, DECISION)
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "decisions.json").is_symlink()
    assert DecisionStore(tmp_path).get("m", 1, KEY) == DECISION


def test_a_link_planted_at_the_file_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    store = DecisionStore(tmp_path)
    os.symlink(victim, tmp_path / "decisions.json")
    store.put("m", 1, KEY, DECISION)
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "decisions.json").is_symlink()


def test_a_directory_every_user_may_write_is_not_written(tmp_path: Path,
                                                         caplog: Any) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        store = DecisionStore(open_dir)
        store.put("m", 1, KEY, DECISION)
        store.put("m", 2, KEY, DECISION)
    said = [m for m in warnings(caplog) if "cannot be written" in m]
    assert len(said) == 1 and "writable by every user" in said[0], said
    assert not (open_dir / "decisions.json").exists()
    assert store.get("m", 2, KEY) == DECISION  # kept in memory
