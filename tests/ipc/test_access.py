"""Who may use the socket: the [access] allow-list, client credentials from the socket
(logged once per client), the socket's mode and group."""

from __future__ import annotations

import grp
import os
import signal
import stat
import time

import pytest

from inferd.ipc import RequestError
from inferd.ipc.errors import ErrorCode
from inferd.ipc.access import Access, Peer

pytestmark = pytest.mark.slow


def _wait_in_log(d, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in d.log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{d.log()}"
        time.sleep(0.05)


def test_allow_list_refuses_then_serves_after_reload(start_daemon, short_tmp, models_dir):
    me = os.getuid()
    config = short_tmp / "inferd.toml"
    config.write_text(f"[access]\nuids = [{me + 4242}]\n"
                      '[logging]\nmodules = { "inferd.ipc.server" = "debug" }\n')
    d = start_daemon("--config", str(config), "--models", str(models_dir), ready=False)
    _wait_in_log(d, "ready;")
    with d.client(timeout=10) as c:
        with pytest.raises(RequestError) as info:
            c.ping()
        assert info.value.code is ErrorCode.PERMISSION_DENIED
        assert f"uid {me} gid {os.getgid()} pid {os.getpid()}" in info.value.message
        with pytest.raises(RequestError):
            c.ping()  # still refused, but logged only once
    log = d.log()
    assert log.count("refused a request from") == 1
    assert log.count(f"new client: uid {me} gid {os.getgid()} pid {os.getpid()}") == 1

    # a drop-in allowing our primary group by name, then SIGHUP
    (short_tmp / "conf.d").mkdir()
    (short_tmp / "conf.d" / "50-me.toml").write_text(
        f'[access]\ngids = ["{grp.getgrgid(os.getgid()).gr_name}"]\n')
    d.proc.send_signal(signal.SIGHUP)
    _wait_in_log(d, "configuration reloaded")
    with d.client(timeout=10) as c:
        assert c.ping()["pong"] is True
    assert d.stop() == 0


def test_socket_mode_and_group(start_daemon, short_tmp):
    group = grp.getgrgid(os.getgid()).gr_name
    config = short_tmp / "inferd.toml"
    config.write_text(f'[server]\nsocket_mode = "0660"\nsocket_group = "{group}"\n')
    d = start_daemon("--config", str(config))
    st = os.stat(d.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    assert d.stop() == 0


def test_unknown_socket_group_stops_the_daemon_with_its_name(start_daemon, short_tmp):
    config = short_tmp / "inferd.toml"
    config.write_text('[server]\nsocket_group = "no-such-group-x"\n')
    d = start_daemon("--config", str(config), ready=False)
    # Refused with the configuration (status 2), before the socket is bound: no socket
    # file is left behind (issue 12, item 7).
    assert d.proc.wait(60) == 2
    assert "no-such-group-x" in d.log() and "[server] socket_group" in d.log()
    assert not d.socket_path.exists()


def test_access_rules():
    peer = Peer(1000, 1000, 1, frozenset({1000, 44}))
    assert Access.of().allows(peer) and Access.of().allows(None)
    assert Access.of(uids=[1000]).allows(peer)
    assert Access.of(gids=[44]).allows(peer)  # a supplementary group
    assert not Access.of(uids=[0], gids=[27]).allows(peer)
    assert not Access.of(uids=[1000]).allows(None)  # no credentials (tcp://)
    assert Peer.parse("localhost:0:0:12") == Peer(0, 0, 12, Peer.parse("x:0:0:1").groups)
    assert Peer.parse("127.0.0.1:5555") is None
