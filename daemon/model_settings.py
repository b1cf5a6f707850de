"""The ``model.toml`` schema: every key a model's settings file may hold, with its type,
default and check, in one table (:data:`SCHEMA`), like ``config.SCHEMA`` for
``inferd.toml``. docs/model-toml.md is the reference written from it (a test keeps the
two in step).

A model.toml is parsed once per repository scan (start, reload) into one
:class:`ModelSettings`; every module reads its keys from that object. What fails fails
only its own model, with one message naming the model, the file and the key:

- a file that is not UTF-8 or not TOML;
- a key the schema does not know (a misspelling must not be silently ignored);
- a value of the wrong type or out of range (``instances = "two"``).

A top-level **table** that is not a schema key belongs to a backend: ``[openvino]``,
``[onnxruntime]``, ``[onnxruntime-gpu]``, ``[rknn]``, any table named after a backend id.
It is not checked here; the chosen backend receives its own table as
``LoadOptions.options`` and checks its keys itself.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.daemon.config import Setting
from inferd.daemon.streams import StreamSpec, parse_stream
from inferd.daemon.units import (
    boolean, non_negative, parse_affinity, parse_duration, positive_int, string_list,
)
from inferd.ipc.errors import ErrorCode, ModelError

log = logging.getLogger(__name__)

SETTINGS_FILE = "model.toml"


def _cores(v: Any) -> list[int]:
    return parse_affinity(v)  # its ValueError says what is wrong


def _shapes(v: Any) -> dict[str, list[int]]:
    if isinstance(v, dict) and all(
            isinstance(k, str) and isinstance(s, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for k, s in v.items()):
        return {k: list(s) for k, s in v.items()}
    raise ValueError


def _placement(v: Any) -> str:
    if v in ("measured", "first"):
        return str(v)
    raise ValueError


def _batching(v: Any) -> str:
    if v in ("adaptive", "fixed"):
        return str(v)
    raise ValueError


def _isolation(v: Any) -> str:
    if v in ("backend", "model", "in-process"):
        return str(v)
    raise ValueError


def _steps(v: Any) -> list[dict[str, Any]]:
    if isinstance(v, list) and all(isinstance(s, dict) for s in v):
        return [dict(s) for s in v]
    raise ValueError


SCHEMA: dict[str, Setting] = {
    # the cache (docs/cache.md)
    "pin": Setting(False, boolean, "true or false"),
    "keep_alive": Setting(None, parse_duration, "a duration such as 30, '90s', '5m' or "
                          "'forever' (default: [cache] keep_alive)"),
    "warmup": Setting(False, boolean, "true or false"),
    "warmup_shapes": Setting({}, _shapes, "a table of input name = list of sizes, e.g. "
                             "{ x = [1, 3, 64, 64] }"),
    # versions (docs/cache.md)
    "version": Setting(None, positive_int, "a positive integer (a version on disk)"),
    "keep_versions": Setting(None, positive_int, "a positive integer"),
    # backends (docs/backends.md)
    "backends": Setting(None, string_list, "a list of backend ids or device kinds, e.g. "
                        "[\"npu\", \"cpu\"]"),
    "placement": Setting(None, _placement, "\"measured\" or \"first\" (default: "
                         "[placement] mode)"),
    "threads": Setting(None, positive_int, "a positive integer (default: the backend's "
                       "own, or measured within a graph)"),
    "isolation": Setting(None, _isolation, "\"backend\", \"model\" or \"in-process\" "
                         "(default: [workers] isolation)"),
    # the model's threads (docs/pipelines.md)
    "instances": Setting(None, positive_int, "a positive integer (default: [models] "
                         "instances)"),
    "queue_size": Setting(None, positive_int, "a positive integer (default: [models] "
                          "queue_size)"),
    "cpu_affinity": Setting(None, _cores, "a non-empty list of core numbers this process "
                            "may use"),
    "max_batch": Setting(1, positive_int, "a positive integer (1: no batching)"),
    "max_delay_ms": Setting(0.0, non_negative, "a number of milliseconds >= 0"),
    "batching": Setting("adaptive", _batching, "\"adaptive\" (batches grow only while the "
                        "measured cost per row falls) or \"fixed\" (always up to max_batch)"),
    "stage_queue_size": Setting(8, positive_int, "a positive integer"),
    "pre": Setting([], _steps, "a list of step tables ([[pre]] with op = processor)"),
    "post": Setting([], _steps, "a list of step tables ([[post]] with op = processor)"),
    # stateful streams (docs/streams.md)
    "stream": Setting(None, parse_stream, "a [stream] table: state = { input = { from = "
                      "output, axis = n, init = \"zeros\" } }, constant, context, chunk, "
                      "max_streams, idle_timeout_s"),
}
"""key -> (default, check, what is expected). A default of None means "not set": the
daemon's configuration decides (see each key's expected text)."""


@dataclass(frozen=True)
class ModelSettings:
    """One model's model.toml, checked. Keys left out have their schema default."""

    pin: bool = False
    keep_alive: float | None = None
    warmup: bool = False
    warmup_shapes: dict[str, list[int]] = field(default_factory=dict)
    version: int | None = None
    keep_versions: int | None = None
    backends: list[str] | None = None
    placement: str | None = None
    threads: int | None = None
    isolation: str | None = None
    instances: int | None = None
    queue_size: int | None = None
    cpu_affinity: list[int] | None = None
    max_batch: int = 1
    max_delay_ms: float = 0.0
    batching: str = "adaptive"
    stage_queue_size: int = 8
    pre: list[dict[str, Any]] = field(default_factory=list)
    post: list[dict[str, Any]] = field(default_factory=list)
    stream: StreamSpec | None = None
    """The ``[stream]`` table: the state the daemon carries between a stream's chunks."""
    backend_tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Tables named after backends (``[openvino]`` ...), unchecked, by name."""

    def backend_options(self, backend_id: str) -> dict[str, Any]:
        """The table for ``backend_id`` (a copy), or {} (``LoadOptions.options``)."""
        return dict(self.backend_tables.get(backend_id, {}))


def check_settings(model: str, raw: dict[str, Any], where: str = SETTINGS_FILE
                   ) -> ModelSettings:
    """Check a parsed model.toml against :data:`SCHEMA`.

    Raises:
        ModelError (INTERNAL): an unknown key or a bad value, naming the model, ``where``
            (the file) and the key.
    """
    values: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for key, value in raw.items():
        setting = SCHEMA.get(key)
        if setting is None:
            if isinstance(value, dict):
                tables[key] = value  # a backend's own table: the backend checks it
                continue
            raise ModelError(f"model {model}: {where}: unknown key {key!r}; known keys: "
                             f"{', '.join(SCHEMA)} (and tables named after a backend id, "
                             f"such as [onnxruntime])", ErrorCode.INTERNAL)
        try:
            values[key] = setting.check(value)
        except ValueError as e:
            why = f" ({e})" if str(e) else ""
            raise ModelError(f"model {model}: {where}: {key} = {value!r}: expected "
                             f"{setting.expected}{why}", ErrorCode.INTERNAL) from None
    return ModelSettings(**values, backend_tables=tables)


def read_settings(model: str, folder: Path) -> ModelSettings:
    """Read and check ``<folder>/model.toml`` (defaults when there is none).

    Raises:
        ModelError (INTERNAL): the file cannot be read, is not UTF-8 TOML, or breaks the
            schema; the message names the model, the file and (for TOML) the position.
    """
    path = folder / SETTINGS_FILE
    try:
        text = path.read_bytes().decode("utf-8")
        raw = tomllib.loads(text)
    except FileNotFoundError:
        return ModelSettings()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if isinstance(e, UnicodeDecodeError):
            reason = f"not UTF-8 (byte {e.start})"
        raise ModelError(f"model {model}: cannot read {path}: {reason}",
                         ErrorCode.INTERNAL) from None
    return check_settings(model, raw, str(path))
