"""packaging/build_deps.py, what `make deb` runs first: the package list it derives from
debian/control (host libraries qualified for a cross build), and the apt-get line it
prints, instead of installing, when it does not run as root."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# loaded from its file: packaging/ on sys.path would make packaging/rknn (a folder of
# requirements) importable as a namespace package `rknn`, and the RKNN backend's probe
# would take it for rknn-toolkit2 in every later test of the run
_spec = importlib.util.spec_from_file_location("build_deps", ROOT / "packaging" / "build_deps.py")
assert _spec is not None and _spec.loader is not None
build_deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_deps)


def test_the_list_comes_from_the_control_file():
    tools, native = build_deps.wanted("amd64", cross=False)
    assert tools == ["build-essential", "dpkg-dev", "python3-venv"]
    assert {"debhelper-compat", "dh-python", "libzmq3-dev", "libjansson-dev",
            "python3-zmq"} <= set(native.values())
    tools, cross = build_deps.wanted("arm64", cross=True)
    assert "crossbuild-essential-arm64" in tools
    # the libraries libinferd links are the host's; the tools and :native ones the build's
    assert cross["libzmq3-dev"] == "libzmq3-dev:arm64"
    assert cross["libjansson-dev"] == "libjansson-dev:arm64"
    assert cross["python3-numpy"] == "python3-numpy" and cross["dh-python"] == "dh-python"


def test_without_root_it_prints_the_apt_get_line_and_stops(monkeypatch, capsys):
    monkeypatch.setattr(build_deps, "missing", lambda arch, cross: ["dh-python", "lintian-x"])
    monkeypatch.setattr(build_deps.os, "geteuid", lambda: 1000)
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert build_deps.main(["build_deps.py", arch]) == 1
    err = capsys.readouterr().err
    assert f"make deb ARCH={arch} needs packages this machine lacks" in err
    assert "  sudo apt-get install --no-install-recommends dh-python lintian-x" in err


def test_nothing_missing_means_nothing_to_do(monkeypatch):
    monkeypatch.setattr(build_deps, "missing", lambda arch, cross: [])
    monkeypatch.setattr(build_deps.os, "geteuid", lambda: 1000)
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert build_deps.main(["build_deps.py", arch]) == 0


@pytest.mark.parametrize("relation, names", [
    ("debhelper-compat (= 13), dh-python", ["debhelper-compat", "dh-python"]),
    ("python3-numpy:native <!nocheck>, a | b [amd64]", ["python3-numpy:native", "a"]),
])
def test_relation_fields_give_package_names(relation, names):
    assert build_deps.names(relation) == names
