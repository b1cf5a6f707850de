"""The backend add-on folders of packaging/backends/ and the staging that turns each into
a Debian package for one architecture (packaging/stage_backends.py). The built packages
themselves are checked by `make deb-test`, `deb-test-systemd` and `deb-test-arm64`."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "packaging" / "backends"
ADDONS = sorted(p for p in BACKENDS.iterdir() if (p / "control").exists())

spec = importlib.util.spec_from_file_location("stage_backends",
                                              ROOT / "packaging" / "stage_backends.py")
stage_backends = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage_backends)


def test_there_is_at_least_the_onnxruntime_addon():
    assert "onnxruntime" in [p.name for p in ADDONS]


@pytest.mark.parametrize("addon", ADDONS, ids=lambda p: p.name)
def test_addon_folder_is_complete(addon: Path):
    control = (addon / "control").read_text()
    assert re.search(rf"^Package: inferd-backend-{re.escape(addon.name)}$", control, re.M)
    arches = re.search(r"^Architecture: (.+)$", control, re.M).group(1).split()
    assert arches and set(arches) <= set(stage_backends.MACHINES), arches
    assert re.search(r"^Depends:.*inferd \(= \$\{source:Version\}\)", control, re.M | re.S)
    spec = tomllib.loads((addon / "package.toml").read_text())
    assert set(spec.get("arch", {})) <= set(arches), "an [arch.X] table for an unbuilt arch"
    vendors = False
    for arch in arches:
        settings = stage_backends.settings(spec, arch, addon.name)  # no unknown key
        vendors |= bool(settings["wheels"])
        for folder in settings["plugins"].values():
            assert "def create_backend" in (addon.parent / folder / "__init__.py").read_text()
        for requirement in settings["wheels"]:
            stage_backends.wheel_names(requirement)  # pinned with ==
        for name in settings["substvars"]:
            assert f"${{{name}}}" in control, f"substvar {name} unused in control"
    copyright = (addon / "copyright").read_text()
    # what it vendors, or (an add-on that vendors nothing) the plugin's own files
    files = f"debian/vendor/{addon.name}/*" if vendors else f"packaging/backends/{addon.name}/*"
    assert copyright.startswith(f"Files: {files}\n")
    assert re.search(r"^License: \S+", copyright, re.M)
    assert "def create_backend" in (addon / "__init__.py").read_text()
    overrides = addon / "lintian-overrides"
    if overrides.exists():  # each block of overrides carries its reason in comments above
        blocks = [b.splitlines() for b in re.split(r"\n\s*\n", overrides.read_text().strip())]
        for block in blocks:
            assert block[0].startswith("#"), block


def test_per_architecture_settings_add_to_the_common_ones():
    spec = {"wheels": ["a==1"], "prune": ["x"],
            "arch": {"arm64": {"wheels": ["b==2"], "substvars": {"b:Depends": "python3-b"}}}}
    arm = stage_backends.settings(spec, "arm64")
    amd = stage_backends.settings(spec, "amd64")
    assert arm["wheels"] == ["a==1", "b==2"] and amd["wheels"] == ["a==1"]
    assert arm["substvars"] == {"b:Depends": "python3-b"}
    assert amd["substvars"] == {"b:Depends": ""}  # defined everywhere the stanza uses it
    with pytest.raises(SystemExit, match="unknown package.toml keys"):
        stage_backends.settings({"wheel": ["typo==1"]}, "amd64")


def test_platforms_cover_every_manylinux_tag_of_debian_12():
    tags = stage_backends.platforms("aarch64")
    # onnxruntime >= 1.17 is manylinux_2_28 on aarch64; pip does not widen an explicit tag
    assert "manylinux_2_28_aarch64" in tags and "manylinux_2_17_aarch64" in tags
    assert "manylinux_2_36_aarch64" in tags and "manylinux_2_37_aarch64" not in tags


def test_an_addon_not_built_for_the_arch_is_skipped_with_its_reason(tmp_path: Path):
    addon = tmp_path / "backends" / "demo"
    addon.mkdir(parents=True)
    (addon / "control").write_text("Package: inferd-backend-demo\nArchitecture: arm64\n")
    (addon / "package.toml").write_text('wheels = ["demo==1.0"]\n')
    debian = tmp_path / "tree" / "debian"
    debian.mkdir(parents=True)
    result = stage_backends.stage(addon, "amd64", debian, tmp_path / "cache", sys.executable)
    assert result == ("skip inferd-backend-demo for amd64: its control lists only "
                      "['arm64']")
    assert not (debian / "vendor").exists()


@pytest.mark.slow  # pip takes seconds to start
def test_an_addon_without_an_upstream_wheel_is_skipped_with_pips_reason(tmp_path: Path,
                                                                         monkeypatch):
    """Real pip, offline: no index and an empty --find-links folder, so pip itself finds
    no distribution (what it says for onnxruntime-gpu on aarch64)."""
    addon = tmp_path / "backends" / "demo"
    addon.mkdir(parents=True)
    (addon / "control").write_text("Package: inferd-backend-demo\nArchitecture: amd64\n")
    (addon / "package.toml").write_text('wheels = ["inferd-no-such-wheel==1.0"]\n')
    (addon / "copyright").write_text("Files: debian/vendor/demo/*\nLicense: Expat\n")
    debian = tmp_path / "tree" / "debian"
    debian.mkdir(parents=True)
    (debian / "control").write_text("Source: inferd\n")
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    result = stage_backends.stage(addon, "amd64", debian, tmp_path / "cache", sys.executable)
    assert result.startswith("skip inferd-backend-demo for amd64: upstream publishes no "
                             "inferd-no-such-wheel==1.0 wheel for x86_64"), result
    assert (debian / "control").read_text() == "Source: inferd\n"


def test_copyright_paragraph_goes_before_the_standalone_licences(tmp_path: Path):
    f = tmp_path / "copyright"
    f.write_text("Format: x\n\nFiles: *\nLicense: Apache-2.0\n\nLicense: Apache-2.0\n text\n")
    stage_backends.insert_copyright(f, "Files: debian/vendor/demo/*\nLicense: Expat\n text\n")
    paragraphs = f.read_text().split("\n\n")
    assert [p.split("\n")[0] for p in paragraphs] == [
        "Format: x", "Files: *", "Files: debian/vendor/demo/*", "License: Apache-2.0"]


def test_plugin_directories_must_be_importable_names():
    # the daemon's loader skips a plugin directory whose name is not an identifier
    # (inferd-backend-onnxruntime-gpu's plugin is onnxruntime_gpu/)
    assert stage_backends.settings({}, "amd64", "rknn")["plugins"] == {"rknn": "rknn"}
    with pytest.raises(SystemExit, match="Python identifiers"):
        stage_backends.settings({}, "amd64", "onnxruntime-gpu")
    spec = {"plugins": {"onnxruntime_gpu": "onnxruntime-gpu"}, "vendor_dir": "onnxruntime"}
    s = stage_backends.settings(spec, "amd64", "onnxruntime-gpu")
    assert s["vendor_dir"] == "onnxruntime" and s["compression"] == "xz"
    with pytest.raises(SystemExit, match="compression"):
        stage_backends.settings({"compression": "zstd"}, "amd64", "x")
