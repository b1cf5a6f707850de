"""Configuration: the schema with its defaults, TOML loading, validation, overrides.

Every key lives in :data:`SCHEMA` with its default and its check; ``config/inferd.toml``
is the commented copy of the same defaults (a test keeps the two equal). A bad value
stops the daemon with one message naming the file, the key, the value and what was
expected.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inferd.daemon.units import (
    PROCESS_CORES, boolean, non_negative, parse_affinity, parse_budget, parse_duration,
    parse_size, positive_float, positive_int, string_list,
)
from inferd.ipc import defs
from inferd.ipc.errors import ConfigError

SYSTEM_CONFIG = Path(defs.CONFIG_FILE)
MAX_INT = 2**31 - 1
"""Largest integer any count key takes (TOML integers go up to 2**63 - 1)."""
MAX_SECONDS = 10**7
"""Largest number of seconds any duration key takes (about 115 days)."""


def _int_upto(limit: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if positive_int(v) <= limit:
            return int(v)
        raise ValueError
    return check


def _count_upto(limit: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if v == 0 and not isinstance(v, bool):
            return 0
        return _int_upto(limit)(v)
    return check


def _seconds(v: Any) -> float:
    # TOML has inf and nan; a comparison with nan is False, so nan is refused too.
    if positive_float(v) <= MAX_SECONDS:
        return float(v)
    raise ValueError


def _size_upto(limit: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        size = parse_size(v)
        if size <= limit:
            return size
        raise ValueError
    return check

@dataclass(frozen=True)
class Setting:
    """One configuration key: default, check (returns the normalised value or raises
    ValueError), and the words for what is expected."""

    default: Any
    check: Callable[[Any], Any]
    expected: str


def _held_bound(v: Any) -> int | None:
    """``server.max_bytes_in_flight``: None for "auto" (the runtime derives it from the
    cache budget), 0 for "unlimited", else bytes."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return None
    bound = parse_budget(v)
    return 0 if bound is None else bound


