"""Configuration drop-ins: conf.d/*.toml beside the main file, merged in name order."""

from __future__ import annotations

import os
import pwd

import pytest

from inferd.daemon.config import SCHEMA, load_config
from inferd.ipc.errors import ConfigError


def test_dropins_merge_after_the_main_file_in_name_order(tmp_path):
    main = tmp_path / "inferd.toml"
    main.write_text('[models]\nqueue_size = 3\ninstances = 2\n[logging]\nlevel = "debug"\n')
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    (conf_d / "20-b.toml").write_text("[models]\nqueue_size = 20\n")
    (conf_d / "10-a.toml").write_text('[models]\nqueue_size = 10\npreload = ["x"]\n')
    (conf_d / "30-c.toml.disabled").write_text("[models]\nqueue_size = 99\n")
    cfg = load_config(main, {"models.instances": 5})
    assert cfg.models.queue_size == 20           # 20-b after 10-a after the main file
    assert cfg.models.preload == ["x"]
    assert cfg.models.instances == 5             # the command line beats every file
    assert cfg.logging.level == "debug"          # untouched keys keep the main file's
    assert [p.name for p in cfg.dropins] == ["10-a.toml", "20-b.toml"]


def test_a_bad_dropin_is_named_in_the_error(tmp_path):
    main = tmp_path / "inferd.toml"
    main.write_text("")
    (tmp_path / "conf.d").mkdir()
    bad = tmp_path / "conf.d" / "50-bad.toml"
    bad.write_text('[access]\nuids = ["no-such-user-xyz"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(main)
    assert str(bad) in info.value.message and "uids" in info.value.message


def test_access_and_logging_keys(tmp_path):
    main = tmp_path / "inferd.toml"
    me = pwd.getpwuid(os.getuid()).pw_name
    main.write_text(f'[access]\nuids = [0, "{me}"]\ngids = [27]\n'
                    '[logging]\nmodules = { "inferd.ipc.server" = "DEBUG" }\n')
    cfg = load_config(main)
    assert cfg.access.uids == [0, os.getuid()] and cfg.access.gids == [27]
    assert cfg.logging.modules == {"inferd.ipc.server": "debug"}
    main.write_text('[logging]\nmodules = { "x" = "loud" }\n')
    with pytest.raises(ConfigError, match="modules"):
        load_config(main)


def test_no_main_file_means_no_dropins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "x.toml").write_text("[models]\nqueue_size = 7\n")
    cfg = load_config(None)
    assert cfg.models.queue_size == SCHEMA["models"]["queue_size"].default and cfg.dropins == []
