"""Configuration: shipped defaults, validation messages, lookup order, overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from inferd.daemon.config import SCHEMA, find_config_file, load_config
from inferd.daemon.units import parse_size
from inferd.ipc.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "inferd.toml"


def test_shipped_file_lists_every_key_with_its_builtin_default():
    with open(SHIPPED, "rb") as f:
        shipped = tomllib.load(f)
    assert set(shipped) == set(SCHEMA)
    for section, keys in SCHEMA.items():
        assert set(shipped[section]) == set(keys), section
        for name, key in keys.items():
            assert shipped[section][name] == key.default, f"[{section}] {name}"


def test_defaults_without_a_file():
    cfg = load_config(None)
    assert cfg.server.socket == "ipc:///run/inferd/inferd.sock"
    assert cfg.server.max_message_bytes is None  # "auto": derived at start (runtime)
    assert cfg.server.socket_mode == 0o660
    assert cfg.server.cpu_affinity == []
    assert cfg.cache.malloc_arenas == 2  # two glibc heaps for all threads (docs/cache.md)
    assert cfg.source is None


@pytest.mark.parametrize("text, words", [
    ("[server]\nmax_message_bytes = -5\n",
     "[server] max_message_bytes = -5: expected \"auto\" or a positive size"),
    ("[models]\nqueue_size = \"many\"\n",
     "[models] queue_size = 'many': expected a positive integer"),
    ("[server]\nsocket = \"/tmp/x\"\n", "[server] socket = '/tmp/x': expected a ZeroMQ endpoint"),
    ("[server]\ncpu_affinity = [9999]\n",
     "[server] cpu_affinity = [9999]: expected a list of core numbers from [0"),
    ("[server]\ncpu_affinity = 0\n", "[server] cpu_affinity = 0: expected a list of core"),
    ("[modles]\n", "unknown section [modles]"),
    ("[models]\npreloads = []\n", "unknown key [models] preloads"),
    ("[models\n", "not valid TOML"),
    ("[cache]\nmalloc_arenas = 0\n",
     "[cache] malloc_arenas = 0: expected an integer from 1 to 64, or 'auto'"),
])
def test_invalid_config_names_file_key_value_and_expectation(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.message
    assert words in info.value.message


def test_command_line_overrides_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\nsocket = "ipc:///tmp/a.sock"\n[models]\nqueue_size = 3\n')
    cfg = load_config(path, {"server.socket": "ipc:///tmp/b.sock"})
    assert cfg.server.socket == "ipc:///tmp/b.sock"
    assert cfg.models.queue_size == 3


def test_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CONFIG", str(tmp_path / "env.toml"))
    assert find_config_file("/cli.toml") == Path("/cli.toml")
    assert find_config_file(None) == tmp_path / "env.toml"
    monkeypatch.delenv("INFERD_CONFIG")
    monkeypatch.setattr("inferd.daemon.config.SYSTEM_CONFIG", tmp_path / "missing.toml")
    assert find_config_file(None) is None


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize("value, size", [(1, 1), ("10", 10), ("1KiB", 1024), ("2 MB", 2_000_000),
                                         ("256MiB", 256 * 2**20), ("1.5GiB", int(1.5 * 2**30))])
def test_parse_size(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [0, -1, "x", "5 parsecs", True, None])
def test_parse_size_rejects(value):
    with pytest.raises(ValueError):
        parse_size(value)
