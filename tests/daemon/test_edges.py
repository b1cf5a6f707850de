"""Edge cases an operator meets (issue 12, items 6, 7 and 8): symbolic links out of the
model repository, config files with odd bytes, values or groups, a repository that is
not there, and .npy files inferctl must not trust."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inferd.daemon.config import load_config
from inferd.daemon.repository import Repository
from inferd.ipc.errors import ConfigError, ModelError


def _inferd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferd.daemon.main", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


# --------------------------------------------------------------------- item 7: config

@pytest.mark.parametrize("text, words", [
    (b"# caf\xe9\n[models]\nqueue_size = 3\n", "byte 0xe9 at offset 5 is not UTF-8"),
    (b"[models]\nqueue_size = 99999999999999999999\n", "up to 1000000"),
    (b"[server]\nmax_requests_per_client = 0\n", "positive integer"),
    (b"[server]\nshutdown_grace_s = inf\n", "positive number of seconds"),
    (b"[server]\nshutdown_grace_s = nan\n", "positive number of seconds"),
    (b"[server]\nmax_message_bytes = \"64GiB\"\n", "up to 4GiB"),
    (b"[server]\nsocket_group = \"no-such-group-4242\"\n", "an existing group name"),
])
def test_bad_config_is_one_line_naming_the_file(tmp_path, text, words):
    path = tmp_path / "inferd.toml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert words in info.value.message and str(path) in info.value.message


@pytest.mark.slow
@pytest.mark.parametrize("text", [b"# caf\xe9\n",
                                  b"[server]\nsocket_group = \"no-such-group-4242\"\n"])
def test_the_daemon_says_it_in_one_line_and_leaves_no_socket(tmp_path, text):
    path = tmp_path / "inferd.toml"
    path.write_bytes(text)
    r = _inferd("--config", str(path), "--socket", f"ipc://{tmp_path}/s.sock", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.slow
def test_missing_repository_is_a_warning_and_in_status(tmp_path, start_daemon):
    d = start_daemon("--models", str(tmp_path / "nowhere"))
    with d.client() as c:
        status = c.status()
    assert "does not exist" in status["repository_problem"]
    assert "model repository" in d.log() and "WARNING" in d.log()
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", d.endpoint,
                        "status"], capture_output=True, text=True, timeout=60)
    assert "warning:  model repository" in r.stdout


# --------------------------------------------------------------------- item 6: links

def _repo(tmp_path: Path, models_dir: Path) -> tuple[Path, Path]:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    shutil.copytree(models_dir / "ocr-cls", repo / "inside")
    shutil.copytree(models_dir / "ocr-cls", outside / "m")
    return repo, outside


def test_links_out_of_the_repository_are_refused(tmp_path, models_dir):
    repo, outside = _repo(tmp_path, models_dir)
    (repo / "dirlink").symlink_to(outside / "m")                 # a model directory
    (repo / "verlink").mkdir()
    (repo / "verlink" / "1").symlink_to(outside / "m" / "1")     # a version directory
    (repo / "filelink" / "1").mkdir(parents=True)
    (repo / "filelink" / "1" / "model.onnx").symlink_to(outside / "m" / "1" / "model.onnx")
    secret = outside / "shadow"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    shutil.copytree(models_dir / "ocr-cls", repo / "tomllink")
    (repo / "tomllink" / "model.toml").unlink(missing_ok=True)
    (repo / "tomllink" / "model.toml").symlink_to(secret)
    (repo / "innerlink").symlink_to(repo / "inside")              # inside: fine

    r = Repository(repo.resolve())
    assert r.names() == ["innerlink", "inside", "tomllink"]
    with pytest.raises(ModelError) as info:
        r._settings_link_check("tomllink")
    assert "secret" not in info.value.message and "outside" in info.value.message
    spec = r.spec("tomllink")
    assert spec is not None and spec.error and "secret" not in spec.error
    with pytest.raises(ModelError):
        r.resolve("dirlink")

    allowed = Repository(repo.resolve(), allow_external_links=True)
    assert set(allowed.names()) == {"dirlink", "verlink", "filelink", "innerlink", "inside",
                                    "tomllink"}


@pytest.mark.slow
def test_daemon_does_not_serve_or_echo_a_link_out(tmp_path, models_dir, start_daemon,
                                                  demo_inputs):
    repo, outside = _repo(tmp_path, models_dir)
    (repo / "dirlink").symlink_to(outside / "m")
    secret = outside / "shadow"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    shutil.copytree(models_dir / "ocr-cls", repo / "tomllink")
    (repo / "tomllink" / "model.toml").unlink(missing_ok=True)
    (repo / "tomllink" / "model.toml").symlink_to(secret)
    d = start_daemon("--models", str(repo))
    with d.client() as c:
        names = {m["name"]: m for m in c.models()}
        assert "dirlink" not in names and "inside" in names
        assert "secret" not in str(names["tomllink"])
        from inferd.ipc import RequestError
        for model in ("dirlink", "tomllink"):
            with pytest.raises(RequestError) as info:
                c.infer(model, demo_inputs["ocr-cls"])
            assert "secret" not in info.value.message
        assert c.infer("inside", demo_inputs["ocr-cls"])
    assert "outside the repository" in d.log()


# --------------------------------------------------------------------- item 8: inferctl

@pytest.mark.parametrize("content", ["pickled", "garbage", "missing", "truncated"])
def test_inferctl_bad_npy_is_one_line_and_exit_1(tmp_path, content):
    path = tmp_path / "x.npy"
    if content == "pickled":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif content == "garbage":
        path.write_bytes(pickle.dumps(object) + b"\0" * 10)
    elif content == "truncated":
        np.save(path, np.zeros((100, 100), np.float32))
        path.write_bytes(path.read_bytes()[:500])
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket",
                        f"ipc://{tmp_path}/none.sock", "infer", "m", "-i", f"x={path}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"inferctl: cannot read {path}")
    assert os.path.exists(path) or content == "missing"
