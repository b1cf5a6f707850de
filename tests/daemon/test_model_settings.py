"""The model.toml schema (daemon/model_settings.py): every key checked once per scan,
an unknown key or a bad value is one load error naming the model, the file and the key,
a backend's own table passes through to that backend, and a broken file fails only its
own model (the repository scan goes on)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from inferd.daemon.config import load_config
from inferd.daemon.model_settings import SCHEMA, ModelSettings, check_settings, read_settings
from inferd.daemon.models import ModelManager
from inferd.daemon.placement import backend_options
from inferd.daemon.repository import Repository
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.replies import ReplySink
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from inferd.libbackends.registry import Registry
from tests.links import link_file


def test_defaults_when_there_is_no_model_toml(tmp_path: Path) -> None:
    assert read_settings("m", tmp_path) == ModelSettings()
    assert ModelSettings().max_batch == 1 and ModelSettings().instances is None


def test_every_schema_key_is_a_settings_field() -> None:
    fields = set(ModelSettings.__dataclass_fields__) - {"backend_tables"}
    assert fields == set(SCHEMA)


@pytest.mark.parametrize("raw, key, words", [
    ({"instances": "two"}, "instances", "expected a positive integer"),
    ({"instancse": 2}, "instancse", "unknown key 'instancse'; known keys: pin,"),
    ({"pin": "yes"}, "pin", "true or false"),
    ({"keep_alive": "soon"}, "keep_alive", "a duration"),
    ({"backends": "cpu"}, "backends", "a list of backend ids"),
    ({"max_batch": 0}, "max_batch", "a positive integer"),
    ({"max_delay_ms": -1}, "max_delay_ms", ">= 0"),
    ({"cpu_affinity": [99999]}, "cpu_affinity", "not usable by this process"),
    ({"warmup_shapes": {"x": [1, "a"]}}, "warmup_shapes", "list of sizes"),
    ({"pre": "softmax"}, "pre", "list of step tables"),
    ({"version": 0}, "version", "positive integer"),
])
def test_a_bad_key_names_the_model_the_file_and_the_key(raw: dict[str, Any], key: str,
                                                         words: str) -> None:
    with pytest.raises(ModelError) as e:
        check_settings("m", raw, "/repo/m/model.toml")
    message = e.value.message
    assert message.startswith("model m: /repo/m/model.toml: ") and key in message, message
    assert words in message and e.value.code is ErrorCode.INTERNAL


def test_tables_named_after_backends_pass_through_unchecked() -> None:
    s = check_settings("m", {"instances": 2, "openvino": {"device": "GPU", "anything": 1},
                             "onnxruntime-gpu": {"device_id": 0}})
    assert s.instances == 2
    assert s.backend_options("openvino") == {"device": "GPU", "anything": 1}
    assert s.backend_options("onnxruntime-gpu") == {"device_id": 0}
    assert s.backend_options("rknn") == {}


def test_backend_options_are_the_model_table_over_the_config_section() -> None:
    config = load_config(None)
    s = check_settings("m", {"onnxruntime": {"arena_shrinkage": False}})
    merged = backend_options(config, s, "onnxruntime")
    assert merged["arena_shrinkage"] is False
    assert merged["arena_extend_strategy"] == config.onnxruntime.arena_extend_strategy
    assert backend_options(config, check_settings("m", {"openvino": {"x": 1}}),
                           "openvino") == {**vars(config.openvino), "x": 1}
    assert backend_options(config, s, "rknn") == {}  # no section, no table


def test_ncnn_memory_settings_come_from_inferd_toml_and_a_model_overrides_them(
        tmp_path: Path) -> None:
    (tmp_path / "inferd.toml").write_text(
        '[ncnn]\nmemory_pool = "run"\nwinograd = false\nsgemm = false\n')
    config = load_config(tmp_path / "inferd.toml")
    lean = backend_options(config, check_settings("m", {}), "ncnn")
    assert (lean["memory_pool"], lean["winograd"], lean["sgemm"]) == ("run", False, False)
    fast = backend_options(config, check_settings("m", {"ncnn": {"winograd": True}}), "ncnn")
    assert (fast["memory_pool"], fast["winograd"]) == ("run", True)
    default = backend_options(load_config(None), check_settings("m", {}), "ncnn")
    assert (default["memory_pool"], default["winograd"], default["sgemm"]) == ("net", True, True)
    (tmp_path / "inferd.toml").write_text('[ncnn]\nmemory_pool = "arena"\n')
    with pytest.raises(InferdError) as e:
        load_config(tmp_path / "inferd.toml")
    assert "memory_pool" in e.value.message and "'net' or 'run'" in e.value.message


@pytest.mark.parametrize("content, words", [
    (b"instances = \n", "Invalid value (at line 1, column 13)"),
    (b'name = "\xff"\n', "not UTF-8 (byte"),
    (b"[openvino\n", "Expected ']'"),
])
def test_an_unreadable_model_toml_fails_only_its_own_model_and_is_logged(
        tmp_path: Path, content: bytes, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("bad", "good"):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.onnx").write_bytes(b"x")
    (tmp_path / "bad" / "model.toml").write_bytes(content)
    (tmp_path / "good" / "model.toml").write_text("instances = 2\n")
    caplog.set_level(logging.ERROR, "inferd.daemon.repository")
    specs = Repository(tmp_path).scan()
    assert specs["good"].error is None and specs["good"].settings.instances == 2
    error = specs["bad"].error
    assert error is not None and words in error
    assert f"cannot read {tmp_path / 'bad' / 'model.toml'}" in error
    assert f"model bad cannot be served: {error}" in caplog.text


class _Recording(OnnxRuntimeCpuBackend):
    """The real onnxruntime backend under another id, keeping the options it was given."""

    id = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.options: list[dict[str, Any]] = []

    def load(self, model_path: Path, options: LoadOptions) -> Any:
        self.options.append(options.options)
        # its table is its own: onnxruntime underneath gets none (it refuses unknown keys)
        return super().load(model_path, dataclasses.replace(options, options={}))


def test_the_chosen_backend_gets_its_own_table_as_load_options(
        tmp_path: Path, models_dir: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    link_file(models_dir / "ocr-cls" / "1" / "model.onnx", tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "model.toml").write_text(
        'backends = ["recording"]\n[recording]\nthreads = 3\n[openvino]\ndevice = "GPU"\n')
    backend = _Recording()
    registry = Registry()
    registry.register(backend)
    config = load_config(None, {"models.repository": str(tmp_path)})
    manager = ModelManager(Repository(tmp_path), registry, lambda: config, ReplySink())
    try:
        assert manager.load("m").backend == "recording"
        assert backend.options == [{"threads": 3}]
    finally:
        assert manager.stop(30)


def test_the_model_toml_reference_lists_every_schema_key_and_no_other() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "model-toml.md").read_text()
    table = text.split("## Keys", 1)[1].split("\n\n", 2)[1]
    documented = set()
    for row in table.splitlines()[2:]:
        cell = row.split("|")[1]
        documented |= {k.strip(" `") for k in cell.split(",")}
    assert documented == set(SCHEMA)
