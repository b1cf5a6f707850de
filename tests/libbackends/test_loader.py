"""The plugin loader, in process: search path, discovery, every stage's failures, the
structured WARNING lines, several registries, and the onnxruntime add-on plugin."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tests.libbackends.plugin_kit import copy_into, expected_relu_sigmoid, make_plugin_zoo

from inferd.ipc import defs
from inferd.libbackends.contract import LoadOptions
from inferd.libbackends.discovery import discover
from inferd.libbackends.loader import (
    BUILTINS, Loader, check_contract, load_backends, search_path, usable_dirs,
)
from inferd.libbackends.registry import CandidateError, CandidateStatus, Registry, Stage

# --------------------------------------------------------------------- search path


def test_search_path_strength() -> None:
    env = {"INFERD_BACKENDS_PATH": "/e1:/e2"}
    assert search_path(["/cli"], env, ["/cfg"]) == (["/cli"], "--backends-dir")
    assert search_path(None, env, ["/cfg"]) == (["/e1", "/e2"], "$INFERD_BACKENDS_PATH")
    assert search_path(None, {}, ["/cfg"]) == (["/cfg"], "backends.paths")
    assert search_path(None, {"INFERD_BACKENDS_PATH": ""}, []) == ([defs.BACKENDS_DIR], "default")


def _config(paths: list[str], from_cli: bool = False) -> SimpleNamespace:
    return SimpleNamespace(backends=SimpleNamespace(paths=paths, probe_timeout_s=10.0),
                           security=SimpleNamespace(strict_modes=True),
                           overridden=frozenset({"backends.paths"} if from_cli else ()))


@pytest.mark.slow
def test_the_cli_flag_beats_the_environment_which_beats_the_config(tmp_path: Path) -> None:
    for d in ("cli", "env", "cfg"):
        (tmp_path / d).mkdir()
    env = {"INFERD_BACKENDS_PATH": str(tmp_path / "env")}
    r = Registry()
    load_backends(r, _config([str(tmp_path / "cli")], from_cli=True), env)
    assert (r.search_path, r.search_path_source) == ([str(tmp_path / "cli")], "--backends-dir")
    r = Registry()
    load_backends(r, _config([str(tmp_path / "cfg")]), env)
    assert r.search_path == [str(tmp_path / "env")]
    r = Registry()
    load_backends(r, _config([str(tmp_path / "cfg")]), {})
    assert r.search_path == [str(tmp_path / "cfg")]


def test_bad_paths_are_logged_and_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "ok").mkdir()
    os.symlink(tmp_path / "ok", tmp_path / "ok-link")
    paths = ["relative/dir", str(tmp_path / "missing"), str(tmp_path / "file"),
             str(tmp_path / "ok"), str(tmp_path / "ok-link")]
    with caplog.at_level(logging.WARNING):
        assert usable_dirs(paths, "backends.paths") == [tmp_path / "ok"]
    text = caplog.text
    assert "relative/dir (from backends.paths) is not an absolute path: ignored" in text
    assert "missing (from backends.paths) does not exist: ignored" in text
    assert "file (from backends.paths) is not a directory: ignored" in text


def test_a_missing_default_directory_is_fine(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        dirs = usable_dirs(["/nonexistent/inferd/backends"], "default")
    assert dirs == []
    assert all(r.levelno == logging.INFO for r in caplog.records)
    r = Registry()
    Loader(r).load(dirs)
    assert [c.backend for c in r.candidates] == [b.name for b in BUILTINS]


def test_discovery_is_sorted_across_the_search_path_and_loads_one_file_once(
        tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    (b / "zeta.py").write_text("")
    (b / "alpha.py").write_text("")
    (a / "mid.py").write_text("")
    os.symlink(b / "alpha.py", a / "other_name.py")
    (a / "pkg").mkdir()
    (a / "pkg" / "__init__.py").write_text("")
    (a / "not_a_pkg").mkdir()
    found = discover([a, b])
    assert [(Path(c.path).parent.name, Path(c.path).name, str(c.status)) for c in found] == [
        ("a", "mid.py", "failed"),  # "failed" until a stage passes: not yet loaded
        ("a", "other_name.py", "failed"),
        ("a", "pkg", "failed"),
        ("b", "alpha.py", "skipped"),
        ("b", "zeta.py", "failed"),
    ]
    assert found[3].reason == f"same file as {a / 'other_name.py'}"


# --------------------------------------------------------------------- every stage


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, broken_so, python_example, elementwise_so):  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("zoo") / "backends"
    expected = make_plugin_zoo(directory, broken_so, python_example, elementwise_so)
    return directory, expected


@pytest.fixture(scope="module")
def zoo_loaded(zoo):  # type: ignore[no-untyped-def]
    """The zoo through one Loader with the built-ins, and the log records of that load:
    read by two tests (a load of the zoo takes ~10 s here: a child per plugin, and the
    hanging one costs probe_timeout_s)."""
    directory, _ = zoo
    registry = Registry()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("inferd.libbackends")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        Loader(registry, probe_timeout_s=3.0).load([directory])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return registry, records


@pytest.mark.slow  # the hanging plugin costs probe_timeout_s
def test_every_broken_plugin_is_skipped_at_its_stage(zoo, zoo_loaded
                                                     ) -> None:  # type: ignore[no-untyped-def]
    directory, expected = zoo
    registry, records = zoo_loaded
    got = {Path(c.path).name: c for c in registry.candidates}
    assert set(got) == set(expected) | {f"built-in:{b.name}" for b in BUILTINS}
    for name, (stage, status, words) in expected.items():
        c = got[name]
        assert (str(c.stage), str(c.status)) == (stage, status), (name, c)
        assert words in c.reason, (name, c.reason)
    assert sorted(registry.records) == sorted(["elementwise-c", "fake-npu", "onnx-reference",
                                               *(b.name for b in BUILTINS)])
    assert [b.id for b in registry.available()] == ["onnxruntime", "openvino", "elementwise-c",
                                                    "onnx-reference"]
    # One WARNING per failed or unavailable candidate, with the structured fields.
    warned = {r.PLUGIN_PATH: r for r in records if r.levelno == logging.WARNING}
    for name, (stage, status, words) in expected.items():
        path = str(directory / name)
        if status in ("failed", "unavailable"):
            record = warned[path]
            assert record.STAGE == stage
            assert words in record.getMessage() and path in record.getMessage()
        else:
            assert path not in warned
    assert warned[str(directory / "zz_duplicate.py")].BACKEND == "onnx-reference"
    assert warned[str(directory / "libnodevice_backend.so")].BACKEND == "fake-npu"
    assert not hasattr(warned[str(directory / "bad_syntax.py")], "BACKEND")


@pytest.mark.slow  # the hanging plugin costs probe_timeout_s
def test_the_good_plugins_run_after_their_broken_neighbours(
        zoo, elementwise_model: Path) -> None:  # type: ignore[no-untyped-def]
    directory, _ = zoo
    registry = Registry()
    Loader(registry, probe_timeout_s=3.0, builtins=()).load([directory])
    x = np.array([[-2.0, -0.5, 0.5, 2.0]], np.float32)
    for ident in ("elementwise-c", "onnx-reference"):
        model = registry.records[ident].backend.load(elementwise_model, LoadOptions())
        np.testing.assert_allclose(model.run({"x": x})["y"], expected_relu_sigmoid(x),
                                   rtol=1e-6)
        model.unload()


def test_contract_check_names_each_missing_part() -> None:
    class Nothing:
        pass

    with pytest.raises(CandidateError) as info:
        check_contract(Nothing())
    assert info.value.stage is Stage.CONTRACT_CHECKED
    assert ("lacks method probe(), method supports(), method load(), attribute id, "
            "attribute version, attribute kind") in info.value.reason


@pytest.mark.parametrize("field, value, words", [
    ("id", "has space", "is not 1-64 letters"),
    ("kind", "tpu", "kind 'tpu' is not one of cpu, gpu, npu"),
    ("api_version", (2, 0), "API version 2.0 is incompatible"),
    ("api_version", (1, 3), "API version 1.3 is newer"),
])
def test_contract_check_of_python_values(python_example: Path, field: str, value: object,
                                         words: str) -> None:
    sys.path.insert(0, str(python_example.parent))
    try:
        import onnx_reference
    finally:
        sys.path.remove(str(python_example.parent))
    backend = onnx_reference.create_backend()
    setattr(backend, field, value)
    with pytest.raises(CandidateError) as info:
        check_contract(backend)
    assert words in info.value.reason


def test_a_probe_that_raises_fails_at_probed(tmp_path: Path) -> None:
    (tmp_path / "flaky.py").write_text(textwrap.dedent("""
        from inferd.libbackends.contract import DeviceKind
        class Flaky:
            id, version, kind = "flaky", "1", DeviceKind.GPU
            def probe(self):
                raise OSError("/dev/dri/renderD128: no such device")
            def supports(self, path):
                return False, "never"
            def load(self, path, options):
                raise NotImplementedError
        def create_backend():
            return Flaky()
    """))
    r = Registry()
    Loader(r, builtins=()).load([tmp_path])
    [c] = r.candidates
    assert (c.stage, c.status, c.backend) == (Stage.PROBED, CandidateStatus.FAILED, "flaky")
    assert c.reason == "probe() raised OSError: /dev/dri/renderD128: no such device"
    assert r.records == {}


def test_a_package_plugin_with_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "engine.py").write_text(textwrap.dedent("""
        from inferd.libbackends.contract import DeviceKind, Probe
        class Engine:
            id, version, kind = "mypkg", "2.1", DeviceKind.CPU
            def probe(self):
                return Probe(True, devices=("cpu0",))
            def supports(self, path):
                return False, "demo"
            def load(self, path, options):
                raise NotImplementedError
    """))
    (pkg / "__init__.py").write_text("from .engine import Engine\n"
                                     "def create_backend():\n    return Engine()\n")
    r = Registry()
    Loader(r, builtins=()).load([tmp_path])
    assert r.records["mypkg"].devices == ("cpu0",)
    assert r.records["mypkg"].source == str(pkg)


@pytest.mark.slow  # the hanging plugin costs probe_timeout_s
def test_several_registries_load_the_same_directory(zoo, zoo_loaded, elementwise_model: Path
                                                    ) -> None:  # type: ignore[no-untyped-def]
    directory, _ = zoo
    first, second = zoo_loaded[0], Registry()  # a second load in the same process
    Loader(second, probe_timeout_s=3.0).load([directory])
    assert [c.to_json() for c in first.candidates] == [c.to_json() for c in second.candidates]
    for ident in ("elementwise-c", "onnx-reference"):
        assert first.records[ident].backend is not second.records[ident].backend
    # Python plugins are separate module objects: no state shared between runtimes.
    a = type(first.records["onnx-reference"].backend)
    b = type(second.records["onnx-reference"].backend)
    assert a is not b and a.__module__ != b.__module__
    model = second.records["elementwise-c"].backend.load(elementwise_model, LoadOptions())
    assert model.run({"x": np.zeros((1, 4), np.float32)})["y"].tolist() == [[0.5] * 4]
    model.unload()


@pytest.mark.slow
def test_an_unreadable_file_as_an_unprivileged_user(short_tmp: Path, python_example: Path
                                                    ) -> None:
    """As root every regular file is readable, so this drops to nobody (65534) in a
    child process, where a mode-000 plugin really cannot be read."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges to nobody")
    directory = short_tmp / "backends"  # under /tmp: pytest's tmp_path is root-only
    copy_into(python_example, directory, "locked.py").chmod(0)
    copy_into(python_example, directory, "open.py").chmod(0o644)
    for p in (short_tmp, directory):
        p.chmod(0o755)
    script = textwrap.dedent(f"""
        import json, os
        from pathlib import Path
        # Everything imported first: nobody may not be able to read the interpreter's
        # own library directories.
        import onnx, onnx.helper, onnx.reference
        from inferd.libbackends.loader import Loader
        from inferd.libbackends.registry import Registry
        os.setgid(65534); os.setuid(65534)
        print("DROPPED", flush=True)
        r = Registry()
        Loader(r, builtins=()).load([Path({str(directory)!r})])
        print(json.dumps([c.to_json() for c in r.candidates]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("DROPPED\n")
    got = {Path(c["path"]).name: c for c in json.loads(proc.stdout.split("\n", 1)[1])}
    assert set(got) == {"locked.py", "open.py"}, proc.stdout + proc.stderr
    assert (got["locked.py"]["stage"], got["locked.py"]["status"]) == ("opened", "failed")
    assert got["locked.py"]["reason"] == "cannot read it: Permission denied"
    assert got["open.py"]["status"] == "registered"


# --------------------------------------------------------------------- onnxruntime add-on

# Run in a fresh interpreter: onnxruntime is hidden from the normal sys.path (as on a
# Debian system without the add-on package), and the add-on plugin brings its own copy
# (here: a symlink to the real package in a "vendored" site directory).
ADDON_SCRIPT = """
import importlib.machinery, json, sys
from pathlib import Path

real_site = sys.argv[1]
class HideSystemOnnxruntime:
    def find_spec(self, name, path=None, target=None):
        if name != "onnxruntime":
            return None
        spec = importlib.machinery.PathFinder.find_spec(
            name, [p for p in sys.path if p != real_site])
        if spec is None:  # returning None would let the normal finder find it
            raise ModuleNotFoundError("No module named 'onnxruntime'", name=name)
        return spec
sys.meta_path.insert(0, HideSystemOnnxruntime())

from inferd.libbackends.loader import Loader
from inferd.libbackends.registry import Registry
r = Registry()
Loader(r).load([Path(d) for d in sys.argv[2:]])
backend = r.records.get("onnxruntime")
print(json.dumps({"candidates": [c.to_json() for c in r.candidates],
                  "source": backend and r.records["onnxruntime"].source,
                  "ort": backend and backend.backend._ort.__file__}))
"""

ADDON_PLUGIN = """
import sys
from pathlib import Path

def create_backend():
    vendored = str(Path(__file__).resolve().parent / "site")
    if vendored not in sys.path:
        sys.path.insert(0, vendored)
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
    return OnnxRuntimeCpuBackend()
"""


def _run_addon(*dirs: Path) -> dict:  # type: ignore[type-arg]
    import onnxruntime

    real_pkg = Path(onnxruntime.__file__).parent
    proc = subprocess.run([sys.executable, "-c", ADDON_SCRIPT, str(real_pkg.parent),
                           *map(str, dirs)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def addon_dir(tmp_path: Path) -> Path:
    import onnxruntime

    plugin = tmp_path / "backends" / "onnxruntime"
    (plugin / "site").mkdir(parents=True)
    os.symlink(Path(onnxruntime.__file__).parent, plugin / "site" / "onnxruntime")
    (plugin / "__init__.py").write_text(ADDON_PLUGIN)
    return tmp_path / "backends"


@pytest.mark.slow
def test_onnxruntime_comes_from_the_addon_plugin_when_not_built_in(addon_dir: Path) -> None:
    out = _run_addon(addon_dir)
    builtin, gpu, _openvino, addon = out["candidates"]
    assert builtin["path"] == "built-in:onnxruntime"
    assert (builtin["form"], builtin["stage"], builtin["status"]) == \
        ("built-in", "opened", "failed")
    assert "python module onnxruntime cannot be imported" in builtin["reason"]
    assert (gpu["path"], gpu["stage"], gpu["status"]) == \
        ("built-in:onnxruntime-gpu", "opened", "failed")
    assert (addon["form"], addon["status"], addon["backend"]) == \
        ("python", "registered", "onnxruntime")
    assert out["source"] == str(addon_dir / "onnxruntime")
    assert out["ort"].startswith(str(addon_dir / "onnxruntime" / "site"))


@pytest.mark.slow
def test_the_addon_plugin_is_a_duplicate_when_onnxruntime_is_built_in(addon_dir: Path
                                                                      ) -> None:
    r = Registry()
    Loader(r).load([addon_dir])
    builtin, *_others, addon = r.candidates
    assert builtin.status is CandidateStatus.REGISTERED
    assert (addon.stage, addon.status, addon.backend) == \
        (Stage.REGISTERED, CandidateStatus.FAILED, "onnxruntime")
    assert addon.reason == "id 'onnxruntime' already registered by built-in:onnxruntime"
    assert r.records["onnxruntime"].source == "built-in:onnxruntime"


# --------------------------------------------------------------------- the docs' example


@pytest.mark.slow
def test_the_python_plugin_in_the_docs_loads_and_runs(tmp_path: Path) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    block = docs.split("```python\n# /usr/lib/inferd/backends/doubler.py\n", 1)[1]
    (tmp_path / "doubler.py").write_text(block.split("```", 1)[0])
    r = Registry()
    Loader(r, builtins=()).load([tmp_path])
    [c] = r.candidates
    assert c.status is CandidateStatus.REGISTERED, c
    model = r.records["doubler"].backend.load(tmp_path / "doubler.py", LoadOptions())
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["y"], 2 * x)


def test_a_plugin_that_exits_at_import_is_contained(tmp_path: Path) -> None:
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    r = Registry()
    Loader(r, builtins=()).load([tmp_path])
    [c] = r.candidates
    assert (c.stage, c.status, c.reason) == (Stage.OPENED, CandidateStatus.FAILED,
                                             "import raised SystemExit: 3")


@pytest.mark.slow
def test_loading_native_plugins_leaks_no_fd_thread_or_process(
        tmp_path: Path, elementwise_so: Path, broken_so) -> None:  # type: ignore[no-untyped-def]
    import threading

    import psutil

    copy_into(elementwise_so, tmp_path)
    copy_into(broken_so("segv", "SEGV_IN_GETTER"), tmp_path)
    me = psutil.Process()
    fds, threads = me.num_fds(), threading.active_count()
    Loader(Registry(), builtins=()).load([tmp_path])
    assert me.num_fds() == fds
    assert threading.active_count() == threads
    assert me.children() == []


_GOOD_ENGINE = """
from inferd.libbackends.contract import Backend, Probe
class Engine(Backend):
    id, version, kind = "{id}", "1", "cpu"
    def probe(self):
        {probe}
        return Probe(True)
    def supports(self, path):
        return False
    def load(self, path, options):
        raise NotImplementedError
def create_backend():
    return Engine()
"""


@pytest.mark.slow  # the hanging plugins cost probe_timeout_s
def test_python_plugins_that_exit_crash_or_hang_are_probed_in_a_child(tmp_path: Path
                                                                        ) -> None:
    """Issue 12, item 11: a Python plugin that calls os._exit, crashes or loops forever,
    at import or in its probe, is reported like a native one and the loader survives."""
    (tmp_path / "exits.py").write_text("import os\nos._exit(7)\n")
    (tmp_path / "hangs.py").write_text("while True:\n    pass\n")
    (tmp_path / "probe_exits.py").write_text(
        _GOOD_ENGINE.format(id="probe-exits", probe="import os; os._exit(9)"))
    (tmp_path / "probe_crashes.py").write_text(
        _GOOD_ENGINE.format(id="probe-crashes", probe="import ctypes; ctypes.string_at(0)"))
    (tmp_path / "probe_hangs.py").write_text(
        _GOOD_ENGINE.format(id="probe-hangs", probe="import time; time.sleep(3600)"))
    (tmp_path / "fine.py").write_text(_GOOD_ENGINE.format(id="fine", probe="pass"))
    r = Registry()
    Loader(r, probe_timeout_s=2, builtins=()).load([tmp_path])
    got = {Path(c.path).name: (c.stage, c.status, c.reason) for c in r.candidates}
    assert got["exits.py"] == (Stage.OPENED, CandidateStatus.FAILED,
                               "probe process exited with status 7 while calling import")
    assert got["hangs.py"] == (Stage.OPENED, CandidateStatus.FAILED,
                               "hung: no answer within 2 s while calling import")
    assert got["probe_exits.py"][:2] == (Stage.PROBED, CandidateStatus.FAILED)
    assert got["probe_exits.py"][2].startswith(
        "probe process exited with status 9 while calling probe()")
    assert got["probe_crashes.py"][:2] == (Stage.PROBED, CandidateStatus.FAILED)
    assert got["probe_crashes.py"][2].startswith("crashed with SIGSEGV while calling probe()")
    assert got["probe_hangs.py"][:2] == (Stage.PROBED, CandidateStatus.FAILED)
    assert got["fine.py"][1] is CandidateStatus.REGISTERED
    assert [b["id"] for b in r.describe()] == ["fine"]