def _message_bound(v: Any) -> int | None:
    """``server.max_message_bytes``: None for "auto" (the runtime derives it from
    ``max_bytes_in_flight`` and ``max_connections``), else bytes up to 4 GiB."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return None
    return _size_upto(4 * 2**30)(v)


def _string(v: Any) -> str:
    if isinstance(v, str) and v:
        return v
    raise ValueError


def _endpoint(v: Any) -> str:
    if isinstance(v, str) and re.fullmatch(r"(ipc|tcp|inproc)://.+", v):
        return v
    raise ValueError


def _mode(v: Any) -> int:
    if isinstance(v, str) and re.fullmatch(r"0?[0-7]{3}", v):
        return int(v, 8)
    raise ValueError


def _level(v: Any) -> str:
    if isinstance(v, str) and v.lower() in {"debug", "info", "warning", "error", "critical"}:
        return v.lower()
    raise ValueError


def _group(v: Any) -> str:
    """A group that exists (checked here, so that a typo stops the daemon before it
    binds its socket rather than after)."""
    if isinstance(v, str):
        if v and not v.isdigit():
            try:
                grp.getgrnam(v)
            except KeyError:
                raise ValueError from None
        return v
    raise ValueError


def _cores(v: Any) -> list[int]:
    return [] if v == [] else parse_affinity(v)


def _extend_strategy(v: Any) -> str:
    if v in ("next_power_of_two", "same_as_requested"):
        return str(v)
    raise ValueError


def _ncnn_precision(v: Any) -> str:
    if v in ("fp32", "fp16"):
        return str(v)
    raise ValueError


def _ncnn_memory_pool(v: Any) -> str:
    if v in ("net", "run"):
        return str(v)
    raise ValueError


def _arena_cap(v: Any) -> int:
    if v in (0, "unlimited", "none"):
        return 0
    return parse_size(v)


def _mmap_threshold(v: Any) -> int:
    if v == "auto":
        return 0
    size = parse_size(v)
    if size > 32 * 2**20:  # glibc's HEAP_MAX / DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
        raise ValueError
    return size


def _arenas(v: Any) -> int:
    return 0 if v == "auto" else _int_upto(64)(v)


def _path_or_off(v: Any) -> str:
    if isinstance(v, str) and (v == "" or v.startswith("/")):
        return v
    raise ValueError


def _isolation(v: Any) -> str:
    if v not in ("in-process", "backend", "model"):
        raise ValueError
    return str(v)


def _placement_mode(v: Any) -> str:
    if v in ("measured", "first"):
        return str(v)
    raise ValueError


def _tolerance(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1:
        return float(v)
    raise ValueError


def _listen(v: Any) -> str:
    from inferd.daemon.metrics_http import parse_listen
    parse_listen(v)  # refuses anything but off, a unix socket or a loopback address
    return str(v)


def _module_levels(v: Any) -> dict[str, str]:
    if isinstance(v, dict) and all(isinstance(k, str) and k for k in v):
        return {k: _level(x) for k, x in v.items()}
    raise ValueError


def _ids(lookup: Callable[[str], Any]) -> Callable[[Any], list[int]]:
    def check(v: Any) -> list[int]:
        if not isinstance(v, list):
            raise ValueError
        out = []
        for x in v:
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                out.append(x)
            elif isinstance(x, str) and x:
                try:
                    out.append(lookup(x))
                except KeyError:
                    raise ValueError from None
            else:
                raise ValueError
        return out
    return check


SCHEMA: dict[str, dict[str, Setting]] = {
    "server": {
        "socket": Setting(defs.SOCKET, _endpoint, "a ZeroMQ endpoint such as "
                      "'ipc:///run/inferd/inferd.sock'"),
        "socket_mode": Setting("0660", _mode, "an octal file mode string such as '0660'"),
        "max_message_bytes": Setting("auto", _message_bound,
                                     "\"auto\" or a positive size in bytes up to 4GiB, e.g. "
                                     "268435456 or '256MiB'"),
        "max_requests_per_client": Setting(512, _int_upto(10**6),
                                           "a positive integer up to 1000000"),
        "max_bytes_per_client": Setting("128MiB", _size_upto(2**40),
                                        "a positive size in bytes, e.g. '128MiB'"),
        "max_replies_queued_per_client": Setting(1000, _int_upto(10**6),
                                                 "a positive integer up to 1000000"),
        "max_connections": Setting(2048, _int_upto(10**6),
                                   "a positive integer up to 1000000"),
        "max_bytes_in_flight": Setting("auto", _held_bound,
                                       "\"auto\", a size ('256MiB'), a share of physical "
                                       "memory ('10%') or \"unlimited\""),
        "shutdown_grace_s": Setting(10.0, _seconds, "a positive number of seconds"),
        "socket_group": Setting("", _group, "an existing group name, a group number, or "
                                "\"\" to leave the daemon's own group"),
        "cpu_affinity": Setting([], _cores, f"a list of core numbers from "
                            f"{sorted(PROCESS_CORES)}, or [] for any core"),
    },
    "models": {
        "repository": Setting(defs.REPOSITORY, _string, "a directory path"),
        "preload": Setting([], string_list, "a list of model names"),
        "queue_size": Setting(1024, _int_upto(10**6), "a positive integer up to 1000000"),
        "instances": Setting(1, _int_upto(256), "a positive integer up to 256"),
        "allow_external_links": Setting(False, boolean, "true or false"),
        "stuck_after_s": Setting(10.0, _seconds, "a positive number of seconds"),
        "io_run_max_us": Setting(200, _count_upto(10**6), "an integer from 0 to 1000000"),
    },
    "backends": {
        "paths": Setting([], string_list, "a list of absolute directory paths"),
        "probe_timeout_s": Setting(10.0, _seconds, "a positive number of seconds"),
    },
    "customops": {
        "paths": Setting([], string_list, "a list of absolute directory paths"),
    },
    "processors": {
        "directory": Setting(defs.PROCESSORS_DIR, _string, "a directory path"),
    },
    "onnxruntime": {
        "intra_op_threads": Setting(1, _int_upto(1024), "a positive integer up to 1024"),
        "inter_op_threads": Setting(1, _int_upto(1024), "a positive integer up to 1024"),
        "allow_spinning": Setting(True, boolean, "true or false"),
        "memory_arena": Setting(True, boolean, "true or false"),
        "arena_extend_strategy": Setting("same_as_requested", _extend_strategy,
                                         "'next_power_of_two' or 'same_as_requested'"),
        "arena_max_memory": Setting("unlimited", _arena_cap, "a size ('256MiB') or "
                                    "'unlimited'"),
        "arena_shrinkage": Setting(True, boolean, "true or false"),
        "memory_pattern": Setting(True, boolean, "true or false"),
    },
    "openvino": {
        "threads": Setting(1, positive_int, "a positive integer"),
        "streams": Setting(1, positive_int, "a positive integer"),
    },
    "placement": {
        "mode": Setting("measured", _placement_mode, "\"measured\" or \"first\""),
        "time_limit_s": Setting(60.0, _seconds, "a positive number of seconds"),
        "ready_within_s": Setting(30.0, non_negative, "a number of seconds >= 0"),
        "tolerance": Setting(1e-3, _tolerance, "a number from 0 to 1"),
        "directory": Setting("", _path_or_off, "an absolute directory path, or \"\" for "
                             "placement/ in $STATE_DIRECTORY (systemd's "
                             "StateDirectory=; else none)"),
    },
    "ncnn": {
        "threads": Setting(1, positive_int, "a positive integer"),
        "precision": Setting("fp32", _ncnn_precision, "'fp32' or 'fp16'"),
        "memory_pool": Setting("net", _ncnn_memory_pool, "'net' or 'run'"),
        "winograd": Setting(True, boolean, "true or false"),
        "sgemm": Setting(True, boolean, "true or false"),
        "allow_software_vulkan": Setting(False, boolean, "true or false"),
        "cache_dir": Setting("", _path_or_off, "an absolute folder path, or \"\" for "
                             "the state directory's ncnn/"),
    },
    "cache": {
        "max_memory": Setting("75%", parse_budget, "a size ('512MiB'), a share of physical memory "
                          "('40%') or 'unlimited'"),
        "keep_alive": Setting("5m", parse_duration, "a duration such as 30, '90s', '5m', '1h', or "
                          "'forever'"),
        "failed_load_hold_s": Setting(10.0, _seconds, "a positive number of seconds"),
        "idle_check_s": Setting(1.0, _seconds, "a positive number of seconds"),
        "warmup_dim": Setting(64, _int_upto(65536), "a positive integer up to 65536"),
        "malloc_mmap_threshold": Setting("32MiB", _mmap_threshold, "a size ('4MiB') or "
                                         "'auto' (glibc's own sliding threshold)"),
        "malloc_arenas": Setting(2, _arenas, "an integer from 1 to 64, or 'auto' (glibc's "
                                 "default: eight per core)"),
    },
    "workers": {
        "isolation": Setting("backend", _isolation, "one of \"in-process\", \"backend\", "
                             "\"model\""),
        "kill_after_s": Setting(120.0, _seconds, "a positive number of seconds"),
        "load_kill_after_s": Setting(600.0, _seconds, "a positive number of seconds"),
        "max_memory": Setting("unlimited", parse_budget, "a size ('512MiB'), a share of "
                              "physical memory ('25%') or 'unlimited'"),
        "restart_backoff_s": Setting(0.5, _seconds, "a positive number of seconds"),
        "idle_exit_s": Setting(10.0, _seconds, "a positive number of seconds"),
        "channel_idle_s": Setting(30.0, _seconds, "a positive number of seconds"),
        "refuse_client_after": Setting(5, _int_upto(10**6), "a positive integer"),
        "refuse_client_s": Setting(60.0, _seconds, "a positive number of seconds"),
        "set_aside_after": Setting(3, _int_upto(10**6), "a positive integer"),
    },
    "streams": {
        "max_per_client": Setting(16, _int_upto(10**6), "a positive integer"),
    },
    "logging": {
        "level": Setting("info", _level, "one of debug, info, warning, error, critical"),
        "modules": Setting({}, _module_levels, "a table of logger name = level, e.g. "
                       "{ \"inferd.ipc.server\" = \"debug\" }"),
    },
    "access": {
        "uids": Setting([], _ids(lambda n: pwd.getpwnam(n).pw_uid),
                    "a list of user ids or existing user names"),
        "gids": Setting([], _ids(lambda n: grp.getgrnam(n).gr_gid),
                    "a list of group ids or existing group names"),
    },
    "metrics": {
        "textfile": Setting("/run/inferd/metrics.prom", _path_or_off, "an absolute file path, "
                        "or \"\" for no textfile"),
        "interval_s": Setting(5.0, positive_float, "a positive number of seconds"),
        "listen": Setting("", _listen, "\"\" (off), 'unix:/ABSOLUTE/PATH', or a loopback "
                      "address and port such as 'localhost:9464', '127.0.0.1:9464' or "
                      "'[::1]:9464' (never a network address)"),
    },
    "systemd": {
        "extend_timeout_s": Setting(90.0, _seconds, "a positive number of seconds"),
        "watchdog_stuck": Setting(False, boolean, "true or false"),
    },
    "security": {
        "strict_modes": Setting(True, boolean, "true or false"),
    },
}


class Config(SimpleNamespace):
    """Validated configuration: ``config.server.socket`` and so on.

    ``source`` is the main file it came from, or None for the built-in defaults;
    ``dropins`` the ``conf.d/*.toml`` files merged after it, in the order applied;
    ``overridden`` the ``"section.key"`` names set on the command line.
    """

    source: Path | None
    dropins: list[Path]
    overridden: frozenset[str]


def _validate(raw: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The keys ``raw`` sets, checked and normalised (defaults are not filled in)."""
    values: dict[str, dict[str, Any]] = {}
    for section, table in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"{where}: unknown section [{section}]; known sections: "
                              f"{', '.join(SCHEMA)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        for name, value in table.items():
            key = SCHEMA[section].get(name)
            if key is None:
                raise ConfigError(f"{where}: unknown key [{section}] {name}; known keys: "
                                  f"{', '.join(SCHEMA[section])}")
            try:
                values.setdefault(section, {})[name] = key.check(value)
            except ValueError:
                raise ConfigError(f"{where}: [{section}] {name} = {value!r}: expected "
                                  f"{key.expected}") from None
    return values


def find_config_file(cli_path: str | None) -> Path | None:
    """The file to read: ``--config``, then ``$INFERD_CONFIG``, then the system file if
    it exists, else None (built-in defaults)."""
    if cli_path:
        return Path(cli_path)
    env = os.environ.get(defs.CONFIG_ENV)
    if env:
        return Path(env)
    return SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else None


def dropin_files(path: Path) -> list[Path]:
    """``conf.d/*.toml`` beside the main file ``path``, sorted by name."""
    folder = path.parent / "conf.d"
    try:
        return sorted((p for p in folder.iterdir() if p.suffix == ".toml" and p.is_file()),
                      key=lambda p: p.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise ConfigError(f"{folder}: cannot list drop-in directory: {e.strerror}") from e


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: byte {e.object[e.start]:#04x} at offset "
                          f"{e.start} is not UTF-8 (TOML files are UTF-8, comments too)"
                          ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    return _validate(raw, str(path))


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read, validate and override a configuration.

    The built-in defaults, then the file ``path``, then each ``conf.d/*.toml`` beside it
    in name order, then ``overrides``: a key set by a later layer replaces the value of
    an earlier one (a list or table is replaced whole, not merged).

    Args:
        path: TOML file, or None for the built-in defaults (and no drop-ins).
        overrides: ``"section.key" -> value`` from the command line; validated like the
            file's values and stronger than them.

    Raises:
        ConfigError: unreadable file, bad TOML, unknown key or bad value.
    """
    values = {s: {k: key.check(key.default) for k, key in keys.items()}
              for s, keys in SCHEMA.items()}
    dropins = dropin_files(path) if path is not None else []
    for layer in ([path] if path is not None else []) + dropins:
        for section, table in _read(layer).items():
            values[section].update(table)
    for dotted, value in (overrides or {}).items():
        section, name = dotted.split(".", 1)
        values = _merge_one(values, section, name, value, "command line")
    return Config(source=path, dropins=dropins, overridden=frozenset(overrides or ()),
                  **{s: SimpleNamespace(**v) for s, v in values.items()})


def _merge_one(values: dict[str, dict[str, Any]], section: str, name: str, value: Any,
               where: str) -> dict[str, dict[str, Any]]:
    key = SCHEMA[section][name]
    try:
        values[section][name] = key.check(value)
    except ValueError:
        raise ConfigError(f"{where}: [{section}] {name} = {value!r}: expected "
                          f"{key.expected}") from None
    return values
